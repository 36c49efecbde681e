"""Continuous batching of the draft steps that several targets send one pooled draft group (serving/draft_pool/pool.py).

Rank 0 runs each target's call in a thread of its own. A call that finds the draft idle runs at once, alone: nothing
waits for company, so one target alone pays no delay. Calls that arrive while a batch runs queue up; when it ends,
one of them (the first to wake) takes every call queued by then, up to the draft's capacity, and runs them as one
draft step, while later arrivals queue for the next. Under load, when several targets wait on the draft, each draft
forward thus serves all of them: three targets cost one draft step, not three in a row.

`run` (the rank's) takes the batch's items and returns one outcome per item: a value, or the exception that item
alone failed with (a tenant evicted while it waited, a plan its table cannot resolve); an exception `run` raises
fails every item of the batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass
class _Waiter(Generic[T]):
    item: T
    size: int  # what the item takes of the batch's capacity (its requests)
    done: bool = False
    outcome: Any = None


@dataclass
class BatchStats:
    """How many items each batch held ({items: batches}), and the seconds batches ran in all: the draft's busy
    time, its load signal for autoscaling (serving/draft_pool/autoscaling.py)."""

    sizes: dict[int, int] = field(default_factory=dict)
    busy_s: float = 0.0

    def add(self, n: int) -> None:
        self.sizes[n] = self.sizes.get(n, 0) + 1


class DraftBatcher(Generic[T]):
    def __init__(self, run: Callable[[list[T]], list[Any]], capacity: int) -> None:
        """capacity: the most requests a batch holds (the draft's max_num_seqs); an item larger than it runs alone."""
        self._run = run
        self.capacity = capacity
        self._cond = threading.Condition()
        self._queue: list[_Waiter[T]] = []
        self._running = False
        self.stats = BatchStats()
        self.lock = threading.RLock()  # held while a batch runs: what must not change under a step takes it too

    def submit(self, item: T, size: int) -> Any:
        """Run `item` in the next batch that has room; its outcome (raised, where it is an exception)."""
        me: _Waiter[T] = _Waiter(item, size)
        with self._cond:
            self._queue.append(me)
            while not me.done:
                if not self._running:
                    batch = self._take()
                    self._running = True
                    self._cond.release()
                    outcomes: list[Any] | None = None
                    try:
                        outcomes = self._run_batch(batch)
                    finally:
                        self._cond.acquire()
                        self._running = False
                        if outcomes is None:  # an interrupt (BaseException) left the batch: its calls end too,
                            # rather than wait for a notify that never comes or lead empty batches for ever
                            outcomes = [RuntimeError("the draft batch was interrupted")] * len(batch)
                        for w, outcome in zip(batch, outcomes):
                            w.outcome, w.done = outcome, True
                        self._cond.notify_all()
                else:
                    self._cond.wait()
        if isinstance(me.outcome, BaseException):
            raise me.outcome
        return me.outcome

    def _take(self) -> list[_Waiter[T]]:
        """The queue's head, and whatever follows it in arrival order while the batch has room."""
        batch, used, left = [], 0, []
        for w in self._queue:
            if not batch or used + w.size <= self.capacity:
                batch.append(w)
                used += w.size
            else:
                left.append(w)
        self._queue = left
        return batch

    def _run_batch(self, batch: list[_Waiter[T]]) -> list[Any]:
        with self.lock:
            self.stats.add(len(batch))
            t0 = time.perf_counter()
            try:
                outcomes = self._run([w.item for w in batch])
            except Exception as e:  # noqa: BLE001 - the batch's own failure: every item of it fails with it
                return [e] * len(batch)
            finally:
                self.stats.busy_s += time.perf_counter() - t0
        if len(outcomes) != len(batch):
            err = RuntimeError(f"a draft batch of {len(batch)} calls returned {len(outcomes)} outcomes")
            return [err] * len(batch)
        return outcomes
