"""Resolving a target (and draft) into checked ModelConfigs: shared by the offline LLM and the Ray engine."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from engine.config import (
    SPECULATIVE_METHODS,
    EngineConfig,
    LaunchConfig,
    SpeculativeConfig,
    check_engine_options,
    option_default,
)
from engine.draft_schedule import parse_schedule
from engine.model_config import ModelConfig
from engine.models.source import resolve_model

DEFAULT_MAX_MODEL_LEN = 4096  # unless asked: long contexts cost KV memory nobody asked for


@dataclass
class ModelPair:
    target: ModelConfig  # max_model_len set to the served context
    draft: ModelConfig | None  # None: no speculation
    spec: SpeculativeConfig | None
    max_model_len: int


# SpeculativeConfig's options, by the names the offline LLM and the engine builders take them.
SPEC_OPTIONS = tuple(f.name for f in fields(SpeculativeConfig) if f.name != "draft_model")
# vLLM's offline speculative_config keys -> SpeculativeConfig's names (its own names are taken as well).
VLLM_SPEC_KEYS = {"model": "draft_model", "method": "speculative_method",
                  "num_speculative_tokens": "num_speculative_tokens",
                  "draft_tensor_parallel_size": "draft_tensor_parallel_size",
                  "disable_by_batch_size": "spec_disable_above_batch_size"}


def read_speculative_config(spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """vLLM's `speculative_config` mapping ({"method": "eagle3" | "draft_model", "model": ..., "num_speculative_tokens":
    k, ...}) as (the draft or head, SpeculativeConfig options). Unknown keys are refused, naming them."""
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a mapping, got {type(spec).__name__}")
    known = set(VLLM_SPEC_KEYS) | set(SPEC_OPTIONS) | {"draft_model"}
    unknown = sorted(str(k) for k in spec if k not in known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                         f"{', '.join(sorted(known))}")
    out = {VLLM_SPEC_KEYS.get(k, k): v for k, v in spec.items()}
    method = out.setdefault("speculative_method", "draft_model")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config method {method!r} is not supported; supported: "
                         f"{', '.join(SPECULATIVE_METHODS)}")
    model = out.pop("draft_model", None)
    if not model:
        raise ValueError("speculative_config needs the draft's or head's 'model'")
    return str(model), out


def split_launch(options: dict[str, Any], where: str) -> tuple[LaunchConfig, dict[str, Any]]:
    """`options` checked against the engine options' declaration (TypeError naming unknown ones), as the
    LaunchConfig among them and the rest (SpeculativeConfig's and EngineConfig's fields)."""
    check_engine_options(options, where)
    launch = {f.name for f in fields(LaunchConfig)}
    return (LaunchConfig(**{k: v for k, v in options.items() if k in launch}),
            {k: v for k, v in options.items() if k not in launch})


def speculative_config(draft_model: str | None, options: dict[str, Any]) -> SpeculativeConfig | None:
    """The speculation settings among `options` (taken out of it), for `draft_model`; None without a draft.
    `draft_length_schedule` takes any form engine.draft_schedule.parse_schedule reads."""
    spec_args = {k: options.pop(k) for k in SPEC_OPTIONS if k in options}
    if draft_model is None:
        return None
    if "draft_length_schedule" in spec_args:
        spec_args["draft_length_schedule"] = parse_schedule(spec_args["draft_length_schedule"])
    return SpeculativeConfig(draft_model, **spec_args)


def configure_engine(model: str, draft_model: str | None, *, device: torch.device, dtype: torch.dtype,
                     max_model_len: int | None, seed: int | None = None, tensor_parallel_size: int | None = None,
                     options: dict[str, Any]) -> tuple[ModelPair, EngineConfig]:
    """The models resolved and checked together, and the EngineConfig to run them with: what the offline LLM and
    the Ray engine builder share. `options`: SpeculativeConfig's fields (SPEC_OPTIONS) and EngineConfig's; seed and
    tensor_parallel_size, given here, win over theirs."""
    options = dict(options)
    if seed is not None:
        options["seed"] = seed
    if tensor_parallel_size is not None:
        options["tensor_parallel_size"] = tensor_parallel_size
    spec = speculative_config(draft_model, options)
    if spec is not None and spec.speculative_method == "eagle3":
        _check_eagle3_options(spec, options, int(options.get("tensor_parallel_size",
                                                             option_default("tensor_parallel_size"))))
    pair = resolve_model_pair(model, spec, max_model_len,
                              load_format=str(options.get("load_format", option_default("load_format"))))
    config = EngineConfig(device=device, dtype=dtype, max_model_len=pair.max_model_len,
                          num_speculative_tokens=spec.num_speculative_tokens if spec else 0, **options)
    return pair, config


def resolve_model_pair(model: str, spec: SpeculativeConfig | None, max_model_len: int | None,
                       load_format: str = option_default("load_format")) -> ModelPair:
    """Resolve both models (converting GGUF into the cache once) and check that they can work together:
    a context the target supports, valid speculation settings, a draft with the target's vocabulary and
    at least its context. `spec` names the draft; None: the target alone."""
    # Random weights (load_format "dummy") need only each model's config.json.
    need_weights = load_format != "dummy"
    target = ModelConfig.from_path(resolve_model(model, require_weights=need_weights).path)
    limit = target.max_position_embeddings
    if max_model_len is None:
        max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of {limit} tokens")
    target.max_model_len = max_model_len
    if spec is None:
        return ModelPair(target, None, None, max_model_len)
    spec.validate()
    if spec.speculative_method == "eagle3":
        return ModelPair(target, _eagle3_head(target, spec, need_weights), spec, max_model_len)
    draft = ModelConfig.from_path(resolve_model(spec.draft_model, require_weights=need_weights).path)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocabulary ({draft.vocab_size} tokens) differs from the target's "
                         f"({target.vocab_size}); a draft must share the target's tokenizer")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"the draft's context ({draft.max_position_embeddings} tokens) is shorter than "
                         f"max_model_len={max_model_len}; lower max_model_len or use another draft")
    draft.max_model_len = max_model_len
    return ModelPair(target, draft, spec, max_model_len)


def _check_eagle3_options(spec: SpeculativeConfig, options: dict[str, Any], tensor_parallel_size: int) -> None:
    """Settings an EAGLE-3 head cannot honour, refused by name."""
    if options.get("speculation_ahead"):
        raise ValueError("speculation_ahead cannot be used with an EAGLE-3 head (method 'eagle3'): the head drafts "
                         "from the verify's hidden states, which do not exist before the verify has run")
    if options.get("draft_token_map") is not None:
        raise ValueError("draft_token_map restricts a draft model's LM head; an EAGLE-3 head has its own draft "
                         "vocabulary (d2t)")
    if spec.draft_tensor_parallel_size not in (1, tensor_parallel_size):
        raise ValueError(f"an EAGLE-3 head runs in the target's processes, split as the target is: "
                         f"draft_tensor_parallel_size must be tensor_parallel_size ({tensor_parallel_size}) or "
                         f"left at 1, got {spec.draft_tensor_parallel_size}")
    spec.draft_tensor_parallel_size = tensor_parallel_size


# Targets whose decoder keeps the auxiliary states a head reads (engine/models/decoder.py). Not Gemma 3: its
# embeddings are scaled inside the model, and no public head says how a head shares them.
EAGLE3_TARGET_FAMILIES = ("llama", "gpt_oss", "qwen3_moe")


def _eagle3_head(target: ModelConfig, spec: SpeculativeConfig, need_weights: bool) -> ModelConfig:
    from engine.models.eagle3_config import Eagle3ModelConfig

    if target.family not in EAGLE3_TARGET_FAMILIES:
        raise ValueError(f"EAGLE-3 heads are supported for targets of the families {EAGLE3_TARGET_FAMILIES} "
                         f"(Llama, Qwen3, GPT-OSS, Qwen3-MoE), not {target.architecture}")
    path = resolve_model(spec.draft_model, require_weights=need_weights).path
    return Eagle3ModelConfig.from_head(path, target)
