"""The executions of a pipelined Ray executor (serving/workers/ray_executor.py): a target alone under asynchronous
scheduling, whose ranks queue each step before reading the last one's tokens (engine/decode_pipeline.py), so that an
execution returns the result of the step submitted before it. The outputs not read yet and the results read but not
yet collected are kept here."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from engine.decode_pipeline import LaggedResults
from engine.step.plan import StepPlan, StepResult


class PipelinedExecutions:
    """dispatch: send a plan to the ranks (None: an empty one, which queues nothing and returns what they held) and
    return the execution's output; get: wait for an output (its list, target rank 0's result first)."""

    def __init__(self, dispatch: Callable[[StepPlan | None], Any], get: Callable[[Any], list[Any]]) -> None:
        self._dispatch, self._get = dispatch, get
        self._executions: deque[Any] = deque()  # outputs not read yet, oldest first
        self._done = LaggedResults()  # results read, not yet collected

    def add(self, output: Any) -> None:
        """A step's execution was submitted: its output is the step before's result."""
        self._executions.append(output)

    def clear(self) -> None:
        """A step failed: nothing submitted before it will be read."""
        self._executions.clear()
        self._done.clear()

    def result(self, step_id: int) -> StepResult:
        """Step `step_id`'s result: the output of the execution submitted after it, or of an empty one (a plan of
        None: the ranks queue nothing and return what they held) when none was."""
        return self._done.take(step_id, self._next_result)

    def _next_result(self) -> StepResult | None:
        """The next result target rank 0 hands back (the first execution's output is None: no step before it);
        None once an empty execution found nothing held."""
        while True:
            flush = not self._executions
            output = self._dispatch(None) if flush else self._executions.popleft()
            result = self._get(output)[0]
            if result is not None or flush:
                return result
