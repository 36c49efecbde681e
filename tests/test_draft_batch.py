"""How a pooled draft group's rank 0 schedules its targets' calls, in threads, without Ray or a model: continuous
batching (serving/draft_pool/batch.py) and each target's call order (serving/draft_pool/tenant_calls.py)."""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import pytest

from serving.draft_pool.batch import DraftBatcher
from serving.draft_pool.tenant_calls import CallOrder, CallOutOfOrder, CallSequence, TenantCall, TenantGone


def _wait(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_calls_that_arrive_while_a_batch_runs_meet_in_the_next() -> None:
    release = threading.Event()
    batches: list[list[str]] = []

    def run(items: list[str]) -> list[object]:
        batches.append(list(items))
        if items == ["first"]:
            release.wait(10)
        return [ValueError(f"{i} is bad") if i.startswith("bad") else i.upper() for i in items]

    batcher: DraftBatcher[str] = DraftBatcher(run, capacity=5)
    outcomes: dict[str, object] = {}

    def call(item: str, size: int) -> None:
        try:
            outcomes[item] = batcher.submit(item, size)
        except Exception as e:  # noqa: BLE001 - recorded for the test
            outcomes[item] = e

    first = threading.Thread(target=call, args=("first", 1))
    first.start()
    _wait(lambda: batches, "the first batch")  # alone: nothing waited for company
    later = [threading.Thread(target=call, args=(item, size))
             for item, size in (("a", 2), ("bad", 1), ("b", 2), ("c", 1))]
    for n, t in enumerate(later, start=1):
        t.start()
        _wait(lambda n=n: len(batcher._queue) == n, "the call queued")
    release.set()
    for t in [first, *later]:
        t.join()
    # The queue's head and what follows while the batch has room (5 requests): c waits for the next batch.
    assert batches == [["first"], ["a", "bad", "b"], ["c"]]
    assert batcher.stats.sizes == {1: 2, 3: 1}
    assert outcomes["a"] == "A" and outcomes["b"] == "B" and outcomes["c"] == "C"
    assert isinstance(outcomes["bad"], ValueError)  # it failed alone


def test_a_batch_that_raises_fails_each_of_its_calls() -> None:
    def run(items: list[str]) -> list[object]:
        raise RuntimeError("the draft forward failed")

    batcher: DraftBatcher[str] = DraftBatcher(run, capacity=4)
    with pytest.raises(RuntimeError, match="forward failed"):
        batcher.submit("x", 1)
    assert batcher._running is False  # the next call may lead a batch


def test_a_targets_calls_run_in_its_order_and_fail_once_it_left() -> None:
    order = CallOrder()
    order.open("t")
    ran: list[int] = []

    def call(seq: int) -> None:
        try:
            with order.turn("t", seq, timeout_s=10):
                ran.append(seq)
        except TenantGone:
            ran.append(-seq)

    threads = [threading.Thread(target=call, args=(seq,)) for seq in (2, 1)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    assert ran == []  # 1 and 2 wait for 0
    call(0)
    for t in threads:
        t.join()
    assert ran == [0, 1, 2]
    late = threading.Thread(target=call, args=(4,))  # 3 never comes: its target died in between
    late.start()
    time.sleep(0.05)
    order.close("t")  # evicted: the waiting call is told so
    late.join()
    assert ran == [0, 1, 2, -4]
    with pytest.raises(TimeoutError):
        order.open("u")
        with order.turn("u", 1, timeout_s=0.05):
            pass


class _Sender:
    """A stand-in for a rank 0 actor handle's method: `.remote()` serializes its arguments first, as Ray's does,
    and raises where they cannot be (the call never leaves); what it sent is kept, to run on a CallOrder."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def remote(self, *args: Any) -> tuple[Any, ...]:
        pickle.dumps(args)
        self.sent.append(args)
        return args


def test_a_call_that_fails_to_send_leaves_no_gap_and_a_late_number_is_out_of_order() -> None:
    worker = type("Rank0", (), {})()
    worker.tenant_draft_step = worker.tenant_absorb = _Sender()
    sequence = CallSequence()
    step = TenantCall(worker, "tenant_draft_step", "t", sequence)
    absorb = TenantCall(worker, "tenant_absorb", "t", sequence)
    step.remote("plan 0")
    with pytest.raises(TypeError):
        absorb.remote(threading.Lock())  # cannot be pickled: the call never left
    step.remote("plan 1")
    assert [args[:2] for args in worker.tenant_draft_step.sent] == [("t", 0), ("t", 1)]  # no number skipped
    order = CallOrder()
    order.open("t")
    ran = []
    for tenant_id, seq, _ in worker.tenant_draft_step.sent:
        with order.turn(tenant_id, seq, timeout_s=2.0):  # a gap would time out here
            ran.append(seq)
    assert ran == [0, 1]
    with pytest.raises(CallOutOfOrder, match="call 1 came after its turn: call 2 is next"):
        with order.turn("t", 1, timeout_s=2.0):  # a duplicate: its tenant is still attached
            pass
    with pytest.raises(TenantGone):
        with order.turn("gone", 0, timeout_s=2.0):
            pass


def test_an_interrupted_batch_ends_every_call_of_it() -> None:
    # A BaseException (an interrupt) out of the run: the leader raises it, and the batch's other calls fail too
    # instead of waiting for ever (or leading empty batches).
    class Interrupt(BaseException):
        pass

    release = threading.Event()

    def run(items: list[str]) -> list[object]:
        if items == ["first"]:
            release.wait(10)
            return ["FIRST"]
        raise Interrupt

    batcher: DraftBatcher[str] = DraftBatcher(run, capacity=4)
    outcomes: dict[str, BaseException | object] = {}

    def call(item: str) -> None:
        try:
            outcomes[item] = batcher.submit(item, 1)
        except BaseException as e:  # noqa: BLE001 - recorded for the test
            outcomes[item] = e

    threads = [threading.Thread(target=call, args=("first",), daemon=True)]
    threads[0].start()
    _wait(lambda: batcher._running, "the first batch")
    for n, item in enumerate(("a", "b"), start=1):
        threads.append(threading.Thread(target=call, args=(item,), daemon=True))
        threads[-1].start()
        _wait(lambda n=n: len(batcher._queue) == n, "the call queued")
    release.set()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads), outcomes
    assert outcomes["first"] == "FIRST"
    kinds = sorted(type(outcomes[i]).__name__ for i in ("a", "b"))
    assert kinds == ["Interrupt", "RuntimeError"], outcomes  # the leader's interrupt; the other call fails with it
    assert batcher._running is False
