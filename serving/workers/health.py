"""Whether the Ray executor's model workers are alive, and what a failed step means: every worker answers a ping
or is named dead (WorkerDiedError); a step that failed on a dead, hung or disconnected worker marks the executor
broken for good (a router then rebuilds its workers: serving/router/recovery.py), while an error raised inside a
healthy worker goes up as it was."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NoReturn

import ray
from ray.actor import ActorHandle

from serving.workers.group import WorkerGroup


class WorkerDiedError(RuntimeError):
    """A model worker actor is dead or unresponsive; the executor cannot run steps any more.
    `role` ("target" | "draft") names the group of the worker found dead, when it is known."""

    def __init__(self, message: str, role: str | None = None) -> None:
        super().__init__(message)
        self.role = role


class WorkerHealth:
    """The Ray executor's workers' health: pings them, and holds whether a failed step broke the executor for good
    (and the group of the dead worker that did). The executor (serving/workers/ray_executor.py) holds one; it reads
    the executor's worker groups through `groups`."""

    def __init__(self, groups: Callable[[], tuple[WorkerGroup | None, WorkerGroup | None]], pooled_draft: bool,
                 step_timeout_s: float) -> None:
        """groups: the executor's (target, draft) groups as they are now; pooled_draft: the draft is a share of a
        draft pool's group (serving/draft_pool/pool.py)."""
        self._groups = groups
        self.pooled_draft = pooled_draft
        self.step_timeout_s = step_timeout_s
        self.broken: str | None = None
        self.broken_role: str | None = None  # the group of the dead worker that broke the executor

    def workers(self) -> list[tuple[str, int, ActorHandle]]:
        """(role, rank, actor handle) of every model worker, the target's first."""
        return [(g.role, rank, w) for g in self._groups() if g is not None for rank, w in enumerate(g.workers)]

    def check_usable(self) -> None:
        """Raise WorkerDiedError at once if a failed step or shutdown already marked the executor unusable."""
        if self.broken is not None:
            raise WorkerDiedError(self.broken, self.broken_role)

    def check(self, timeout_s: float = 10.0) -> None:
        """Ping every worker; raise WorkerDiedError naming the first that is dead or does not answer.

        With plain actor calls a ping waits behind a running step; call this between steps. An executor
        that a failed step or shutdown() already marked unusable raises at once."""
        self.check_usable()
        target, draft = self._groups()
        pending = [(role, rank, w.ping.remote()) for role, rank, w in self.workers()]
        deadline = time.monotonic() + timeout_s
        for role, rank, ref in pending:
            size = (target if role == "target" else draft).size  # type: ignore[union-attr]
            try:
                # SYNC: health check, off the step path.
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.RayActorError as e:
                raise WorkerDiedError(f"{role} worker rank {rank} of {size} has died "
                                      f"({type(e).__name__}); the engine must be restarted", role) from e
            except ray.exceptions.GetTimeoutError:
                raise WorkerDiedError(f"{role} worker rank {rank} of {size} did not answer a ping within "
                                      f"{timeout_s:.0f} s", role) from None
            except ray.exceptions.RayTaskError as e:
                if role != "draft" or not self.pooled_draft:
                    raise
                # The pooled draft group answers but no longer holds this target (evicted after a silence).
                raise WorkerDiedError(f"the draft pool dropped this target's share: {e.cause}", role) from e

    def raise_step_error(self, error: Exception) -> NoReturn:
        """Turn a failed step into a clear error: a dead/hung worker poisons the executor for good; an error
        raised inside a healthy worker (a bug, bad input) goes up as it was."""
        dead = isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.RayChannelError))
        timed_out = isinstance(error, (ray.exceptions.GetTimeoutError, ray.exceptions.RayChannelTimeoutError))
        try:
            self.check()
        except WorkerDiedError as e:
            self.broken, self.broken_role = str(e), e.role
            raise e from error
        if timed_out:
            self.broken = (f"a step took longer than step_timeout_s={self.step_timeout_s} s; the workers answer "
                           "pings but the step's state is unknown, so the executor must be rebuilt")
            raise WorkerDiedError(self.broken) from error
        if dead:
            self.broken = f"the step's channels failed ({type(error).__name__}); the executor must be rebuilt"
            raise WorkerDiedError(self.broken) from error
        raise error

    def clear(self) -> None:
        """The broken group is gone (a dead draft dropped): the executor may step again if the rest answers."""
        self.broken = self.broken_role = None

    def mark_shut_down(self) -> None:
        self.broken = self.broken or "the executor was shut down"
