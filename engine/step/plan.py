"""The plan of one engine step: what the router (scheduler side) sends to the model workers.

Small and picklable: token deltas, positions, block ids per KV-cache group and sampling settings; no
tensors. The same plan drives the in-process executor and the Ray workers, so both run the same code.

A plan carries only what the sides do not know yet (engine/step/plan_deltas.py): a request's sampling settings go with
its first entry only (`sampling=None`: "as before"), and its block tables as the tail from where they differ from
the ones sent before (`block_table_starts`). Every side keeps what it was sent in its request table, which turns
each entry back into a whole one before anything runs it.

With asynchronous scheduling the scheduler sends step n+1's plan before step n's tokens reach it, so a decoding
request's entry may leave its input to the side that runs it: `token_ids=None` means "the tokens you accepted last step,
from where your KV ends" (engine/step/request_table.py resolves such entries from the state every side keeps).
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field
from typing import Any

from engine.sample.logits_params import LogitsParams


@dataclass(frozen=True)
class SamplingSettings:
    """A request's sampling settings: fixed for its life, so the sides are sent them once and keep them."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # Logprobs: None (the default) computes none; k >= 0 returns each emitted token's logprob and the k most likely.
    logprobs: int | None = None
    # Prompt logprobs: None computes none; k >= 0 the logprob, rank and k most likely tokens of each prompt token.
    prompt_logprobs: int | None = None
    # Logits processing (penalties, logit_bias, masks, min_p): only for requests that use it; None costs nothing.
    logits_params: LogitsParams | None = None


GREEDY = SamplingSettings()
SETTING_NAMES = tuple(f.name for f in dataclasses.fields(SamplingSettings))
_KEEP: Any = object()  # a setting not overridden at construction
_ALL_KEPT = (_KEEP,) * len(SETTING_NAMES)


@dataclass
class PlannedRequest:
    request_id: str
    # Target: committed tokens to feed from start_pos on (a prefill chunk, or the last token); the step's
    # draft tokens are appended to them on the worker. None: a decode whose input only the sides know yet (the
    # tokens of a step still in flight); they fill token_ids, start_pos, num_output_tokens and the draft's
    # token_ids/start_pos in from their request table before running it.
    token_ids: list[int] | None
    start_pos: int
    num_draft_tokens: int  # k this step (0: no speculation for this request)
    sample: bool  # the chunk reaches the end of the sequence, so a token is sampled
    block_tables: list[list[int]]  # [num_target_groups][num_blocks]: whole, or tails (block_table_starts)
    # Draft: tokens it has not seen yet, from draft_start_pos on, and its own block tables.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_start_pos: int = 0
    draft_block_tables: list[list[int]] = field(default_factory=list)  # [num_draft_groups][num_blocks] (as above)
    draft_runs: bool = False  # the draft processes this request this step (catch-up, prefill, proposals)
    # An open entry's k is the step's; the sides shrink it, from their exact counts, so that the step ends before
    # this many tokens (the prompt plus max_tokens, or max_model_len), as the scheduler shrinks it for explicit
    # entries: both schedules then draft the same k at every position. 0: no limit.
    token_limit: int = 0
    # The output position that seeds a seeded request's generators.
    num_output_tokens: int = 0
    # The request's output so far, only where logits_params needs the history (penalties, multi-token bad words).
    output_token_ids: list[int] | None = None
    # The sampling settings; None: "as sent before" (the sides fill them in). The entry reads them as attributes
    # (entry.temperature, entry.logprobs, ...), which raise on an entry not resolved yet.
    sampling: SamplingSettings | None = GREEDY
    # None: block_tables (draft_block_tables) are whole. Else per group the index from which the list in
    # block_tables is the table's tail: the sides keep the blocks before it from the tables sent before.
    block_table_starts: list[int] | None = None  # [num_target_groups]
    draft_block_table_starts: list[int] | None = None  # [num_draft_groups]
    # With prompt_logprobs, while the chunk covers prompt tokens: the prompt tokens its positions predict, from
    # start_pos + 1 on (one per chunk token, one fewer where the chunk ends the prompt: its last position predicts
    # the first output token). The target computes the logits of every such position. None: none wanted.
    prompt_targets: list[int] | None = None
    # Single settings given at construction (PlannedRequest(..., temperature=0.7), dataclasses.replace(entry,
    # logprobs=None)) replace those of `sampling`; they are not stored on their own.
    temperature: InitVar[float] = _KEEP
    top_p: InitVar[float] = _KEEP
    top_k: InitVar[int] = _KEEP
    seed: InitVar[int | None] = _KEEP
    logprobs: InitVar[int | None] = _KEEP
    prompt_logprobs: InitVar[int | None] = _KEEP
    logits_params: InitVar[LogitsParams | None] = _KEEP

    def __post_init__(self, *settings: Any) -> None:
        if settings == _ALL_KEPT:  # the usual case, compared by identity first
            return
        given = {name: v for name, v in zip(SETTING_NAMES, settings) if v is not _KEEP}
        if self.sampling is None:
            raise ValueError(f"request {self.request_id}: single sampling settings on an entry without settings")
        changed = {n: v for n, v in given.items() if v is not getattr(self.sampling, n)
                   and v != getattr(self.sampling, n)}
        if changed:
            self.sampling = dataclasses.replace(self.sampling, **changed)


def _setting(name: str) -> property:
    def get(self: PlannedRequest) -> Any:
        if self.sampling is None:
            raise RuntimeError(f"request {self.request_id}'s entry carries no sampling settings ({name}): it was "
                               "read before a request table resolved it")
        return getattr(self.sampling, name)

    return property(get, doc=f"The request's {name} (SamplingSettings.{name}).")


for _name in SETTING_NAMES:
    setattr(PlannedRequest, _name, _setting(_name))


@dataclass
class StepPlan:
    step_id: int
    requests: list[PlannedRequest]
    rejection_sampling: str | None = None  # None: no speculation this engine
    synthetic_acceptance_rate: float | None = None
    # Requests that ended since the last plan: the sides drop their state before running this one.
    finished_ids: list[str] = field(default_factory=list)
    # When and where an executor on other processes sent it (perf_counter, the host's monotonic clock): a worker on
    # the same host times the plan's trip (engine/step/phases.py, `between`). 0.0 / "": not sent across processes.
    sent_at: float = 0.0
    sent_host: str = ""
    # Speculation ahead: windows to draft per request after this step's proposal (engine/speculation/ahead/budget.py);
    # 0: the draft side's configured count (EngineConfig.speculation_ahead_branches).
    ahead_branches: int = 0
    # Speculation ahead's tree mode: the most tree nodes (rows fed by all of the step's tree forwards) to draft after
    # this step's proposal (engine/speculation/ahead/budget.py); None: the draft side's own cap (its configured
    # fan-out within max_num_batched_tokens branches), 0: no tree this step.
    ahead_tree_nodes: int | None = None
    # Speculation ahead off for this step: the gate measured drafting ahead slower at this load
    # (engine/speculation/ahead/gate.py); the next proposal is drafted just in time.
    ahead_off: bool = False

    @property
    def max_draft_tokens(self) -> int:
        return max((r.num_draft_tokens for r in self.requests), default=0)


@dataclass
class StepResult:
    """Per planned request (same order): tokens to append and how many drafts were accepted."""

    sampled: list[list[int] | None]  # None where the request did not sample (mid-prefill)
    num_accepted: list[int]
    step_id: int = -1  # the plan's: a side that records results matches them to the plans it ran
    num_draft_tokens: list[int] | None = None  # per planned request, the k it verified (an open entry's is shrunk)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # The draft's speculation-ahead counters, running totals (AheadStats.as_tuple: lookups, hits, tokens drafted
    # ahead, of those unused, branches skipped); None where the draft does not draft ahead.
    speculation_ahead_totals: tuple[int, ...] | None = None
    # The draft's last run ahead (rows, seconds), for the engine's fan-out budget (engine/speculation/ahead/budget.py;
    # in tree mode the rows are the tree nodes fed);
    # None where it drafted none since the result before.
    speculation_ahead_window: tuple[int, float] | None = None
    # Per planned request, one (logprob, [(token id, logprob), ...]) per sampled token, where the request asked for
    # logprobs (engine.sample.logprobs); None when no request of the step did.
    logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None] | None = None
    # Per planned request, the logprobs of its entry's prompt_targets, (logprob, rank, top tokens) each
    # (engine.sample.logprobs.PromptTokenLogprobs); None when no entry of the step had prompt_targets.
    prompt_logprobs: list[list[tuple[float, int, list[tuple[int, float]]]] | None] | None = None
    # [the forward's tokens, len(aux) * target_hidden] on the host: the target's auxiliary states of every token of
    # the step's forward (each request's input and its drafts, in plan order), for an EAGLE-3 head on workers of its
    # own (engine/speculation/eagle3_proposer.py); None elsewhere.
    target_states: Any = None
