"""A router's recovery from a dead model worker, and serving on the target alone while the draft group is down.

A step that fails because a model worker died (serving.workers.health.WorkerDiedError, or Ray's actor error)
fails the requests in flight with a 503 that says so, marks the router unavailable (/health 503, new requests 503)
and rebuilds its worker groups in the background; should that fail, the router's actor ends so that Serve's controller
creates a new router, which builds new workers. `EngineRecovery` holds these steps and whether the router is
unavailable or serves without its draft; the Router (serving/router/router.py) holds one, fails the requests of a
failed step itself and calls `serve_without_draft` and `declare_dead` while it holds the engine; the background tasks
take the engine between steps themselves.

Speculation is lossless: the target decides every token, so an engine that stops speculating mid-request
produces exactly what it would have produced with the draft (greedy: the same tokens; sampled: the same
distribution). That lets the router (`continue_without_draft`) keep its requests in flight when a draft rank dies
instead of failing them. The failed step committed nothing, so the target's KV and every request's progress are
intact; only the draft's side is dropped. The engine does the work (EngineCore.detach_draft / start_draft_group /
attach_draft); the sequence is:

    detach_draft(engine)      executor runs target-only steps; no draft KV manager; scheduler k = 0
    ... serve ...             engine.start_draft_group() loads new draft ranks meanwhile (off the lock)
    attach_draft(engine, s)   between steps: the graph gets the new draft ranks, a fresh draft KV manager,
                              and every request's draft progress restarts at 0, so the draft catches up on
                              the tokens it has not seen (one chunk) at the request's next speculative step

A draft colocated in the target's ranks (draft_placement "colocated") has no group of its own: its ranks are the
target's, whose death rebuilds the whole engine, and `detach_draft` refuses it (speculation stays on).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import ray

from serving.engine_builders import import_builder

logger = logging.getLogger("specserve")


def detach_draft(engine: Any) -> Any:
    """Switch `engine` (an EngineCore on a RayExecutor) to target-only steps; returns its SpeculativeConfig,
    for `attach_draft`. Raises if the executor cannot (a target rank is dead too)."""
    return engine.detach_draft()


def settle_steps_in_flight(engine: Any) -> list[Any]:
    """Collect the engine's steps in flight before the draft is detached; returns the requests they touched. A health
    probe can find the draft dead between two steps while one is still in flight (asynchronous scheduling): it ran on
    the groups about to be replaced, and collected after the step is rebuilt without the draft it would fail with an
    error that names no group of the new step, which would rebuild the whole engine. A step that fails here (on the
    dead draft) is dropped by the engine with those after it: none of them committed anything."""
    try:
        return engine.flush()
    except Exception as e:  # noqa: BLE001 - the dead draft's step; a dead target rank fails detach_draft's check
        logger.warning("a step in flight failed with the draft group and is dropped: %s", e)
        return []


def attach_draft(engine: Any, spec: Any) -> None:
    """Put the draft group that `engine.start_draft_group()` started into the step; call between steps. The
    draft's KV starts empty: each request's draft progress restarts at 0."""
    engine.attach_draft(spec)


class RecoveryHost(Protocol):
    """What recovery and draft moves (serving/router/draft_moves.py) use of the router they serve: its engine, taken
    between two steps, and its publishing and gauges."""

    engine: Any

    def _between_steps(self) -> AbstractAsyncContextManager[None]: ...

    def _publish_now(self, touched: list[Any]) -> None: ...

    def _update_queue_and_kv(self) -> None: ...

    def _use_engine(self, engine: Any) -> None: ...


class EngineRecovery:
    """The router's recovery: whether it is unavailable (a model worker died) or serves without its draft, and the
    background tasks that rebuild the worker groups or put a new draft group back."""

    def __init__(self, router: RecoveryHost, engine_builder: str, engine_args: dict[str, Any],
                 continue_without_draft: bool) -> None:
        self._router = router
        self.engine_builder = engine_builder
        self.engine_args = engine_args
        self.continue_without_draft = continue_without_draft
        self.unhealthy: str | None = None  # why the engine cannot step, while it cannot
        self.degraded: str | None = None  # why speculation is off (the draft group died), while it is
        self.task: asyncio.Task | None = None  # rebuilding workers: keeps a reference so it is not collected

    def running(self) -> bool:
        """A rebuild or a new draft group is under way."""
        return self.task is not None and not self.task.done()

    def recovering(self) -> bool:
        """The engine is unavailable, or a recovery is under way."""
        return self.unhealthy is not None or self.running()

    def declare_dead(self, error: Exception) -> None:
        """A model worker died (serving.workers.health.WorkerDiedError): this engine cannot step again. Say so
        (/health 503, new requests 503), then rebuild the worker groups in the background; should that fail,
        end this actor so that Serve's controller creates a new router, which builds new workers."""
        if self.serve_without_draft(error):
            return
        if self.unhealthy is None:
            self.unhealthy = f"a model worker died: {error}"
            self.task = asyncio.get_running_loop().create_task(self._rebuild_engine())

    def serve_without_draft(self, error: Exception) -> bool:
        """With `continue_without_draft`, a dead draft rank only switches speculation off: the target's state is
        intact (the failed step committed nothing), so the requests in flight go on, token for token as they
        would have (speculation is lossless). A new draft group is attached in the background."""
        router = self._router
        if not (self.continue_without_draft and getattr(error, "role", None) == "draft"
                and router.engine.spec_config is not None and self.unhealthy is None):
            return False
        try:
            router._publish_now(settle_steps_in_flight(router.engine))
            spec = detach_draft(router.engine)
        except Exception as e:  # noqa: BLE001 - e.g. a target rank died too: the whole engine is rebuilt
            logger.error("could not go on without the draft (%s); rebuilding the engine", e)
            return False
        self.degraded = f"speculation is off: {error}"
        logger.warning("the draft group died; serving on the target alone while a new one starts: %s", error)
        router._update_queue_and_kv()
        self.task = asyncio.get_running_loop().create_task(self._reattach_draft(router.engine, spec))
        return True

    async def _rebuild_engine(self) -> None:
        router = self._router
        old = router.engine
        try:
            await asyncio.to_thread(old.shutdown)  # frees the dead group's placement (its GPUs)
            logger.warning("router: rebuilding the engine's worker groups after: %s", self.unhealthy)
            engine = await asyncio.to_thread(import_builder(self.engine_builder), **self.engine_args)
        except Exception:  # noqa: BLE001 - e.g. no resources: let Serve replace the whole router
            logger.exception("router: rebuilding the engine failed")
            await self._exit_soon(0.0)
            return
        async with router._between_steps():
            router._use_engine(engine)
            self.unhealthy = None
            self.degraded = None
            router._update_queue_and_kv()
        logger.warning("router: the engine is serving again with new worker groups")

    async def _reattach_draft(self, engine: Any, spec: Any) -> None:
        """Start a new draft group next to the running target and attach it between steps; retry with backoff."""
        router = self._router
        delay = 1.0
        while router.engine is engine and self.unhealthy is None:
            try:
                await asyncio.to_thread(engine.start_draft_group)  # loads the draft; steps go on
                async with router._between_steps():
                    if router.engine is not engine or self.unhealthy is not None:
                        # The whole engine died meanwhile: release what was just started with the rest of it.
                        await asyncio.to_thread(engine.shutdown)
                        return
                    # The graph is rebuilt around the new draft: let the steps in flight land first.
                    router._publish_now(engine.flush())
                    attach_draft(engine, spec)
                    self.degraded = None
                    router._update_queue_and_kv()
                logger.warning("router: a new draft group is attached; speculation is back on")
                return
            except Exception:  # noqa: BLE001 - keep serving without speculation, and try again later
                logger.exception("router: attaching a new draft group failed; retrying in %.0f s", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)

    async def _exit_soon(self, delay_s: float = 1.0) -> None:
        await asyncio.sleep(delay_s)
        logger.error("router exiting so that Serve replaces it: %s", self.unhealthy)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
