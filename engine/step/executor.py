"""What EngineCore asks of an executor, which runs a StepPlan on the models. The in-process one
(engine/local_executor.py) runs the speculation step itself; the Ray one (serving/) sends the same plan to worker
actors, which run the same sides."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from engine.kv_cache.spec import KVCacheGroupSpec
from engine.step.plan import StepPlan, StepResult


class Executor(Protocol):
    target_kv_groups: list[KVCacheGroupSpec]
    target_num_blocks: int
    draft_kv_groups: list[KVCacheGroupSpec] | None
    draft_num_blocks: int
    vocab_size: int
    # Whether the engine may submit a step before collecting the one before (EngineCore's asynchronous
    # scheduling): the executor's sides then keep request state (engine/step/request_table.py) and resolve open plans.
    async_scheduling: bool
    # Whether the draft drafts the next window while the target verifies (engine/speculation/ahead/proposer.py): the
    # scheduler then gives the draft KV for that window too.
    speculation_ahead: bool
    # Whether the draft's runs ahead overlap the target's verify (a draft on GPUs of its own): the engine then fits
    # each step's fan-out of windows drafted ahead in the verify (engine/speculation/ahead/budget.py).
    ahead_overlaps_verify: bool

    def execute(self, plan: StepPlan, on_dispatched: Callable[[], None] | None = None) -> StepResult:
        """Run the plan; call on_dispatched (if given) once it is on its way and before waiting for its result."""
        ...

    def submit(self, plan: StepPlan) -> Any:
        """Send the plan on its way; returns a handle for `collect`. Steps run in the order submitted."""
        ...

    def runs_when_collected(self, handle: Any) -> bool:
        """Whether a submitted step waits for `collect` to run at all (nothing of it is on its way yet): planning
        the next step before collecting it would then overlap nothing, so the engine collects it first."""
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

    # A draft group that died and restarts (serving/router/recovery.py); an executor that cannot raises
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
