"""A target engine's moves between the replicas of its draft pool (serving/draft_pool/pool.py), without a step lost.

A draft replica asks a target to move when the pool's balance calls for it (another replica has two targets fewer:
one just started, say) or when Serve stops it (a scale-down); the target learns it by polling its replica's rank 0
(`tenant_placement`) every MOVE_POLL_S. It then attaches to the least-loaded other replica while its steps go on
(`start_pooled_move`: a slot there, no model load), and between two steps lands the steps in flight, lets go of the
old share and puts the new one into the step: the new draft knows none of the requests in flight, so each request's
draft progress restarts and the draft catches up on its tokens in one chunk at its next speculative step, as after a
dead draft's replacement (serving/router/recovery.py), but without a step taken without speculation. Moves are
lossless whatever happens: the target decides every token. A move that finds no room elsewhere is tried again at the
next poll; should the old replica's group go first, the target fails over as from a dead draft.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from collections.abc import Callable

    from serving.router.recovery import RecoveryHost

logger = logging.getLogger("specserve")

MOVE_POLL_S = 1.0


class DraftMoves:
    """The router's watch of its draft pool's placement, and its moves: the Router (serving/router/router.py) holds
    one and starts it from its health checks."""

    def __init__(self, router: RecoveryHost, recovering: Callable[[], bool]) -> None:
        """recovering: whether the router's recovery (serving/router/recovery.py) is under way or the engine is
        down; a move waits for it."""
        self._router = router
        self._recovering = recovering
        self.task: asyncio.Task | None = None  # the placement watch: keeps a reference so it is not collected

    def ensure(self) -> None:
        """Start polling the draft pool's placement, for an engine attached to one (on the router's event loop)."""
        if getattr(getattr(self._router.engine, "executor", None), "draft_pool", None) is None:
            return
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._watch_draft_placement())

    async def _watch_draft_placement(self) -> None:
        while True:
            await asyncio.sleep(MOVE_POLL_S)
            try:
                await self._move_draft_if_asked()
            except Exception as e:  # noqa: BLE001 - no room elsewhere, a replica going: stay, ask again later
                logger.warning("router: moving to another draft replica failed (staying for now): %s", e)

    async def _move_draft_if_asked(self) -> None:
        router = self._router
        engine = router.engine
        executor = engine.executor
        group = executor.draft
        if self._recovering() or group is None or not group.workers:
            return
        tenant = group.workers[0]
        try:
            why = await tenant.worker.tenant_placement.remote(tenant.share.tenant_id)
        except ray.exceptions.RayActorError:
            return  # the draft group died: the next step or health check finds it, and recovery attaches anew
        if why is None:
            return
        logger.info("router: moving from draft replica %s: %s", tenant.replica, why)
        pending = await asyncio.to_thread(executor.start_pooled_move)
        async with router._between_steps():
            if router.engine is not engine or self._recovering() or executor.draft is not group:
                # A dead draft or worker took over meanwhile: its recovery attaches a share of its own.
                if not self._recovering():
                    executor.draft_groups.drop(pending)
                return
            router._publish_now(engine.flush())  # the steps in flight land before the draft is swapped
            spec = engine.detach_draft()  # lets go of the old share (detached there)
            engine.attach_draft(spec)
            router._update_queue_and_kv()
        logger.info("router: moved to draft replica %s", pending.workers[0].replica)
