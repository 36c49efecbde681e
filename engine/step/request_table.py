"""What a model's side (the in-process executor, or each worker rank of either model) knows of its requests
between steps, so that a plan may leave a decode's input to the side that ran the step before.

Asynchronous scheduling sends step n+1's plan before step n's tokens reach the scheduler. For a request whose
step n samples, the scheduler cannot write step n+1's input (the tokens step n accepts, their positions, the
output count that seeds a seeded request's generators): only the sides that ran step n know them. Every side
therefore keeps, per request, the tokens it has seen and how far each model's KV reaches, and applies each step's
result exactly as the scheduler's commit does. An entry with `token_ids=None` is resolved from here; an entry
with explicit tokens (a prefill chunk, a resumed request, any request under synchronous scheduling) is
authoritative and reseeds the state. Target and draft workers keep the same table: the target's ranks record
their own results, the draft's ranks receive the target's result right after the verify (`record` again).

Every side also keeps what plans send only once or in parts (engine/step/plan_deltas.py): a request's sampling
settings and its whole block tables, which it puts back into each entry it resolves.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

from engine.sample import grammar_matchers
from engine.step.plan import PlannedRequest, SamplingSettings, StepPlan, StepResult
from engine.step.plan_deltas import fill_settings, splice_tables

# A token sampled by a step still on the device (engine/decode_pipeline.py queues the next step before it reads
# the tokens back): recorded in its place, and filled in when the tokens arrive. Never a real token id.
PENDING_TOKEN = -1


@dataclass
class TrackedRequest:
    """One request as a side knows it: tokens from position `base` on (older ones are never fed again)."""

    base: int
    token_ids: list[int]  # tokens at positions [base, base + len)
    num_computed: int  # positions with target KV
    num_draft_computed: int  # positions with draft KV
    num_output_tokens: int
    # What plans send once or as tails (engine/step/plan_deltas.py); None until an entry sent them whole.
    sampling: SamplingSettings | None = None
    block_tables: list[list[int]] | None = None  # [num_target_groups][num_blocks]
    draft_block_tables: list[list[int]] | None = None  # [num_draft_groups][num_blocks]

    @property
    def num_tokens(self) -> int:
        return self.base + len(self.token_ids)

    def tokens_from(self, pos: int) -> list[int]:
        if pos < self.base:
            raise RuntimeError(f"tokens from position {pos} were dropped (this side keeps them from {self.base})")
        return self.token_ids[pos - self.base:]

    def splice(self, pos: int, tokens: list[int]) -> None:
        """Known tokens from `pos` on are `tokens` (a chunk the scheduler sent): keep what precedes them."""
        if self.base <= pos <= self.num_tokens:
            self.token_ids = self.token_ids[:pos - self.base] + list(tokens)
        else:
            self.base, self.token_ids = pos, list(tokens)


class RequestTable:
    """Per-request state of one side. `resolve` fills a plan's open entries, `record` applies a step's result."""

    def __init__(self) -> None:
        self.requests: dict[str, TrackedRequest] = {}
        # Plans resolved but whose results have not been recorded yet, oldest first (a draft worker records a
        # step when the target's result arrives, after it proposed). Bounded: a side whose results never come
        # back to it (a draft worker under synchronous scheduling, whose entries are all explicit) keeps only the
        # last few, and an asynchronous engine has at most two steps in flight.
        self._unrecorded: deque[StepPlan] = deque(maxlen=16)

    def __len__(self) -> int:
        return len(self.requests)

    def resolve(self, plan: StepPlan) -> StepPlan:
        """The plan with every entry explicit. Drops the requests the plan says ended; reseeds the state of
        explicit entries; raises RuntimeError for an open entry of a request this side does not know."""
        for rid in plan.finished_ids:
            self.requests.pop(rid, None)
        grammar_matchers.forget(plan.finished_ids)  # this side's structured-output matchers of ended requests
        entries = [self._resolve_one(p) for p in plan.requests]
        resolved = dataclasses.replace(plan, requests=entries)
        self._unrecorded.append(resolved)
        return resolved

    def _resolve_one(self, p: PlannedRequest) -> PlannedRequest:
        t = self.requests.get(p.request_id)
        if p.token_ids is not None:
            if t is None:
                t = self.requests[p.request_id] = TrackedRequest(p.start_pos, [], p.start_pos, p.draft_start_pos,
                                                                 p.num_output_tokens)
            if p.draft_runs and p.draft_start_pos < p.start_pos:
                # The draft lags (it sat out steps without speculation): its catch-up reaches further back.
                t.splice(p.draft_start_pos, p.draft_token_ids)
            else:
                t.splice(p.start_pos, p.token_ids)
            t.num_computed, t.num_draft_computed = p.start_pos, p.draft_start_pos
            t.num_output_tokens = p.num_output_tokens
            return self._fill_unsent(p, t)
        if t is None:
            raise RuntimeError(f"the plan leaves request {p.request_id}'s input to this side, which does not know it")
        # The resolved entry: _fill_unsent's copy where it made one, else a copy of its own (the plan's entry stays
        # as sent; the fields read from p below are the same in both). Copied without __init__'s checks, which
        # dataclasses.replace would run: under asynchronous scheduling every decode entry is open, and that was the
        # host's largest cost a request a step.
        filled = self._fill_unsent(p, t)
        entry = filled if filled is not p else _copy_entry(p)
        frontier = t.num_tokens
        entry.token_ids, entry.start_pos = t.tokens_from(t.num_computed), t.num_computed
        entry.num_output_tokens = t.num_output_tokens
        if p.token_limit:
            entry.num_draft_tokens = max(0, min(p.num_draft_tokens, p.token_limit - frontier - 1))
        if p.output_token_ids is not None:
            # The history a logits processor reads (penalties): the scheduler's, which lacks what the step in
            # flight produced; those are this side's newest tokens.
            missing = t.num_output_tokens - len(p.output_token_ids)
            if missing > 0:
                entry.output_token_ids = p.output_token_ids + t.token_ids[len(t.token_ids) - missing:]
        if p.draft_runs:
            if t.num_draft_computed < t.base:
                raise RuntimeError(f"the plan leaves request {p.request_id}'s draft input to this side, which does "
                                   f"not know its tokens from position {t.num_draft_computed} (only from {t.base})")
            entry.draft_token_ids = t.token_ids[t.num_draft_computed - t.base:frontier - t.base]
            entry.draft_start_pos = t.num_draft_computed
        return entry

    def _fill_unsent(self, p: PlannedRequest, t: TrackedRequest) -> PlannedRequest:
        """The entry with the settings and whole block tables that plans send once or as tails, kept in `t`."""
        rid = p.request_id
        t.sampling = fill_settings(rid, t.sampling, p.sampling)
        t.block_tables = splice_tables(rid, "target", t.block_tables, p.block_table_starts, p.block_tables)
        if p.draft_runs:  # else the draft sits this step out: it was sent no tables
            t.draft_block_tables = splice_tables(rid, "draft", t.draft_block_tables, p.draft_block_table_starts,
                                                 p.draft_block_tables)
        if p.sampling is not None and p.block_table_starts is None and p.draft_block_table_starts is None:
            return p
        entry = _copy_entry(p)  # the plan's entry stays as sent
        entry.sampling, entry.block_tables, entry.block_table_starts = t.sampling, t.block_tables, None
        if p.draft_runs:
            entry.draft_block_tables, entry.draft_block_table_starts = t.draft_block_tables, None
        return entry

    def record(self, result: StepResult) -> None:
        """Apply a step's result (matched by step id), as EngineCore.commit (engine/step/commit.py) does on the
        scheduler's side. Older unrecorded steps are dropped: their results never came (a failed step), and the
        scheduler, which did not commit them either, plans the requests they held with explicit entries next."""
        while self._unrecorded and self._unrecorded[0].step_id != result.step_id:
            self._unrecorded.popleft()
        if not self._unrecorded:
            raise RuntimeError(f"a result for step {result.step_id}, which this side did not run")
        plan = self._unrecorded.popleft()
        for p, tokens, accepted in zip(plan.requests, result.sampled, result.num_accepted):
            t = self.requests.get(p.request_id)
            if t is None:  # ended (finished_ids of a later plan came first: never, but harmless)
                continue
            assert p.token_ids is not None
            frontier = p.start_pos + len(p.token_ids)
            if tokens is None:  # a prefill chunk short of the end of the prompt
                t.num_computed = frontier
                if p.draft_runs:
                    t.num_draft_computed = frontier
                continue
            t.token_ids.extend(tokens)
            t.num_output_tokens += len(tokens)
            t.num_computed = frontier + accepted
            if p.draft_runs:
                t.num_draft_computed = frontier + min(accepted, max(p.num_draft_tokens - 1, 0))
            # Positions before both models' KV frontiers are never fed again: keep the table small.
            keep_from = min(t.num_computed, t.num_draft_computed)
            if keep_from - t.base > 256:
                del t.token_ids[:keep_from - t.base]
                t.base = keep_from

    def fill_pending(self, request_id: str, position: int, token: int) -> None:
        """The token at `position`, recorded as PENDING_TOKEN while its step was on the device, is `token`."""
        t = self.requests.get(request_id)
        if t is None or not t.base <= position < t.num_tokens:
            return  # ended meanwhile, or that far back is dropped: nothing reads it again
        if t.token_ids[position - t.base] == PENDING_TOKEN:
            t.token_ids[position - t.base] = token


def _copy_entry(p: PlannedRequest) -> PlannedRequest:
    """A shallow copy of a plan entry without __init__'s checks (the entry passed them when it was made)."""
    entry = object.__new__(PlannedRequest)
    entry.__dict__.update(p.__dict__)
    return entry
