"""The draft's shape and its starting point: a few of the target's own layers on the target's embeddings.

A draft must share the target's tokenizer and vocabulary (the engine verifies draft tokens as target tokens).
With the target's hidden size it can also reuse, frozen, the target's embedding table (and untied head): those
are most of a small model's parameters, so the draft stores only its layers, and it starts from evenly spaced
target layers plus the target's final norm, which already map the target's residual stream to its head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, PretrainedConfig, PreTrainedModel, Qwen2Config

logger = logging.getLogger("specserve")

LAYER_TYPES = ("full_attention", "sliding_attention")
_LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
# Model types whose HF implementation honours per-layer `layer_types` (sliding vs full attention).
_PER_LAYER_TYPES = ("qwen2", "qwen3", "gemma3_text")
# Config keys that describe the checkpoint rather than the architecture; the student's own are set anew.
_DROP_KEYS = ("architectures", "model_type", "transformers_version", "_name_or_path", "layer_types", "auto_map",
              "torch_dtype", "dtype", "sliding_window_pattern", "max_window_layers", "use_sliding_window")


@dataclass
class StudentSpec:
    """The draft's shape; None = the target's value."""

    num_layers: int = 2
    hidden_size: int | None = None  # the target's lets the draft share its embeddings and start from its layers
    intermediate_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    layer_types: list[str] | None = None  # per layer, from LAYER_TYPES; None = the source layers' types
    sliding_window: int | None = None  # for "sliding_attention" layers; None = the target's

    def validate(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"a draft needs at least one layer, got num_layers={self.num_layers}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types lists {len(self.layer_types)} layers for num_layers="
                                 f"{self.num_layers}")
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad:
                raise ValueError(f"unknown layer types {bad}; use {LAYER_TYPES}")
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "sliding_window"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be positive, got {v}")


@dataclass
class Student:
    model: PreTrainedModel  # HF causal LM, float32, trainable except `shared`
    source_layers: list[int]  # target layer each student layer started from ([] = random start)
    shared: list[str] = field(default_factory=list)  # checkpoint names reused, frozen, from the target

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint of the student must hold: everything but the shared (frozen, target-owned) tensors."""
        return {k: v for k, v in self.model.state_dict().items() if k not in self.shared and not self._tied(k)}

    def _tied(self, name: str) -> bool:
        return name == "lm_head.weight" and bool(self.model.config.tie_word_embeddings)


def source_layers(num_target_layers: int, num_layers: int) -> list[int]:
    """Evenly spaced target layers from the first on (stride num_target_layers / num_layers): 30 -> 2 gives
    [0, 15], 30 -> 3 gives [0, 10, 20].

    The first layer reads the embeddings as the draft's first layer must. The last target layer is left out: it
    writes for a residual stream built by all the layers before it, and measured on SmolLM2-135M a draft that
    ends with it starts far off the teacher (KL 68 for layers [0, 29] against 14-19 for [0, 10], [0, 15]).
    """
    return [i * num_target_layers // num_layers for i in range(num_layers)]


def student_config(target: PretrainedConfig, spec: StudentSpec) -> PretrainedConfig:
    """The student's HF config: the target's, with the spec's shape.

    Per-layer sliding windows: Gemma 3 and Qwen2/3 configs express them; a Llama or Mistral config cannot (one
    window for every layer or none). A Llama-family target with sliding layers therefore gets a Qwen2 student:
    a Llama layer plus q/k/v biases, which start at zero so the copied target layers compute exactly what they
    did, and whose HF implementation honours `layer_types`.
    """
    spec.validate()
    mt = target.model_type
    if mt not in _LLAMA_FAMILY and mt != "gemma3_text":
        raise ValueError(f"cannot distill a draft for model type {mt!r}; supported: {_LLAMA_FAMILY + ('gemma3_text',)}")
    d = {k: v for k, v in target.to_dict().items() if k not in _DROP_KEYS}
    hidden = spec.hidden_size or target.hidden_size
    heads = spec.num_heads or target.num_attention_heads
    target_head_dim = getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads
    d.update(num_hidden_layers=spec.num_layers, hidden_size=hidden, num_attention_heads=heads,
             num_key_value_heads=spec.num_kv_heads or getattr(target, "num_key_value_heads", None) or heads,
             intermediate_size=spec.intermediate_size or target.intermediate_size,
             head_dim=target_head_dim if hidden == target.hidden_size else hidden // heads)
    if hidden != target.hidden_size:
        d["tie_word_embeddings"] = True  # its own embeddings, stored once
    src = source_layers(target.num_hidden_layers, spec.num_layers)
    target_types = list(getattr(target, "layer_types", None) or [])
    types = spec.layer_types or ([target_types[i] for i in src] if target_types else None)
    window = spec.sliding_window or getattr(target, "sliding_window", None)
    if types and "sliding_attention" in types and not window:
        raise ValueError("sliding_attention layers need a sliding window: give sliding_window")
    d.pop("sliding_window", None)  # set below, per family
    if mt == "gemma3_text":
        return Gemma3TextConfig(**d, layer_types=types or ["full_attention"] * spec.num_layers,
                                sliding_window=window or 512)
    if not types or "sliding_attention" not in types:
        if mt == "mistral" and window:
            return type(target)(**d, sliding_window=window)  # Mistral: the one window on every layer, as the target
        cfg = type(target)(**d)
        if mt in _PER_LAYER_TYPES:
            cfg.layer_types = ["full_attention"] * spec.num_layers
        return cfg
    cls = type(target) if mt in _PER_LAYER_TYPES else Qwen2Config
    return cls(**d, use_sliding_window=True, sliding_window=window, max_window_layers=0, layer_types=types)


def build_student(target: PreTrainedModel, spec: StudentSpec, seed: int = 0) -> Student:
    """A student for `target` (an HF model), initialised from it as described at the top of this file."""
    cfg = student_config(target.config, spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    t_sd = target.state_dict()
    same_width = cfg.hidden_size == target.config.hidden_size
    src = source_layers(target.config.num_hidden_layers, spec.num_layers) if same_width else []
    with torch.no_grad():
        for name, p in model.state_dict().items():
            src_name = _source_name(name, src)
            if src_name is not None and src_name in t_sd:
                _copy_overlap(p, t_sd[src_name])
            elif src and name.endswith(".bias"):
                p.zero_()  # a Qwen2 student of a Llama target: q/k/v biases start neutral
        if not same_width:  # own embeddings: the target's projected on their leading principal directions
            emb = target.get_input_embeddings().weight.float()
            _, _, v = torch.pca_lowrank(emb, q=cfg.hidden_size, center=False)
            model.get_input_embeddings().weight.copy_(emb @ v)
    shared: list[str] = []
    if same_width:
        shared.append("model.embed_tokens.weight")
        model.get_input_embeddings().weight.requires_grad_(False)
        if not cfg.tie_word_embeddings:
            shared.append("lm_head.weight")
            model.get_output_embeddings().weight.requires_grad_(False)
    logger.info("student: %d layers from target layers %s, %d trainable parameters, shares %s", spec.num_layers,
                src, sum(p.numel() for p in model.parameters() if p.requires_grad), shared)
    return Student(model.train(), src, shared)


def _source_name(name: str, src: list[int]) -> str | None:
    """The target tensor a student tensor starts from: layer i <- target layer src[i]; the rest by name."""
    if name.startswith("model.layers."):
        if not src:
            return None
        i, rest = name[len("model.layers."):].split(".", 1)
        return f"model.layers.{src[int(i)]}.{rest}"
    return name if src else None


def _copy_overlap(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst`; a smaller `dst` (fewer heads, a narrower MLP) takes the leading slice, a pruned
    start that beats a random one."""
    if dst.dim() != src.dim() or any(a > b for a, b in zip(dst.shape, src.shape)):
        return
    dst.copy_(src[tuple(slice(0, n) for n in dst.shape)])
