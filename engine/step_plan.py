"""The plan of one engine step: what the router (scheduler side) sends to the model workers.

Small and picklable: token deltas, positions, block ids per KV-cache group and sampling settings; no
tensors. The same plan drives the in-process executor and the Ray workers, so both run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sample.logits_params import LogitsParams


@dataclass
class PlannedRequest:
    request_id: str
    # Target: committed tokens to feed from start_pos on (a prefill chunk, or the last token); the step's
    # draft tokens are appended to them on the worker.
    token_ids: list[int]
    start_pos: int
    num_draft_tokens: int  # k this step (0: no speculation for this request)
    sample: bool  # the chunk reaches the end of the sequence, so a token is sampled
    block_tables: list[list[int]]  # [num_target_groups][num_blocks]
    # Draft: tokens it has not seen yet, from draft_start_pos on, and its own block tables.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_start_pos: int = 0
    draft_block_tables: list[list[int]] = field(default_factory=list)  # [num_draft_groups][num_blocks]
    # Sampling: settings, and the output position that seeds a seeded request's generators.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    num_output_tokens: int = 0
    # Logprobs: None (the default) computes none; k >= 0 returns each emitted token's logprob and the k most likely.
    logprobs: int | None = None
    # Logits processing (penalties, logit_bias, masks, min_p): only for requests that use it; None costs nothing.
    logits_params: LogitsParams | None = None
    # The request's output so far, only where logits_params needs the history (penalties, multi-token bad words).
    output_token_ids: list[int] | None = None


@dataclass
class StepPlan:
    step_id: int
    requests: list[PlannedRequest]
    rejection_sampling: str | None = None  # None: no speculation this engine
    synthetic_acceptance_rate: float | None = None

    @property
    def max_draft_tokens(self) -> int:
        return max((r.num_draft_tokens for r in self.requests), default=0)


@dataclass
class StepResult:
    """Per planned request (same order): tokens to append and how many drafts were accepted."""

    sampled: list[list[int] | None]  # None where the request did not sample (mid-prefill)
    num_accepted: list[int]
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # Per planned request, one (logprob, [(token id, logprob), ...]) per sampled token, where the request asked for
    # logprobs (engine.sample.logprobs); None when no request of the step did.
    logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None] | None = None
