"""A router's recovery from a dead model worker, and serving on the target alone while the draft group is down.

A step that fails because a model worker died (serving.workers.health.WorkerDiedError, or Ray's actor error)
fails the requests in flight with a 503 that says so, marks the router unavailable (/health 503, new requests 503)
and rebuilds its worker groups in the background; should that fail, the router's actor ends so that Serve's controller
creates a new router, which builds new workers. `EngineRecovery` holds these steps; the Router (serving/router/router.py)
inherits it and calls `_on_step_error` and `_declare_dead` while it holds the engine; the background tasks take the
engine between steps themselves.

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
from typing import TYPE_CHECKING, Any

import ray

from serving.engine_builders import import_builder

if TYPE_CHECKING:
    from serving.metrics import EngineMetrics
    from serving.router.admission_queue import AdmissionQueue
    from serving.router.request_stream import RequestStream

logger = logging.getLogger("specserve")


def detach_draft(engine: Any) -> Any:
    """Switch `engine` (an EngineCore on a RayExecutor) to target-only steps; returns its SpeculativeConfig,
    for `attach_draft`. Raises if the executor cannot (a target rank is dead too)."""
    return engine.detach_draft()


def attach_draft(engine: Any, spec: Any) -> None:
    """Put the draft group that `engine.start_draft_group()` started into the step; call between steps. The
    draft's KV starts empty: each request's draft progress restarts at 0."""
    engine.attach_draft(spec)


class EngineRecovery:
    """The router's side of recovery: what a failed step does to the requests in flight, and the background tasks
    that rebuild the worker groups or put a new draft group back. A mixin of the Router: it uses the router's
    state below, and its `_between_steps`, `_publish_now` and `_update_queue_and_kv`."""

    engine: Any
    engine_args: dict[str, Any]
    engine_builder: str
    continue_without_draft: bool
    metrics: EngineMetrics
    _streams: dict[str, RequestStream]
    _admission: AdmissionQueue
    _unhealthy: str | None
    _degraded: str | None
    _recovery: asyncio.Task | None  # rebuilding workers: keeps a reference so it is not collected

    def _on_step_error(self, error: Exception) -> None:
        """Fail the requests the error belongs to; if it cannot be pinned on some, fail them all. A dead draft
        worker with `continue_without_draft` fails none: the engine goes on without speculation."""
        dead = isinstance(error, ray.exceptions.RayActorError) or type(error).__name__ == "WorkerDiedError"
        if dead and self._serve_without_draft(error):
            return
        # The engine's own culprits: requests it ended (aborted) in the failed step, which no step published.
        # Requests still queued for admission never reached the engine: the failed step cannot be theirs.
        culprits = [s for s in self._streams.values()
                    if s.finish_reason is None and not self.engine.has_request(s.request.request_id)
                    and not self._admission.holds(s.request.request_id)]
        if culprits and not dead:
            logger.warning("engine step failed for %d request(s): %s", len(culprits), error)
        else:
            logger.error("engine step failed; failing every request in flight", exc_info=error)
            self._admission.take_all()  # their streams are failed below with the rest: none may reach the engine
            culprits = [s for s in self._streams.values() if s.finish_reason is None]
            for s in culprits:
                try:
                    self.engine.abort_request(s.request.request_id)
                except Exception:  # noqa: BLE001 - the state is suspect; the streams still get their error
                    logger.exception("aborting %s after a failed step", s.request.request_id)
        for s in culprits:
            what = "a model worker died" if dead else "the engine failed"
            s.error = (f"{what}: {error}; the request was aborted" + (", retry shortly" if dead else ""),
                       503 if dead else 500)
            s.finish_reason = "abort"
            self.metrics.on_finished("abort", 0.0)
            s.event.set()
        self._update_queue_and_kv()
        if dead:
            self._declare_dead(error)

    def _declare_dead(self, error: Exception) -> None:
        """A model worker died (serving.workers.health.WorkerDiedError): this engine cannot step again. Say so
        (/health 503, new requests 503), then rebuild the worker groups in the background; should that fail,
        end this actor so that Serve's controller creates a new router, which builds new workers."""
        if self._serve_without_draft(error):
            return
        if self._unhealthy is None:
            self._unhealthy = f"a model worker died: {error}"
            self._recovery = asyncio.get_running_loop().create_task(self._rebuild_engine())

    def _serve_without_draft(self, error: Exception) -> bool:
        """With `continue_without_draft`, a dead draft rank only switches speculation off: the target's state is
        intact (the failed step committed nothing), so the requests in flight go on, token for token as they
        would have (speculation is lossless). A new draft group is attached in the background."""
        if not (self.continue_without_draft and getattr(error, "role", None) == "draft"
                and self.engine.spec_config is not None and self._unhealthy is None):
            return False
        try:
            spec = detach_draft(self.engine)
        except Exception as e:  # noqa: BLE001 - e.g. a target rank died too: the whole engine is rebuilt
            logger.error("could not go on without the draft (%s); rebuilding the engine", e)
            return False
        self._degraded = f"speculation is off: {error}"
        logger.warning("the draft group died; serving on the target alone while a new one starts: %s", error)
        self._update_queue_and_kv()
        self._recovery = asyncio.get_running_loop().create_task(self._reattach_draft(self.engine, spec))
        return True

    async def _rebuild_engine(self) -> None:
        old = self.engine
        try:
            await asyncio.to_thread(old.shutdown)  # frees the dead group's placement (its GPUs)
            logger.warning("router: rebuilding the engine's worker groups after: %s", self._unhealthy)
            engine = await asyncio.to_thread(import_builder(self.engine_builder), **self.engine_args)
        except Exception:  # noqa: BLE001 - e.g. no resources: let Serve replace the whole router
            logger.exception("router: rebuilding the engine failed")
            await self._exit_soon(0.0)
            return
        async with self._between_steps():
            self.engine = engine
            self._unhealthy = None
            self._degraded = None
            self._update_queue_and_kv()
        logger.warning("router: the engine is serving again with new worker groups")

    async def _reattach_draft(self, engine: Any, spec: Any) -> None:
        """Start a new draft group next to the running target and attach it between steps; retry with backoff."""
        delay = 1.0
        while self.engine is engine and self._unhealthy is None:
            try:
                await asyncio.to_thread(engine.start_draft_group)  # loads the draft; steps go on
                async with self._between_steps():
                    if self.engine is not engine or self._unhealthy is not None:
                        # The whole engine died meanwhile: release what was just started with the rest of it.
                        await asyncio.to_thread(engine.shutdown)
                        return
                    # The graph is rebuilt around the new draft: let the steps in flight land first.
                    self._publish_now(engine.flush())
                    attach_draft(engine, spec)
                    self._degraded = None
                    self._update_queue_and_kv()
                logger.warning("router: a new draft group is attached; speculation is back on")
                return
            except Exception:  # noqa: BLE001 - keep serving without speculation, and try again later
                logger.exception("router: attaching a new draft group failed; retrying in %.0f s", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)

    async def _exit_soon(self, delay_s: float = 1.0) -> None:
        await asyncio.sleep(delay_s)
        logger.error("router exiting so that Serve replaces it: %s", self._unhealthy)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
