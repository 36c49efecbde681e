"""Asynchronous scheduling's steps in flight: the steps an engine submitted and has not collected yet.

With EngineConfig.async_scheduling, `EngineCore.step()` submits step n+1 before it collects step n, so the models
never wait for the scheduler. The executor's sides own what the scheduler cannot know yet (a decode's input after a
step in flight: engine/step/request_table.py); the scheduler plans from bounds (engine/scheduler.py) and commits exactly
as before, one step late. A request that ends while a later step of it is in flight keeps its KV blocks until that
step has landed (its tokens are dropped), and the sides forget it with the next plan.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.request import Request
from engine.scheduler import ScheduledRequest
from engine.step.phases import StepStats


@dataclass
class InFlightStep:
    """A submitted step whose result the engine has not collected yet."""

    scheduled: list[ScheduledRequest]
    handle: Any  # the executor's (synchronous scheduling: the step's result, the executor having run it)
    stats: StepStats
    schedule_seconds: float


class InFlightSteps:
    """An engine's steps in flight, oldest first, and the requests that ended while a step of theirs was in flight
    (their KV blocks go back, through `free_kv`, once that step has landed). Bookkeeping only: the engine submits,
    collects and commits (engine/engine_core.py, `step`)."""

    def __init__(self, free_kv: Callable[[Request], None]) -> None:
        self.free_kv = free_kv
        self.steps: deque[InFlightStep] = deque()
        # Ended requests whose KV blocks wait for their step in flight.
        self.deferred_free: dict[str, Request] = {}
        self.sync_next = False  # let the steps in flight land before scheduling (a preemption is due)

    def __len__(self) -> int:
        return len(self.steps)

    def holds(self, request_id: str) -> bool:
        """Whether an ended request of this id still waits for its step in flight (the id is not free yet)."""
        return request_id in self.deferred_free

    def defer_free(self, req: Request) -> None:
        """`req` ended while a step of it is in flight: free its KV blocks once that step has landed."""
        self.deferred_free[req.request_id] = req

    def add(self, step: InFlightStep) -> None:
        """A step the executor took: in flight until `landed`."""
        for s in step.scheduled:
            s.request.inflight = s
        self.steps.append(step)

    @property
    def oldest(self) -> InFlightStep:
        return self.steps[0]

    def landed(self, step: InFlightStep) -> None:
        """The oldest step is committed: it leaves, and requests that ended meanwhile give their KV blocks back."""
        assert self.steps[0] is step
        self.steps.popleft()
        for s in step.scheduled:
            if s.request.inflight is s:
                s.request.inflight = None
                done = self.deferred_free.pop(s.request.request_id, None)
                if done is not None:
                    self.free_kv(done)

    def drop(self) -> None:
        """A step failed: forget every step in flight (none of them is committed; the sides drop what they
        resolved, and requests still running are planned with explicit input next) and free the KV blocks that
        waited for them."""
        for step in self.steps:
            for s in step.scheduled:
                s.request.inflight = None
        self.steps.clear()
        for req in self.deferred_free.values():
            self.free_kv(req)
        self.deferred_free.clear()
