"""The router: owns one EngineCore, drives its step loop and streams token deltas (an async Ray actor).

One router is one engine: one continuous batch and one KV cache per model. In the Serve application every
engine replica is a router (serving/engine_deployment.py subclasses it), and the HTTP/gRPC shims route each
request to one of them; `RouterActor` is the same class as a plain Ray actor. The step loop runs only while
there is work; each blocking `engine.step()` runs in a thread so the actor keeps answering health checks,
metric scrapes, new requests and aborts meanwhile.

Engine state is touched only under `_lock`. The loop holds it while a step thread runs steps back to back;
`abort`/health checks/recovery ask for it through `_between_steps`, which makes the step thread stop at the
end of its step and hand the lock over (asyncio.Lock serves waiters first, so steps cannot starve them). A new
request does not: it is validated and queued (serving/router/admission_queue.py), and the step thread admits every
queued arrival before its next step, so a wave of arrivals is one prefill and no step is cut short for one. The
step thread copies each step's token deltas before the next step runs and the event loop publishes the copies,
so a stream never reads a request that a running step is writing.

Reliability: the waiting queue is bounded (past `max_queued_requests` a request is refused with 429 and a retry hint
instead of growing memory); a dead model worker fails the requests in flight with a 503 that says so (which requests
a failed step fails: serving/router/step_failure.py), and the router rebuilds its worker groups in place (or, with
`continue_without_draft`, drops a dead draft group and serves on the target alone until a new draft group is
attached): serving/router/recovery.py, whose `EngineRecovery` the Router holds, as it holds the watch of a draft
pool's placement (serving/router/draft_moves.py); `drain()` refuses new requests and waits for those in flight, for
shutdown. What the router reports of its engine (its summary line, info, metrics pulled at scrape time):
serving/router/engine_report.py.

Engine imports stay inside functions: a process that only names the class (the ingress, Serve's controller)
must not import torch for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import ray

from engine.gc_heap import freeze_startup_heap
from serving.engine_builders import DEFAULT_ENGINE_BUILDER, import_builder
from serving.router.admission_queue import AdmissionQueue
from serving.router.draft_moves import DraftMoves
from serving.router.engine_report import engine_info, engine_summary, engine_weights, scraped_metrics
from serving.router.recovery import EngineRecovery
from serving.router.step_failure import fail_step_requests, worker_died
from serving.serving_defaults import DRAIN_TIMEOUT_S
from serving.workers.node_placement import GroupNodes

if TYPE_CHECKING:
    from serving.router.request_stream import RequestStream

logger = logging.getLogger("specserve")


class Router:
    """Owns one EngineCore. `engine_args` go to the builder (LLM's arguments for the local engine)."""

    FREEZE_HEAP_AT_INIT = True  # engine.gc_heap: freeze the startup heap at the end of __init__

    def __init__(self, engine_args: dict[str, Any], engine_builder: str = DEFAULT_ENGINE_BUILDER,
                 model_name: str | None = None, max_queued_requests: int | None = None,
                 continue_without_draft: bool = False, stream_interval_ms: float = 0.0) -> None:
        """max_queued_requests: requests that may wait for a batch slot; more are refused with 429 (None: no
        bound). continue_without_draft: when the draft's workers die, serve on the target alone (lossless,
        slower) and attach a rebuilt draft group, instead of failing the requests in flight.
        stream_interval_ms: after a stream's first delta, yield at most one delta per this many ms, the tokens of
        the steps between merged into it (the final delta and errors at once); 0: one a step."""
        from serving.metrics import EngineMetrics
        from serving.thread_switch import set_gil_switch_interval

        # The step thread waits on the workers with the interpreter lock released while the event loop streams
        # the last step's tokens; at Python's 5 ms interval the loop could keep it waiting for the lock that long.
        set_gil_switch_interval()
        device = str(engine_args.get("device") or "")
        if not device.startswith("cuda"):
            import torch

            if device == "cpu" or not torch.cuda.is_available():
                # One thread: the replica, Ray's workers and other actors share the cores; oversubscribed
                # intra-op threads slow every step down.
                torch.set_num_threads(int(os.environ.get("SPECSERVE_TORCH_THREADS", "1")))
        self.engine_args = dict(engine_args)
        self.model_name = model_name or str(engine_args.get("model"))
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0 (or None: no bound), got {max_queued_requests}")
        self.max_queued_requests = max_queued_requests
        if stream_interval_ms < 0:
            raise ValueError(f"stream_interval_ms must be >= 0, got {stream_interval_ms}")
        self.stream_interval_s = stream_interval_ms / 1e3
        logger.info("router: building the engine with %s(%s)", engine_builder, engine_args)
        self.engine = import_builder(engine_builder)(**engine_args)
        self.metrics = EngineMetrics()
        self._lock = asyncio.Lock()
        self._lock_waiters = 0  # coroutines waiting for `_lock`: the step thread yields the engine to them
        self._streams: dict[str, RequestStream] = {}
        self._admission = AdmissionQueue()
        self._loop_task: asyncio.Task | None = None
        self._draining = False
        # A dead worker's recovery (whether the engine is unavailable or serves without its draft), and the watch of
        # a draft pool's placement that moves this engine between the pool's replicas.
        self.recovery = EngineRecovery(self, engine_builder, self.engine_args, continue_without_draft)
        self.draft_moves = DraftMoves(self, self.recovery.recovering)
        self._group_nodes = GroupNodes()  # the Ray node of each worker rank, for the metrics
        self.metrics.set_queue(0, 0)
        self._update_kv_gauges()
        print(f"specserve: engine replica ready: {self.summary()}", flush=True)  # one line a replica in the log
        # The engine built, its workers up. A subclass that builds more at start (the engine ingress: a tokenizer
        # and an HTTP app) freezes once, when it is done, instead: each freeze is a full collection.
        self.gc_frozen = freeze_startup_heap(f"router of {self.model_name}") if self.FREEZE_HEAP_AT_INIT else 0

    def summary(self) -> str:
        """What this replica serves, in a line: models, speculation, device, context and KV blocks
        (serving/router/engine_report.py)."""
        return engine_summary(self.engine, self.engine_args.get("model"), self.weights())

    def weights(self) -> dict[str, dict[str, Any] | None]:
        """What each model's weights hold (a tensor-parallel model's: each rank's), {"bytes", "format"}; None
        where an engine builder's executor does not say."""
        return engine_weights(self.engine)

    # --- public methods -------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream deltas: new token ids and text, finish_reason on the last one, token counts, spec stats.

        Invalid input yields one `{"error": message, "status": 400}` instead of raising, so the caller
        gets a plain message rather than a wrapped RayTaskError. Closing the stream early aborts the request.
        """
        from serving.router.request_stream import Rejected

        try:
            stream = await self._add(request_id, prompt_token_ids, params)
        except (ValueError, TypeError) as e:
            yield {"error": str(e), "status": 400}
            return
        except Rejected as e:
            yield {"error": str(e), "status": e.status, "retry_after": e.retry_after_s}
            return
        except RuntimeError as e:
            yield {"error": str(e), "status": 503}
            return
        try:
            async with contextlib.aclosing(stream.deltas(self.stream_interval_s)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            self._streams.pop(request_id, None)
            if not stream.ended:  # the caller went away (client disconnect): free the KV blocks now
                asyncio.get_running_loop().create_task(self.abort(request_id))

    async def abort(self, request_id: str) -> bool:
        queued = self._admission.remove(request_id)
        if queued is not None:  # never reached the engine: nothing to free
            self._end_queued(queued[1], "abort")
            return True
        async with self._between_steps():
            req = self.engine.abort_request(request_id)
            stream = self._streams.get(request_id)
            if req is not None:
                self.metrics.on_finished("abort", 0.0)
                self._update_queue_and_kv()
            if stream is not None and stream.finish_reason is None:
                stream.finish_reason = "abort"
                stream.event.set()
        return req is not None

    async def health(self) -> dict[str, Any]:
        """Healthy unless the engine is broken. With worker actors, ping them too (between steps), so a worker
        that died while the engine was idle is found by the next probe, not by the next request. Serve probes
        every replica: this also starts the watch of a draft pool's placement (serving/router/draft_moves.py)."""
        self.draft_moves.ensure()
        if self.recovery.unhealthy is None:
            async with self._between_steps():
                try:
                    await asyncio.to_thread(self.engine.check_health, 10.0)
                except Exception as e:  # noqa: BLE001 - WorkerDiedError: a rank is dead or hung
                    self.recovery.declare_dead(e)
        return {"healthy": self.recovery.unhealthy is None, "reason": self.recovery.unhealthy,
                "draining": self._draining, "recovering": self.recovery.running(),
                "speculation": self.engine.spec_config is not None, "degraded": self.recovery.degraded,
                "num_running": self.engine.num_running(),
                "num_waiting": self._num_waiting(), "weights": self.weights()}

    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> dict[str, Any]:
        """For shutdown: refuse new requests (503) from now on and wait up to `timeout_s` for the ones in flight
        to finish. Returns whether they all did and how many are left."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return {"drained": not self._streams, "num_in_flight": len(self._streams)}

    async def metrics_text(self) -> str:
        """The metrics' exposition, the engine's running totals brought up first (serving/router/engine_report.py)."""
        return await scraped_metrics(self.metrics, self.engine, self._group_nodes)

    async def info(self) -> dict[str, Any]:
        return engine_info(self.engine, self.model_name)

    async def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "num_streams": len(self._streams), "healthy": self.recovery.unhealthy is None,
                "draining": self._draining, "degraded": self.recovery.degraded, "gc_frozen_objects": self.gc_frozen,
                **await self.info()}

    async def workers(self) -> list[dict[str, Any]]:
        """The model workers: role, rank and Ray actor id (hex), for operators and fault-injection tests."""
        return [{"role": role, "rank": rank, "actor_id": w._actor_id.hex()} for role, rank, w in self.engine.workers()]

    # --- requests -------------------------------------------------------------------------------------
    async def _add(self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any]) -> RequestStream:
        from engine.request import Request, SamplingParams
        from serving.router.request_stream import RETRY_AFTER_S, Rejected, RequestStream

        if self._draining:
            raise Rejected("the server is shutting down and takes no new requests; retry on another replica", 503)
        if self.recovery.unhealthy is not None:
            raise Rejected(f"the engine is unavailable: {self.recovery.unhealthy}; retry shortly", 503, RETRY_AFTER_S)
        sp = SamplingParams(**params)  # validates; TypeError for an unknown field
        if any(not isinstance(t, int) or isinstance(t, bool) for t in prompt_token_ids):
            raise ValueError("prompt token ids must be integers")
        if len(prompt_token_ids) < self.engine.config.max_model_len:  # else the engine names max_model_len
            self.engine.check_fits(len(prompt_token_ids))
        req = Request(request_id, list(prompt_token_ids), sp)
        holdback = max((len(s) for s in sp.stop), default=1) - 1
        stream = RequestStream(request=req, arrival=time.perf_counter(), holdback=holdback)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        # On the event loop while a step may be running: it reads the engine (vocabulary, ids in use, the grammar
        # cache) and changes nothing the step thread writes. The step thread validates again when it admits.
        self.engine.validate_request(req)
        waiting = self._num_waiting()
        if self.max_queued_requests is not None and waiting >= self.max_queued_requests:
            # Refuse rather than queue without bound: memory stays flat and the client backs off.
            raise Rejected(f"the server is overloaded: {waiting} requests are already waiting "
                           f"(max_queued_requests={self.max_queued_requests}); retry after "
                           f"{RETRY_AFTER_S} s", 429, RETRY_AFTER_S)
        # Queued, not added: the step thread admits every arrival of its last step before the next one
        # (serving/router/admission_queue.py), so a running step is never stopped for an arrival.
        self._admission.put(req, stream)
        self._streams[request_id] = stream
        self.metrics.set_queue(self.engine.num_running(), waiting + 1)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())
        return stream

    # --- the step loop --------------------------------------------------------------------------------
    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            async with self._lock:
                self._admit(loop)
                if not self.engine.has_unfinished():
                    self._loop_task = None  # under the lock: `_add` starts a new loop if work arrives now
                    return
                try:
                    await asyncio.to_thread(self._run_steps, loop)
                except Exception as e:  # noqa: BLE001 - any engine failure is reported to its requests
                    self._on_step_error(e)

    def _run_steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """On a thread of its own, holding the lock for the event loop: steps back to back while there is work
        and no coroutine waits for the engine (`_between_steps`). Each step's results are copied here and handed
        to the event loop once the next step's plan is on its way to the workers, so the event loop publishes
        them while this thread waits for the models: its work neither delays the next plan nor holds the
        interpreter lock while the next plan is being built. No thread hop, lock hand-over or stream wake-up
        sits between two steps."""
        engine = self.engine
        pending: tuple[Any, ...] | None = None  # the last step's copied results, not yet handed over

        def hand_over() -> None:
            nonlocal pending
            if pending is not None:
                loop.call_soon_threadsafe(self._publish, *pending)
                pending = None

        try:
            while True:
                self._admit(loop)
                touched = engine.step(on_dispatched=hand_over)
                hand_over()  # a step that dispatched nothing (none scheduled) did not hand the last one over
                now = time.perf_counter()
                deltas = [(s, s.snapshot(req)) for req in touched
                          if (s := self._streams.get(req.request_id)) is not None]
                stats = engine.last_step
                step = (stats.phase_seconds, engine.num_running(), self._num_waiting(), stats.num_preempted,
                        engine.kv_usage(), stats.draft_length, engine.spec_config is not None)
                pending = (deltas, step, now)
                if self._lock_waiters or not (engine.has_unfinished() or len(self._admission)):
                    return
        finally:
            hand_over()  # the last step's, and one before a failed step's dispatch

    def _admit(self, loop: asyncio.AbstractEventLoop) -> None:
        """Move the queued arrivals into the engine, holding it (on the step thread, or under the lock). A request
        the engine will not take is answered on its own; the others are admitted all the same."""
        for req, stream in self._admission.take_all():
            try:
                self.engine.add_request(req)
            except ValueError as e:  # what validation on arrival could not see (an id taken meanwhile, say)
                loop.call_soon_threadsafe(self._refuse, stream, str(e), 400)
            except Exception as e:  # noqa: BLE001 - the engine's fault, not the request's: it must still be answered
                logger.exception("admitting %s failed", req.request_id)
                loop.call_soon_threadsafe(self._refuse, stream, f"the engine could not admit the request: {e}", 500)

    def _on_step_error(self, error: Exception) -> None:
        """Fail the requests the error belongs to; if it cannot be pinned on some, fail them all. A dead draft
        worker with `continue_without_draft` fails none: the engine goes on without speculation
        (serving/router/step_failure.py)."""
        dead = worker_died(error)
        if dead and self.recovery.serve_without_draft(error):
            return
        fail_step_requests(error, dead, self._streams.values(), self.engine, self._admission, self.metrics)
        self._update_queue_and_kv()
        if dead:
            self.recovery.declare_dead(error)

    def _use_engine(self, engine: Any) -> None:
        """Drive `engine` from now on (a rebuilt one, serving/router/recovery.py); call between steps."""
        self.engine = engine

    def _refuse(self, stream: RequestStream, message: str, status: int) -> None:
        stream.error = (message, status)
        stream.event.set()

    def _end_queued(self, stream: RequestStream, reason: str) -> None:
        """End a request that was accepted but never reached the engine (on the event loop)."""
        if stream.finish_reason is None:
            stream.finish_reason = reason
            self.metrics.on_finished(reason, 0.0)
            self._update_queue_and_kv()
            stream.event.set()

    def _num_waiting(self) -> int:
        """Requests waiting for a batch slot: the engine's queue and the arrivals not admitted yet."""
        return self.engine.num_waiting() + len(self._admission)

    def _publish_now(self, touched: list[Any]) -> None:
        """Publish what steps collected outside the step thread gave their requests (on the event loop)."""
        now = time.perf_counter()
        for req in touched:
            stream = self._streams.get(req.request_id)
            if stream is not None:
                stream.publish(stream.snapshot(req), now, self.metrics)

    def _publish(self, deltas: list[tuple[RequestStream, Any]], step: tuple[Any, ...], now: float) -> None:
        """Move what a step produced into the streams, and into the metrics (on the event loop)."""
        for stream, delta in deltas:
            stream.publish(delta, now, self.metrics)
        self.metrics.on_step(*step)

    @contextlib.asynccontextmanager
    async def _between_steps(self) -> AsyncIterator[None]:
        """Hold the engine between two steps: the step thread stops at the end of its current step."""
        acquired = False
        self._lock_waiters += 1
        try:
            async with self._lock:
                acquired = True
                self._lock_waiters -= 1
                yield
        finally:
            if not acquired:  # cancelled while waiting: no longer a waiter
                self._lock_waiters -= 1

    # --- gauges ---------------------------------------------------------------------------------------
    def _update_kv_gauges(self) -> None:
        for (model, group), usage in self.engine.kv_usage().items():
            self.metrics.kv_usage.labels(model=model, kv_group=str(group)).set(usage)

    def _update_queue_and_kv(self) -> None:
        self.metrics.set_queue(self.engine.num_running(), self._num_waiting())
        self._update_kv_gauges()


# The router as a plain Ray actor (one engine outside Serve: tests, benchmarks, embedding).
RouterActor = ray.remote(Router)
