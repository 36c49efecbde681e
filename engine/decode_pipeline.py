"""A target without a draft, its steps queued one ahead: step n+1 is on the GPU before step n's tokens reach the host.

A plain decode step is forward -> sample -> the sampled ids to the host. Run one at a time, the GPU idles from
the moment those ids land until the next forward is queued: the host reads them, records them, builds the next
step's input (and, served, hands them to the router and reads the next plan from its channel). With asynchronous
scheduling the next plan is already there before step n ends, and for a plain decode nothing in it needs step
n's tokens on the host: each request's next input is its one sampled token, whose position is known. So
`DecodePipeline.step(plan n+1)`:

1. resolves plan n+1 against the side's request table, in which step n's tokens stand as PENDING_TOKEN;
2. builds its input with those placeholders and queues its forward and sampling, the placeholders overwritten on
   the device from step n's sampled ids (DeviceTokens), so nothing waits for step n;
3. only then waits for step n's ids (copied to pinned memory right after its sampling, so the wait ends when step
   n ends, not behind step n+1), fills them into the table and returns step n's result.

The GPU always has the next step queued; the host's work and the trips to the router overlap it. Outputs are
unchanged: the same forwards see the same tokens, sample with the same settings and (for a seeded request) the
same generators, in the same order on the same stream.

A step stays queued only if nothing of it needs its own tokens on the host before the next step runs: no logprobs
or prompt logprobs (computed from logits that the next step's graph replay overwrites), no logits processing
(penalties, grammars, masks read the host-side history), no drafts. Such a step runs to the end at once, after
step n's tokens are in. The in-process executor and each target worker rank of a draft-less engine use this class
alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.host_copy import to_device
from engine.runner.step_input import DeviceTokens
from engine.speculation.verifier import Verifier
from engine.step.phases import GpuMarks, queued_forward_phases
from engine.step.plan import StepPlan, StepResult
from engine.step.plan_sampling import TARGET_STREAM, sampling_metadata
from engine.step.request_table import PENDING_TOKEN, RequestTable


@dataclass
class QueuedStep:
    """A step on its way: either queued on the device (`result` None) or already run to the end."""

    plan: StepPlan  # resolved: every entry explicit (PENDING_TOKEN where the step before had not ended)
    rows: list[int]  # [num_sampled] plan index of each sampled row, in the sampler's row order
    sampled: torch.Tensor | None  # [num_sampled] int64 on the device; None when nothing samples
    host: torch.Tensor | None  # [num_sampled] int64 (pinned on CUDA): where the ids are copied to
    copied: torch.cuda.Event | None  # recorded after that copy; None off CUDA (the copy was synchronous)
    # forward start, forward end, sampling end on CUDA: the step's GPU time, read when it has ended
    marks: GpuMarks | None
    prepare_seconds: float  # host time to build and queue the step
    result: StepResult | None = None  # a step run to the end at once (logprobs, logits processing)

    @property
    def row_of(self) -> dict[str, int]:
        """Request id -> its row in `sampled`."""
        return {self.plan.requests[i].request_id: n for n, i in enumerate(self.rows)}


class DecodePipeline:
    """One side's queue of draft-less steps, one ahead. `step(plan)` queues `plan` and returns the result of the
    step queued before it (None for the first); `step(None)` only returns that result."""

    def __init__(self, verifier: Verifier, table: RequestTable) -> None:
        self.verifier = verifier
        self.table = table
        self.pending: QueuedStep | None = None
        self.num_queued_ahead = 0  # steps queued on the device before the step before them was read back
        self.num_overlapped = 0  # ... of which the step before was still running on the GPU once they were queued

    def step(self, plan: StepPlan | None) -> StepResult | None:
        prev, self.pending = self.pending, None
        try:
            if plan is None:
                return self._finish(prev) if prev is not None else None
            resolved = self.table.resolve(plan)
            if any(r.num_draft_tokens for r in resolved.requests):
                raise ValueError("a draft-less step was planned with drafts")
            done = None
            stays = _stays_queued(resolved)
            if prev is not None and not (stays and prev.result is None):
                done = self._finish(prev)
                self._fill(resolved, prev, done)
                prev = None
            if stays:
                self.pending = self._queue(resolved, prev)
                if prev is not None:
                    self.num_queued_ahead += 1
                    # No sync: whether the GPU still had the step before to run, i.e. never idled in between.
                    self.num_overlapped += prev.copied is not None and not prev.copied.query()
            else:
                result = self.verifier.verify(resolved, None)
                self.table.record(result)
                self.pending = QueuedStep(resolved, [], None, None, None, None, 0.0, result)
            if prev is not None:
                done = self._finish(prev)
            return done
        except BaseException:
            # The steps are lost (the engine forgets every step in flight and plans explicit input next); a step
            # still on the device finishes on its own and nothing reads it.
            self.pending = None
            raise

    @torch.inference_mode()
    def _queue(self, plan: StepPlan, prev: QueuedStep | None) -> QueuedStep:
        """Build, queue and sample `plan` without waiting for anything; prev: the queued step whose sampled ids
        stand as PENDING_TOKEN in `plan`'s input."""
        t0 = time.perf_counter()
        verifier = self.verifier
        dev = verifier.runner.device
        device_tokens = None
        flat, src = _pending_slots(plan, prev)
        if flat:
            assert prev is not None and prev.sampled is not None
            device_tokens = DeviceTokens(to_device(flat, torch.int64, dev),
                                         prev.sampled.index_select(0, to_device(src, torch.int64, dev)))
        inp = verifier.prepare(plan, with_drafts=False)
        logits, marks = verifier._forward(inp.forward, device_tokens)  # [num sampled rows, V]
        reqs = plan.requests
        rows = [i for i, r in enumerate(reqs) if r.sample]
        sampled = host = copied = None
        timing = None  # the step's marks, where they reach the sampling's end
        if rows:
            md = sampling_metadata([reqs[i] for i in rows], TARGET_STREAM, verifier.generator, dev)
            sampled = verifier.sampler(logits, md)
            if dev.type == "cuda":
                # Copied now, behind this step's sampling and ahead of whatever is queued next, so that reading
                # the ids waits for this step alone.
                host = torch.empty(len(rows), dtype=torch.int64, pin_memory=True)
                host.copy_(sampled, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record()
                if marks is not None:
                    marks.mark()  # the sampling's end
                    timing = marks
            else:
                host = sampled
        step = QueuedStep(plan, rows, sampled, host, copied, timing, time.perf_counter() - t0)
        # The table moves on as the step will: one token per sampled row, read back later.
        self.table.record(StepResult([[PENDING_TOKEN] if r.sample else None for r in reqs], [0] * len(reqs),
                                     step_id=plan.step_id))
        return step

    def _finish(self, step: QueuedStep) -> StepResult:
        """Wait for a queued step's ids; returns its result (and fills the ids into the table)."""
        if step.result is not None:
            return step.result
        t0 = time.perf_counter()
        tokens: list[int] = []
        if step.host is not None:
            if step.copied is not None:
                # SYNC: waits for this step's sampled ids alone; a step queued behind it runs on meanwhile.
                step.copied.synchronize()
            tokens = step.host.tolist()
        reqs = step.plan.requests
        sampled: list[list[int] | None] = [None] * len(reqs)
        for i, tok in zip(step.rows, tokens):
            r = reqs[i]
            sampled[i] = [tok]
            self.table.fill_pending(r.request_id, r.start_pos + len(r.token_ids), tok)
        result = StepResult(sampled, [0] * len(reqs), step_id=step.plan.step_id, num_draft_tokens=[0] * len(reqs))
        result.phase_seconds = queued_forward_phases(step.prepare_seconds, time.perf_counter() - t0, step.marks)
        return result

    @staticmethod
    def _fill(plan: StepPlan, prev: QueuedStep, prev_result: StepResult) -> None:
        """Write prev's tokens over the placeholders of `plan` (resolved while prev was queued)."""
        tokens = {prev.plan.requests[i].request_id: prev_result.sampled[i] for i in prev.rows}
        for r in plan.requests:
            if r.token_ids is not None and PENDING_TOKEN in r.token_ids:
                r.token_ids = [tokens[r.request_id][0] if t == PENDING_TOKEN else t for t in r.token_ids]


class LaggedResults:
    """An executor's side of the lag: a submit hands back the result of the step submitted before it, so a step's
    result may arrive before its collect, or only through an empty submit. Kept by step id until collected."""

    def __init__(self) -> None:
        self._done: dict[int, StepResult] = {}

    def add(self, result: StepResult | None) -> None:
        if result is not None:
            self._done[result.step_id] = result

    def clear(self) -> None:
        self._done.clear()

    def take(self, step_id: int, fetch: Callable[[], StepResult | None]) -> StepResult:
        """Step `step_id`'s result; `fetch` gives the next result in order (from an output not read yet, or an
        empty submit), None when no step is left to give one."""
        while step_id not in self._done:
            result = fetch()
            if result is None:
                raise RuntimeError(f"step {step_id} is not in flight")
            self.add(result)
        for stale in [s for s in self._done if s < step_id]:
            del self._done[stale]  # steps the engine dropped (a failed step): never collected
        return self._done.pop(step_id)


def _stays_queued(plan: StepPlan) -> bool:
    """Whether a resolved draft-less step may stay on the device while the next is queued (see the module doc)."""
    return all(r.logprobs is None and r.logits_params is None and r.prompt_targets is None for r in plan.requests)


def _pending_slots(plan: StepPlan, prev: QueuedStep | None) -> tuple[list[int], list[int]]:
    """The flat input indices of `plan`'s placeholders and, for each, its row in prev's sampled ids. Raises
    RuntimeError for a placeholder no queued step will fill (never feed PENDING_TOKEN to a model)."""
    flat: list[int] = []
    src: list[int] = []
    row_of = prev.row_of if prev is not None else {}
    offset = 0
    for r in plan.requests:
        assert r.token_ids is not None
        for j, tok in enumerate(r.token_ids):
            if tok == PENDING_TOKEN:
                if r.request_id not in row_of or j != len(r.token_ids) - 1:
                    raise RuntimeError(f"request {r.request_id}'s input holds a token no queued step will give")
                flat.append(offset + j)
                src.append(row_of[r.request_id])
        offset += len(r.token_ids)
    return flat, src
