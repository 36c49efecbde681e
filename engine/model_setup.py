"""Resolving a target (and draft) into checked ModelConfigs: shared by the offline LLM and the Ray engine."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig, SpeculativeConfig
from engine.draft_schedule import parse_schedule
from engine.models.source import resolve_model

DEFAULT_MAX_MODEL_LEN = 4096  # unless asked: long contexts cost KV memory nobody asked for


@dataclass
class ModelPair:
    target: ModelConfig  # max_model_len set to the served context
    draft: ModelConfig | None  # None: no speculation
    spec: SpeculativeConfig | None
    max_model_len: int


def resolve_model_pair(model: str, draft_model: str | None, max_model_len: int | None,
                       num_speculative_tokens: int = 4, rejection_sampling: str = "probabilistic",
                       synthetic_acceptance_rate: float | None = None,
                       draft_tensor_parallel_size: int = 1, draft_length_schedule: object = None,
                       spec_disable_above_batch_size: int | None = None, load_format: str = "auto") -> ModelPair:
    """Resolve both models (converting GGUF into the cache once) and check that they can work together:
    a context the target supports, valid speculation settings, a draft with the target's vocabulary and
    at least its context. `draft_length_schedule` takes any form engine.draft_schedule.parse_schedule reads."""
    # Random weights (load_format "dummy") need only each model's config.json.
    need_weights = load_format != "dummy"
    target = ModelConfig.from_path(resolve_model(model, require_weights=need_weights).path)
    limit = target.max_position_embeddings
    if max_model_len is None:
        max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of {limit} tokens")
    target.max_model_len = max_model_len
    if draft_model is None:
        return ModelPair(target, None, None, max_model_len)
    spec = SpeculativeConfig(draft_model, num_speculative_tokens, rejection_sampling, synthetic_acceptance_rate,
                             draft_tensor_parallel_size, parse_schedule(draft_length_schedule),  # type: ignore[arg-type]
                             spec_disable_above_batch_size)
    spec.validate()
    draft = ModelConfig.from_path(resolve_model(draft_model, require_weights=need_weights).path)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocabulary ({draft.vocab_size} tokens) differs from the target's "
                         f"({target.vocab_size}); a draft must share the target's tokenizer")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"the draft's context ({draft.max_position_embeddings} tokens) is shorter than "
                         f"max_model_len={max_model_len}; lower max_model_len or use another draft")
    draft.max_model_len = max_model_len
    return ModelPair(target, draft, spec, max_model_len)
