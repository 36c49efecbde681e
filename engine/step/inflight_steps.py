"""Asynchronous scheduling's steps in flight: the steps an engine submitted and has not collected yet.

With EngineConfig.async_scheduling, `EngineCore.step()` submits step n+1 before it collects step n, so the models
never wait for the scheduler. The executor's sides own what the scheduler cannot know yet (a decode's input after a
step in flight: engine/step/request_table.py); the scheduler plans from bounds (engine/scheduler.py) and commits exactly
as before, one step late. A request that ends while a later step of it is in flight keeps its KV blocks until that
step has landed (its tokens are dropped), and the sides forget it with the next plan.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.request import Request
from engine.scheduler import ScheduledRequest
from engine.step.phases import COMMIT, SCHEDULE
from engine.step.plan import StepPlan

if TYPE_CHECKING:
    from engine.engine_core import EngineCore, StepStats


@dataclass
class InFlightStep:
    """A submitted step whose result the engine has not collected yet."""

    scheduled: list[ScheduledRequest]
    handle: Any  # the executor's
    stats: StepStats
    schedule_seconds: float


class InFlightSteps:
    """An engine's steps in flight, oldest first, and the requests that ended while a step of theirs was in flight
    (their KV blocks go back once that step has landed). Submits to and collects from the engine's executor, and
    commits what lands through the engine."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
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

    def submit(self, plan: StepPlan, scheduled: list[ScheduledRequest], stats: StepStats,
               schedule_seconds: float) -> None:
        """Hand a step's plan to the executor and keep the step in flight until `collect`."""
        try:
            handle = self.engine.executor.submit(plan)
        except BaseException:
            # The plan may have reached some ranks only, and a pipelined executor loses the step queued
            # before it too: forget every step in flight (and what the sides know), plan explicit input next.
            self.drop()
            raise
        for s in scheduled:
            s.request.inflight = s
        self.steps.append(InFlightStep(scheduled, handle, stats, schedule_seconds))

    def collect(self) -> list[Request]:
        """Wait for the oldest step in flight and commit it."""
        engine = self.engine
        step = self.steps[0]
        try:
            result = engine.executor.collect(step.handle)
        except BaseException:
            self.drop()
            raise
        self.steps.popleft()
        t = time.perf_counter()
        touched = engine.commit(step.scheduled, result)
        for s in step.scheduled:
            if s.request.inflight is s:
                s.request.inflight = None
                done = self.deferred_free.pop(s.request.request_id, None)
                if done is not None:
                    engine.scheduler.free_kv(done)
        step.stats.phase_seconds = {**result.phase_seconds, SCHEDULE: step.schedule_seconds,
                                    COMMIT: time.perf_counter() - t}
        engine.last_step = step.stats
        return touched

    def flush(self) -> list[Request]:
        """Collect every step in flight; returns the requests they gave tokens or finished."""
        touched: list[Request] = []
        while self.steps:
            touched += self.collect()
        return touched

    def drop(self) -> None:
        """A step failed: forget every step in flight (none of them is committed; the sides drop what they
        resolved, and requests still running are planned with explicit input next) and what the sides were sent
        (a plan may have reached some ranks only): the next plan sends every entry whole."""
        engine = self.engine
        engine.sent.reset()
        for step in self.steps:
            for s in step.scheduled:
                s.request.inflight = None
        self.steps.clear()
        for req in self.deferred_free.values():
            engine.scheduler.free_kv(req)
        self.deferred_free.clear()
