"""Executors run a StepPlan on the models. The in-process one calls the draft proposer and the target
verifier directly; the Ray one (serving/) sends the same plan to worker actors."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine.decode_pipeline import DecodePipeline, LaggedResults
from engine.kv_cache.spec import KVCacheGroupSpec
from engine.request_table import RequestTable
from engine.runner.model_runner import ModelRunner
from engine.spec.proposer import DraftProposer
from engine.spec.speculation_ahead import AheadProposer
from engine.spec.verifier import Verifier
from engine.step_plan import StepPlan, StepResult


class Executor(Protocol):
    target_kv_groups: list[KVCacheGroupSpec]
    target_num_blocks: int
    draft_kv_groups: list[KVCacheGroupSpec] | None
    draft_num_blocks: int
    vocab_size: int
    # Whether the engine may submit a step before collecting the one before (EngineCore's asynchronous
    # scheduling): the executor's sides then keep request state (engine/request_table.py) and resolve open plans.
    async_scheduling: bool
    # Whether the draft drafts the next window while the target verifies (engine/spec/speculation_ahead.py): the
    # scheduler then gives the draft KV for that window too.
    speculation_ahead: bool

    def execute(self, plan: StepPlan, on_dispatched: Callable[[], None] | None = None) -> StepResult:
        """Run the plan; call on_dispatched (if given) once it is on its way and before waiting for its result."""
        ...

    def submit(self, plan: StepPlan) -> Any:
        """Send the plan on its way; returns a handle for `collect`. Steps run in the order submitted."""
        ...

    def collect(self, handle: Any) -> StepResult:
        """Wait for a submitted step's result (handles are collected in the order submitted)."""
        ...


class LocalExecutor:
    """Target and (optional) draft in this process. Both share one request table: the step's result is recorded
    once, for both models."""

    def __init__(self, target: ModelRunner, draft: ModelRunner | None, keep_draft_probs: bool, seed: int) -> None:
        self.target = target
        self.draft = draft
        self.verifier = Verifier(target, seed)
        cfg = target.config
        # Off unless asked for: in process the window drafted ahead runs after the verify, not beside it, so it
        # only pays where its hits save more forwards than its misses cost (tests exercise it here).
        self.speculation_ahead = bool(cfg.speculation_ahead) and draft is not None
        self.proposer = (DraftProposer(draft, keep_draft_probs, seed, ahead=self.speculation_ahead)
                         if draft is not None else None)
        self.ahead = (AheadProposer(self.proposer, cfg.synthetic_bonus_agreement, seed)
                      if self.proposer is not None and self.speculation_ahead else None)
        self.target_kv_groups = target.kv_groups
        self.target_num_blocks = target.num_blocks
        self.draft_kv_groups = draft.kv_groups if draft is not None else None
        self.draft_num_blocks = draft.num_blocks if draft is not None else 0
        self.vocab_size = target.vocab_size
        self.table = RequestTable()
        # A target alone on a GPU queues each step before it reads the last one's tokens (engine/decode_pipeline.py):
        # that needs the next plan before those tokens, i.e. asynchronous scheduling, which is then on by default.
        # With a draft, and on CPU (where a queued step runs at once), submitting early saves nothing and only
        # delays each step's tokens by one step, so it is off unless asked for (tests exercise it here).
        asked = target.config.async_scheduling
        self.async_scheduling = (draft is None and target.device.type == "cuda") if asked is None else bool(asked)
        self.pipeline = DecodePipeline(self.verifier, self.table) if draft is None and self.async_scheduling else None
        self._done = LaggedResults()

    def submit(self, plan: StepPlan) -> StepResult | int:
        """Runs the step now: the handle is its result. Pipelined: queues it; the handle is its step id."""
        if self.pipeline is None:
            return self.execute(plan)
        self._done.add(self.pipeline.step(plan))
        return plan.step_id

    def collect(self, handle: StepResult | int) -> StepResult:
        if isinstance(handle, StepResult):
            return handle
        pipeline = self.pipeline
        return self._done.take(handle, lambda: pipeline.step(None) if pipeline is not None else None)

    def execute(self, plan: StepPlan, on_dispatched: Callable[[], None] | None = None) -> StepResult:
        if self.pipeline is not None:
            handle = self.submit(plan)
            if on_dispatched is not None:
                on_dispatched()
            return self.collect(handle)
        if on_dispatched is not None:
            on_dispatched()  # this process runs the step itself: there is no wait to overlap
        plan = self.table.resolve(plan)
        result = self._run(plan)
        self.table.record(result)
        return result

    def _run(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        # A step without speculation (load-adaptive k = 0) leaves the draft idle: skip even the proposer's
        # bookkeeping, so such a step costs what a step of a target-only engine costs.
        draft_idle = not plan.max_draft_tokens and not any(r.draft_token_ids for r in plan.requests)
        if self.proposer is None or draft_idle:
            if self.ahead is not None:
                self.ahead.drop_all()  # windows drafted ahead are for the next step that speculates only
            result = self.verifier.verify(plan, None)
            result.phase_seconds["propose"] = 0.0
            return result
        # Same process, same device: the proposal stays on the device and the verify forward is queued behind
        # the draft's kernels, so the host never waits for the draft. CUDA events time the draft's GPU work.
        events = _start_events(self.draft)
        proposal = self.ahead.propose(plan) if self.ahead is not None else self.proposer.propose(plan)
        if events is not None:
            events[1].record()
        t1 = time.perf_counter()
        result = self.verifier.verify(plan, proposal)
        phases = result.phase_seconds
        if self.ahead is not None:
            t_ahead = time.perf_counter()
            self.ahead.predraft(plan, proposal)
            phases["propose_ahead"] = time.perf_counter() - t_ahead
            result.ahead = self.ahead.stats.as_tuple()
        if events is not None and events[1].query():
            # The verifier's sample phase waited for the draft too: book that wait as propose.
            draft_gpu = events[0].elapsed_time(events[1]) / 1e3
            wall = time.perf_counter() - t0
            phases["propose"] = draft_gpu
            phases["sample"] = max(0.0, wall - draft_gpu - phases["prepare"] - phases["verify"])
        else:
            phases["propose"] = t1 - t0
        return result


def _start_events(runner: ModelRunner | None) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
    if runner is None or runner.device.type != "cuda":
        return None
    events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    events[0].record()
    return events
