"""The in-process executor (the Executor of engine/step/executor.py): target and draft in this process, running
the speculation step (engine/speculation/speculative_step.py) itself."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from engine.decode_pipeline import DecodePipeline, LaggedResults
from engine.runner.model_runner import ModelRunner
from engine.speculation.ahead.proposer import AheadProposer
from engine.speculation.proposer import DraftProposer
from engine.speculation.speculative_step import SpeculativeStep
from engine.speculation.verifier import Verifier
from engine.step.plan import StepPlan, StepResult
from engine.step.request_table import RequestTable


class LocalExecutor:
    """Target and (optional) draft in this process: one SpeculativeStep (engine/speculation/speculative_step.py), whose
    sides share one request table, and under asynchronous scheduling a DecodePipeline for the steps the target runs
    alone."""

    def __init__(self, target: ModelRunner, draft: ModelRunner | None, keep_draft_probs: bool, seed: int) -> None:
        self.target = target
        self.draft = draft
        cfg = target.config
        # Off unless asked for: in process the window drafted ahead runs after the verify, not beside it, so it
        # only pays where its hits save more forwards than its misses cost (tests exercise it here).
        self.speculation_ahead = bool(cfg.speculation_ahead) and draft is not None
        self.ahead_overlaps_verify = False  # one device: the window drafted ahead runs after the verify
        self.step = SpeculativeStep.build(target, draft, keep_draft_probs, seed, self.speculation_ahead)
        self.target_kv_groups = target.kv_groups
        self.target_num_blocks = target.num_blocks
        self.draft_kv_groups = draft.kv_groups if draft is not None else None
        self.draft_num_blocks = draft.num_blocks if draft is not None else 0
        # What each model's weights hold, {"bytes", "format"} (engine/quantization.weights_summary): for /health.
        self.target_weights: dict[str, Any] | None = target.weights
        self.draft_weights: dict[str, Any] | None = draft.weights if draft is not None else None
        self.vocab_size = target.vocab_size
        # A target alone on a GPU queues each step before it reads the last one's tokens
        # (engine/decode_pipeline.py): that needs the next plan before those tokens, i.e. asynchronous scheduling.
        # With a draft model the steps without speculation (the draft length rule's k = 0) queue alike, the draft
        # sitting them out and catching up at the next step that speculates; steps that speculate run when
        # collected, in order, and the engine collects such a step before it plans the next (runs_when_collected):
        # planned ahead of it, the next plan overlapped nothing and cost the host more.
        # An EAGLE-3 head and speculation ahead need every step whole (DraftSide.sits_out_queued_steps): their steps
        # all run at once, where submitting early saves nothing and only delays each step's tokens by one step (off
        # unless asked for; tests exercise it). On CPU a queued step runs at once: off unless asked for there too.
        queues = self.step.draft is None or self.step.draft.sits_out_queued_steps
        asked = cfg.async_scheduling
        default = target.device.type == "cuda" and queues and (draft is None or cfg.adaptive_draft_length)
        self.async_scheduling = default if asked is None else bool(asked)
        self.pipeline = DecodePipeline(self.verifier, self.table) if queues and self.async_scheduling else None
        self._deferred: deque[StepPlan] = deque()  # steps that speculate, submitted and not run yet (oldest first)
        self._done = LaggedResults()

    @property
    def table(self) -> RequestTable:
        return self.step.table

    @property
    def verifier(self) -> Verifier:
        return self.step.target.verifier

    @property
    def proposer(self) -> DraftProposer | None:
        return self.step.draft.proposer if self.step.draft is not None else None

    @property
    def ahead(self) -> AheadProposer | None:
        return self.step.draft.ahead if self.step.draft is not None else None

    def submit(self, plan: StepPlan) -> StepResult | int:
        """Runs the step now: the handle is its result. Pipelined: queues a step without drafts (after running every
        step submitted before it), keeps one that speculates for `collect`; the handle is its step id."""
        if self.pipeline is None:
            return self.execute(plan)
        try:
            if _speculates(plan):
                self._deferred.append(plan)
            else:
                while self._deferred:
                    self._done.add(self._next_result())
                self._done.add(self.pipeline.step(plan))
        except BaseException:
            self._deferred.clear()  # the engine forgets every step in flight (and plans explicit input next)
            raise
        return plan.step_id

    def runs_when_collected(self, handle: StepResult | int) -> bool:
        """A step that speculates, kept for `collect` (see submit)."""
        return bool(self._deferred) and self._deferred[-1].step_id == handle

    def collect(self, handle: StepResult | int) -> StepResult:
        if isinstance(handle, StepResult):
            return handle
        try:
            return self._done.take(handle, self._next_result)
        except BaseException:
            self._deferred.clear()
            raise

    def _next_result(self) -> StepResult | None:
        """The result of the oldest step submitted and not yet given: the pipeline's queued step (always older than
        any kept one), else the oldest kept step, run now; None when none is left."""
        if self.pipeline is not None and self.pipeline.pending is not None:
            return self.pipeline.step(None)
        if self._deferred:
            return self.step.run(self._deferred.popleft())
        return None

    def execute(self, plan: StepPlan, on_dispatched: Callable[[], None] | None = None) -> StepResult:
        if self.pipeline is not None:
            handle = self.submit(plan)
            if on_dispatched is not None:
                on_dispatched()
            return self.collect(handle)
        if on_dispatched is not None:
            on_dispatched()  # this process runs the step itself: there is no wait to overlap
        return self.step.run(plan)

    # --- what a process of its own would have: nothing to list, check or release here ----------------------
    def workers(self) -> list[tuple[str, int, Any]]:
        return []

    def check_health(self, timeout_s: float = 10.0) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def detach_draft(self) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot run without its draft")

    def start_draft_group(self) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot start a draft group")

    def attach_draft(self) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot attach a draft group")


def _speculates(plan: StepPlan) -> bool:
    """Whether the draft works in this step (drafts, or its catch-up or prefill): else the target runs it alone."""
    return any(r.num_draft_tokens or r.draft_runs for r in plan.requests)
