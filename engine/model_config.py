"""What a model looks like to the engine: the facts read from its HF config (family, layers, heads, KV-cache
groups, stop ids), for every architecture the engine runs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


@dataclass
class ModelConfig:
    """The facts about one model that the engine needs, read from its HF config."""

    path: Path
    hf_config: PretrainedConfig
    architecture: str
    family: str  # "llama" | "gemma3" | "gpt_oss" | "qwen3_moe": which implementation in engine/models
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    layer_sliding_windows: list[int | None]  # [num_layers]; None = full attention
    layer_types: list[str]  # [num_layers]; "full_attention" | "sliding_attention"
    max_model_len: int = 0  # context the engine serves (RoPE tables are built this long); 0 = model's max

    def __post_init__(self) -> None:
        if self.max_model_len <= 0:
            self.max_model_len = self.max_position_embeddings

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        hf = AutoConfig.from_pretrained(path)
        # Gemma 3 multimodal checkpoints wrap the text model; we serve the text part only.
        if hasattr(hf, "text_config") and getattr(hf, "model_type", "") == "gemma3":
            hf = hf.text_config
            hf.architectures = ["Gemma3ForCausalLM"]
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or getattr(hf, 'model_type', '?')} in {path}; "
                f"specserve supports {sorted(SUPPORTED_ARCHITECTURES)}")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        windows = _layer_sliding_windows(hf)
        return cls(
            path=path, hf_config=hf, architecture=arch, family=SUPPORTED_ARCHITECTURES[arch],
            num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads, head_dim=head_dim,
            vocab_size=hf.vocab_size,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
            layer_sliding_windows=windows,
            layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
        )

    @property
    def eos_token_ids(self) -> list[int]:
        """The config's EOS ids, then generation_config.json's extra ones (chat models often end a turn with a
        token the config does not name: vLLM stops on those too)."""
        ids = _as_ids(getattr(self.hf_config, "eos_token_id", None))
        gen = Path(self.path) / "generation_config.json"
        if gen.is_file():
            try:
                extra = _as_ids(json.loads(gen.read_text()).get("eos_token_id"))
            except (OSError, ValueError, AttributeError):
                extra = []  # an unreadable file adds nothing; the config's ids still stop
            ids += [t for t in extra if t not in ids]
        return ids


def _as_ids(eos: object) -> list[int]:
    if eos is None:
        return []
    return [int(t) for t in eos] if isinstance(eos, (list, tuple)) else [int(eos)]  # type: ignore[arg-type]


def _layer_sliding_windows(hf: PretrainedConfig) -> list[int | None]:
    """Sliding window per layer. Newer configs list `layer_types`; Mistral-style configs set one
    `sliding_window` for every layer."""
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" and window else None for t in layer_types[:n]]
    if getattr(hf, "use_sliding_window", None) is False:
        return [None] * n
    return [window if window else None] * n
