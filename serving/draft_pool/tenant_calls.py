"""A target's step calls to a pooled draft group's rank 0, run in the order the target made them.

Rank 0 of a pooled draft group (serving/draft_pool/worker.py) runs calls of several targets at once, in threads, so
that their draft steps can meet in one batch (serving/draft_pool/batch.py). Ray runs a threaded actor's calls in no set
order, and it holds back a call whose argument is an ObjectRef until that ref is ready, letting later calls pass it:
under asynchronous scheduling, a target's draft step n + 1 (its plan sent early) would overtake the absorb of step n
(waiting for the target's result), whose tokens step n + 1 reads. So each target's calls carry a sequence number,
and rank 0 runs a target's calls one at a time in that order (`CallOrder`), as an actor of one thread runs them;
different targets' calls never wait for each other's. An ObjectRef argument goes inside a `Pending` box, which Ray
does not open: the call reaches rank 0 at once, takes its turn, and waits for the ref there, so a ref that
fails (the target's step failed) fails that call, in its turn, instead of leaving a gap the target's later calls
would wait on. For the same reason a call takes its number only once `.remote()` has sent it (`CallSequence`): a
call that fails to leave the target (an argument Ray cannot serialize) raises there and leaves no gap. A number
that comes after its turn has passed (a duplicate, or a call that is late) is a `CallOutOfOrder`, not a
`TenantGone`: the tenant is still attached, and its order is what broke.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorHandle


@dataclass
class Pending:
    """An ObjectRef sent inside a call's argument (Ray resolves only top-level refs before a call runs)."""

    ref: Any

    def get(self, timeout_s: float | None) -> Any:
        # SYNC: a tenant's absorb waits here for its target's result, as Ray would have before running the call;
        # only this tenant's later calls wait behind it.
        return ray.get(self.ref, timeout=timeout_s)


def unbox(arg: Any, timeout_s: float | None = None) -> Any:
    """An argument as the call reads it: a Pending box's value, anything else as it came."""
    return arg.get(timeout_s) if isinstance(arg, Pending) else arg


class CallSequence:
    """The numbers of one tenant's ordered calls, 0, 1, 2, ...: a number is used up only by a call that was sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0

    def send(self, submit: Callable[[int], Any]) -> Any:
        """`submit(n)` with the next number n, which counts as taken only if `submit` returns: where it raises (the
        call never left), the tenant's next call gets n, so rank 0 sees no gap to wait on. The lock keeps the
        numbers in the order the calls were sent, should two threads send."""
        with self._lock:
            sent = submit(self._next)
            self._next += 1
            return sent


class TenantCall:
    """A pooled rank's `tenant_<method>` with the tenant's id and the next number of its sequence bound, as
    serving/workers/step_topology.py calls a worker method. `sequence`: shared by the tenant's ordered calls."""

    def __init__(self, worker: ActorHandle, method: str, tenant_id: str, sequence: CallSequence | None) -> None:
        self._method = getattr(worker, method)
        self._tenant_id = tenant_id
        self._sequence = sequence

    def remote(self, *args: Any) -> Any:
        if self._sequence is None:  # an unordered call (a ping)
            return self._method.remote(self._tenant_id, *args)
        boxed = [Pending(a) if isinstance(a, ray.ObjectRef) else a for a in args]
        return self._sequence.send(lambda seq: self._method.remote(self._tenant_id, seq, *boxed))


class TenantGone(RuntimeError):
    """A call for a tenant this draft group does not hold (never attached, detached or evicted)."""


class CallOutOfOrder(RuntimeError):
    """A tenant's call whose number's turn has passed: a duplicate, or sent after a later call already ran."""


class CallOrder:
    """Rank 0's side: each tenant's ordered calls run one at a time, in sequence order (`turn`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next: dict[str, int] = {}  # per attached tenant, the sequence number whose turn it is

    def open(self, tenant_id: str) -> None:
        """A tenant attached: its sequence starts at 0 (a new TenantDraft's)."""
        with self._cond:
            self._next[tenant_id] = 0
            self._cond.notify_all()

    def close(self, tenant_id: str) -> None:
        """A tenant left: its calls waiting for their turn raise TenantGone."""
        with self._cond:
            self._next.pop(tenant_id, None)
            self._cond.notify_all()

    @contextmanager
    def turn(self, tenant_id: str, seq: int, timeout_s: float) -> Iterator[None]:
        """Wait until call `seq` of the tenant is next, run the block, then hand the turn on (also when the block
        raised). TenantGone if the tenant is not attached or leaves meanwhile; CallOutOfOrder if call `seq`'s turn
        has passed; TimeoutError after `timeout_s` (a call before it never came: its target died between sending
        the two, and the pool's watch will evict it)."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._next.get(tenant_id, seq) >= seq, timeout_s)
            if tenant_id not in self._next:
                raise TenantGone(f"target {tenant_id} is not attached to this draft replica (detached or evicted)")
            if self._next[tenant_id] > seq:
                raise CallOutOfOrder(f"target {tenant_id}'s call {seq} came after its turn: call "
                                     f"{self._next[tenant_id]} is next (a duplicate or late sequence number)")
            if not ok:
                raise TimeoutError(f"target {tenant_id}'s call {seq} waited {timeout_s:.0f} s for call "
                                   f"{self._next[tenant_id]}, which never came")
        try:
            yield
        finally:
            with self._cond:
                if self._next.get(tenant_id) == seq:
                    self._next[tenant_id] = seq + 1
                self._cond.notify_all()
