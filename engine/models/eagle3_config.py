"""An EAGLE-3 head's configuration, read from either public checkpoint format.

- Flat EAGLE / SpecForge: a Llama-style config.json with architectures ["LlamaForCausalLMEagle3"], the head's one
  layer's shape at the top level, `draft_vocab_size`, and the auxiliary layers as `eagle_aux_hidden_state_layer_ids`
  (top level, or inside `eagle_config`). Weights: midlayer.*, fc, norm, lm_head, d2t, t2d; no embedding (the target's
  is shared).
- speculators: architectures ["Eagle3Speculator"], the layer's shape in `transformer_layer_config` (a Llama or Qwen3
  config), `draft_vocab_size`, `norm_before_residual`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`.
  Weights: layers.0.*, fc, norm, lm_head, d2t, t2d, and an embed_tokens of its own where the head was trained with
  one. Its options norm_before_fc (weights input_norm), fc_norm (fc_norm.i) and norm_output change the head's math
  (engine/models/eagle3.py); the first two exclude each other.

Keys absent take the defaults vLLM reads them with: auxiliary layers (2, L // 2, L - 3) of an L-layer target,
norm_before_residual false (also the default of the speculators library's saved Eagle3SpeculatorConfig; newer
training front ends default it to true but write the key out in the configs they save, so an absent key means an
older head trained without it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import LlamaConfig, PretrainedConfig, Qwen3Config

from engine.model_config import ModelConfig

FLAT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHITECTURES = ("Eagle3Speculator",)
_LAYER_CONFIGS: dict[str, type[PretrainedConfig]] = {"llama": LlamaConfig, "qwen3": Qwen3Config}


def is_eagle3_checkpoint(path: str | Path) -> bool:
    """Whether the directory holds an EAGLE-3 head in either format."""
    raw = _read(Path(path))
    return bool(set(raw.get("architectures") or []) & set(FLAT_ARCHITECTURES + SPECULATORS_ARCHITECTURES))


def _read(path: Path) -> dict[str, Any]:
    f = path / "config.json"
    if not f.is_file():
        raise ValueError(f"{path} has no config.json")
    return json.loads(f.read_text())


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The layers whose input an EAGLE-3 head reads when its config names none (vLLM's default)."""
    n = num_target_layers
    return (2, n // 2, n - 3)


@dataclass
class Eagle3ModelConfig(ModelConfig):
    """A ModelConfig for the head's one decoder layer (hf_config: that layer's Llama or Qwen3 config; vocab_size: the
    target's, the width of the logits the head returns), with the head's own facts."""

    checkpoint_format: str = "flat"  # "flat" (EAGLE / SpecForge) | "speculators"
    draft_vocab_size: int = 0
    aux_layer_ids: tuple[int, ...] = ()  # target layers whose incoming residual stream the head reads
    target_hidden_size: int = 0  # width of each auxiliary state (the fc's input is len(aux_layer_ids) times it)
    norm_before_residual: bool = False  # hidden_norm applied before the residual is taken (True) or after
    norm_before_fc: bool = False  # one RMSNorm over the concatenated auxiliary states before fc
    fc_norm: bool = False  # an RMSNorm per auxiliary state before the concatenation
    norm_output: bool = False  # a draft step feeds the next its final norm's output, not its input
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_head(cls, path: str | Path, target: ModelConfig) -> Eagle3ModelConfig:
        path = Path(path)
        raw = _read(path)
        archs = list(raw.get("architectures") or [])
        if set(archs) & set(SPECULATORS_ARCHITECTURES):
            fmt = "speculators"
            layer_raw = dict(raw.get("transformer_layer_config") or {})
            if not layer_raw:
                raise ValueError(f"{path}: an Eagle3Speculator config needs transformer_layer_config")
            aux = raw.get("eagle_aux_hidden_state_layer_ids")
        elif set(archs) & set(FLAT_ARCHITECTURES):
            fmt = "flat"
            layer_raw = {k: v for k, v in raw.items() if k not in ("architectures", "eagle_config")}
            layer_raw.setdefault("model_type", "llama")
            aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
                "eagle_aux_hidden_state_layer_ids")
        else:
            raise ValueError(f"{path} is not an EAGLE-3 head: architectures {archs}; expected one of "
                             f"{list(FLAT_ARCHITECTURES + SPECULATORS_ARCHITECTURES)}")
        if raw.get("norm_before_fc") and raw.get("fc_norm"):
            raise ValueError(f"{path}: norm_before_fc and fc_norm exclude each other (one norm over the concatenated "
                             "states, or one per state)")
        model_type = layer_raw.get("model_type", "llama")
        if model_type not in _LAYER_CONFIGS:
            raise ValueError(f"{path}: the head's layer is a {model_type!r} layer; supported: "
                             f"{sorted(_LAYER_CONFIGS)}")
        layer_raw.pop("model_type", None)
        layer_raw["num_hidden_layers"] = 1
        layer_raw["architectures"] = ["LlamaForCausalLM"]
        hf = _LAYER_CONFIGS[model_type](**layer_raw)
        aux_ids = tuple(int(i) for i in aux) if aux else default_aux_layers(target.num_layers)
        bad = [i for i in aux_ids if not 0 <= i < target.num_layers]
        if bad or len(set(aux_ids)) != len(aux_ids):
            raise ValueError(f"{path}: auxiliary layer ids {list(aux_ids)} must be distinct layers of the target's "
                             f"{target.num_layers}")
        draft_vocab = int(raw.get("draft_vocab_size") or hf.vocab_size)
        target_hidden = int(raw.get("target_hidden_size") or target.hidden_size)
        if target_hidden != target.hidden_size:
            raise ValueError(f"{path}: the head reads hidden states of width {target_hidden}, the target's are "
                             f"{target.hidden_size}")
        if hf.vocab_size != target.vocab_size:
            raise ValueError(f"{path}: the head's vocabulary ({hf.vocab_size} tokens) is not the target's "
                             f"({target.vocab_size}); a head must come from the target's tokenizer")
        if not 0 < draft_vocab <= target.vocab_size:
            raise ValueError(f"{path}: draft_vocab_size {draft_vocab} must be in [1, {target.vocab_size}]")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        return cls(
            path=path, hf_config=hf, architecture=archs[0], family="eagle3", num_layers=1,
            hidden_size=hf.hidden_size, num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads, head_dim=head_dim,
            vocab_size=target.vocab_size, max_position_embeddings=target.max_position_embeddings,
            layer_sliding_windows=[None], layer_types=["full_attention"], max_model_len=target.max_model_len,
            checkpoint_format=fmt, draft_vocab_size=draft_vocab, aux_layer_ids=aux_ids,
            target_hidden_size=target_hidden, norm_before_residual=bool(raw.get("norm_before_residual", False)),
            norm_before_fc=bool(raw.get("norm_before_fc", False)), fc_norm=bool(raw.get("fc_norm", False)),
            norm_output=bool(raw.get("norm_output", False)))
