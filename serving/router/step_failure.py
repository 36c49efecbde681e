"""Which requests a failed engine step fails, and how (the router's step loop, serving/router/router.py).

A step can fail for some requests only: the engine ends (aborts) the requests it cannot go on with, and those are
the culprits, failed with a 500. A step that fails for a reason pinned on no request, or because a model worker
died, fails every request in flight; a dead worker's with a 503 that says so and asks the client to retry
(the router then recovers: serving/router/recovery.py). Requests still queued for admission never reached the
engine: the failed step cannot be theirs, but when every request fails they go too, before any reaches the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    from serving.router.admission_queue import AdmissionQueue
    from serving.router.request_stream import RequestStream

logger = logging.getLogger("specserve")


def worker_died(error: Exception) -> bool:
    """Whether a step failed because a model worker died (Ray's actor error, or serving.workers.health's)."""
    return isinstance(error, ray.exceptions.RayActorError) or type(error).__name__ == "WorkerDiedError"


def fail_step_requests(error: Exception, dead: bool, streams: Iterable[RequestStream], engine: Any,
                       admission: AdmissionQueue, metrics: Any) -> None:
    """Fail the requests of `streams` that the failed step's `error` belongs to; if it cannot be pinned on some (or
    `dead`: a model worker died), fail them all, aborting them in the engine and emptying the admission queue."""
    streams = list(streams)
    # The engine's own culprits: requests it ended (aborted) in the failed step, which no step published.
    # Requests still queued for admission never reached the engine: the failed step cannot be theirs.
    culprits = [s for s in streams
                if s.finish_reason is None and not engine.has_request(s.request.request_id)
                and not admission.holds(s.request.request_id)]
    if culprits and not dead:
        logger.warning("engine step failed for %d request(s): %s", len(culprits), error)
    else:
        logger.error("engine step failed; failing every request in flight", exc_info=error)
        admission.take_all()  # their streams are failed below with the rest: none may reach the engine
        culprits = [s for s in streams if s.finish_reason is None]
        for s in culprits:
            try:
                engine.abort_request(s.request.request_id)
            except Exception:  # noqa: BLE001 - the state is suspect; the streams still get their error
                logger.exception("aborting %s after a failed step", s.request.request_id)
    for s in culprits:
        what = "a model worker died" if dead else "the engine failed"
        s.error = (f"{what}: {error}; the request was aborted" + (", retry shortly" if dead else ""),
                   503 if dead else 500)
        s.finish_reason = "abort"
        metrics.on_finished("abort", 0.0)
        s.event.set()
