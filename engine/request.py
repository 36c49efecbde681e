"""User-facing request types: SamplingParams, the engine's per-request state, and outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.sample.logits_params import LogitsParams
from engine.sample.structured_output import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops (OpenAI/vLLM semantics).

    temperature 0 means greedy; top_p 1.0 and top_k 0 mean "off". A seed makes the request's
    samples reproducible and independent of what else runs in the batch.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # None: no logprobs. k >= 0: each output token's logprob and the k most likely tokens at its position, from the
    # target's raw logits (before temperature, top-k, top-p: vLLM's default "raw_logprobs"), with or without a draft.
    logprobs: int | None = None
    # None: none. k >= 0: each prompt token's logprob given the tokens before it (the first has none), its rank in
    # the vocabulary and the k most likely tokens there, from the target's raw logits (vLLM's prompt_logprobs). Such
    # a request computes its whole prompt: it takes nothing from the prefix cache, whose blocks carry no logits.
    prompt_logprobs: int | None = None
    # Logits processing (vLLM's semantics; applied to the target's logits at every position, with the drafts before
    # the position in the history, so speculation stays lossless): see engine/sample/logits_params.py.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    min_tokens: int = 0
    min_p: float = 0.0
    include_stop_str_in_output: bool = False
    # False: the output carries token ids only (vLLM's `detokenize`). Incremental decoding costs two tokenizer
    # calls per token per request, which is most of a step's host time when thousands of requests generate
    # data nobody reads as text (distillation); stop strings need the text, so they need it on.
    detokenize: bool = True
    # Mixed into the prefix cache's block hashes (engine/kv_cache/block_hash.py): only requests with the same salt
    # share cached KV, so a tenant's prompts cannot be probed by another's time to first token (vLLM's cache_salt).
    cache_salt: str | None = None
    # Structured outputs (a JSON schema, JSON object, regex, choice or grammar): the output is sampled from the
    # target's distribution restricted to what the grammar allows, at every position, with or without a draft.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):  # as a front end sends it (its fields as a dict)
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a message a user can act on."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature is None or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if self.top_p is None or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be None or an integer >= 0 (the most likely tokens to list), got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2 (0 = off), got {v!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or isinstance(rp, bool) or not 0.0 < rp <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100] (1 = off), got {rp!r}")
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer between 0 and max_tokens, got {self.min_tokens!r}")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be between -100 and 100, got {bias!r}")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        if any(not w or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in w)
               for w in self.bad_words_token_ids or []):
            raise ValueError("bad_words_token_ids must be non-empty lists of token ids")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are matched against the output text: they need detokenize=True")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def token_ids_used(self) -> dict[str, list[int]]:
        """The token ids each logits processing field names (to check against the vocabulary)."""
        return {"logit_bias": list(self.logit_bias or {}), "allowed_token_ids": list(self.allowed_token_ids or []),
                "bad_words_token_ids": [t for w in self.bad_words_token_ids or [] for t in w]}

    @property
    def processes_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids
                    or self.min_tokens or self.min_p)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class SpecStats:
    """Speculation statistics of one request (or summed over many).

    acceptance rate = accepted / drafted tokens; acceptance length = 1 + accepted per verify step
    (the bonus or recovered token counts), as vLLM reports them.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        self.accepted_per_position += [0] * (n - len(self.accepted_per_position))
        for i, c in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += c

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class Request:
    """Engine-side state of one request. Both models' progress is tracked here.

    Invariant while decoding: the target has KV for every token except the last one
    (`num_computed_tokens == num_tokens - 1`); the last token is the next step's input.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_index: int = 0) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # With params.logprobs: per output token, (logprob, [(token id, logprob), ...] of the most likely tokens).
        self.output_logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        # With params.prompt_logprobs: per prompt token from the second on, (logprob, rank, most likely tokens),
        # filled as the prefill chunks run (engine.sample.logprobs.PromptTokenLogprobs).
        self.prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] = []
        self.params = params
        self.status = RequestStatus.WAITING
        self.arrival_index = arrival_index
        # KV progress of the target and of the draft (positions whose KV is in the cache).
        self.num_computed_tokens = 0
        self.num_draft_computed_tokens = 0
        # The draft starts behind the target's prefix hit and no step has run it for this request yet: the model
        # sides, which know a request's tokens from its first entry's start on, lack those it must catch up on,
        # so the next step that runs the draft sends them (an explicit entry, never an open one).
        self.draft_gap_unsent = False
        self.num_preemptions = 0
        # The ScheduledRequest of this request's step in flight (asynchronous scheduling), until it is committed.
        self.inflight: Any = None
        # Prompt tokens the first admission took from the prefix cache instead of computing; None until admitted.
        self.num_cached_tokens: int | None = None
        # Content addresses of the full blocks of all_token_ids (engine/kv_cache/block_hash.py), filled lazily.
        self.block_hashes: list[bytes] = []
        self.spec = SpecStats()
        self.output_text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logits_params: LogitsParams | None = None  # set by the engine for requests that process logits

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """True until the target has seen every token but the last (which is the next input)."""
        return self.num_computed_tokens < self.num_tokens - 1

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt (a public contract: docs/ARCHITECTURE.md)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | None while running
    spec: SpecStats
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
    # With SamplingParams.logprobs (vLLM's shape): per output token, {token id: logprob} of the token itself, then
    # the most likely tokens at its position.
    logprobs: list[dict[int, float]] | None = None
    # With SamplingParams.prompt_logprobs (vLLM's shape): None for the first prompt token, then per prompt token
    # {token id: logprob} of the token itself, then the most likely tokens at its position.
    prompt_logprobs: list[dict[int, float] | None] | None = None
