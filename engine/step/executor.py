"""Executors run a StepPlan on the models. The in-process one runs the speculation step
(engine/speculation/speculative_step.py) itself; the Ray one (serving/) sends the same plan to worker actors, which run
the same sides."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from engine.kv_cache.spec import KVCacheGroupSpec
from engine.runner.model_runner import ModelRunner
from engine.speculation.proposer import DraftProposer
from engine.speculation.speculation_ahead import AheadProposer
from engine.speculation.speculative_step import SpeculativeStep
from engine.speculation.verifier import Verifier
from engine.step.decode_pipeline import DecodePipeline, LaggedResults
from engine.step.plan import StepPlan, StepResult
from engine.step.request_table import RequestTable


class Executor(Protocol):
    target_kv_groups: list[KVCacheGroupSpec]
    target_num_blocks: int
    draft_kv_groups: list[KVCacheGroupSpec] | None
    draft_num_blocks: int
    vocab_size: int
    # Whether the engine may submit a step before collecting the one before (EngineCore's asynchronous
    # scheduling): the executor's sides then keep request state (engine/step/request_table.py) and resolve open plans.
    async_scheduling: bool
    # Whether the draft drafts the next window while the target verifies (engine/speculation/speculation_ahead.py): the
    # scheduler then gives the draft KV for that window too.
    speculation_ahead: bool
    # Whether the draft's runs ahead overlap the target's verify (a draft on GPUs of its own): the engine then fits
    # each step's fan-out of windows drafted ahead in the verify (engine/speculation/ahead_budget.py).
    ahead_overlaps_verify: bool

    def execute(self, plan: StepPlan, on_dispatched: Callable[[], None] | None = None) -> StepResult:
        """Run the plan; call on_dispatched (if given) once it is on its way and before waiting for its result."""
        ...

    def submit(self, plan: StepPlan) -> Any:
        """Send the plan on its way; returns a handle for `collect`. Steps run in the order submitted."""
        ...

    def collect(self, handle: Any) -> StepResult:
        """Wait for a submitted step's result (handles are collected in the order submitted)."""
        ...

    def workers(self) -> list[tuple[str, int, Any]]:
        """(role, rank, actor handle) of each model worker; empty for models in this process."""
        ...

    def check_health(self, timeout_s: float = 10.0) -> None:
        """Raise when a model worker is dead or does not answer within `timeout_s`; call between steps."""
        ...

    def shutdown(self) -> None:
        """Release the models' workers, if any. Safe to call twice."""
        ...

    # A draft group that died and restarts (serving/engine_recovery.py); an executor that cannot raises
    # RuntimeError saying so.
    def detach_draft(self) -> None:
        """Run target-only steps from now on (no draft, no draft KV)."""
        ...

    def start_draft_group(self) -> None:
        """Start (load) a new draft beside the running target, after `detach_draft`; steps may run meanwhile."""
        ...

    def attach_draft(self) -> None:
        """Put the draft `start_draft_group` started into the step (`draft_kv_groups` describe its KV then)."""
        ...


class LocalExecutor:
    """Target and (optional) draft in this process: one SpeculativeStep (engine/speculation/speculative_step.py), whose
    sides
    share one request table, or for a target alone under asynchronous scheduling a DecodePipeline."""

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
        # (engine/step/decode_pipeline.py): that needs the next plan before those tokens, i.e. asynchronous scheduling,
        # which is then on by default.
        # With a draft, and on CPU (where a queued step runs at once), submitting early saves nothing and only
        # delays each step's tokens by one step, so it is off unless asked for (tests exercise it here).
        asked = target.config.async_scheduling
        self.async_scheduling = (draft is None and target.device.type == "cuda") if asked is None else bool(asked)
        self.pipeline = DecodePipeline(self.verifier, self.table) if draft is None and self.async_scheduling else None
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
