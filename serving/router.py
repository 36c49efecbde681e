"""The router: a Ray async actor that owns one EngineCore, drives its step loop and streams token deltas.

Every request of an application goes through one router (Serve replicas are thin HTTP/gRPC shims that
tokenize and format), so all requests share one continuous batch and one KV cache per model. The step
loop runs only while there is work; each blocking `engine.step()` runs in a thread so the actor keeps
answering health checks, metric scrapes, new requests and aborts meanwhile.

Engine state is touched only under `_lock`: the loop holds it for a step, `add`/`abort` take it between
steps (asyncio.Lock hands it to waiters first, so a steady stream of steps cannot starve them). Token
deltas are snapshotted under the lock too, so a stream never reads a request a running step is writing.

This module is pickled by value into the Serve controller (deployment-scoped actor), so engine imports
stay inside functions: the controller must not import torch just to create the actor.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import ray

logger = logging.getLogger("specserve")

# The engine the router drives: target and draft on Ray worker actors (each tensor-parallel, on its own
# placement group), stepped through a compiled graph. "serving.router:build_local_engine" runs both models
# inside the router's own process instead (no worker actors; tensor_parallel_size 1 only).
DEFAULT_ENGINE_BUILDER = "serving.engine_factory:build_ray_engine"
LOCAL_ENGINE_BUILDER = "serving.router:build_local_engine"


def build_local_engine(**engine_args: Any) -> Any:
    """Target (and draft) in the router's own process, through the offline LLM's construction."""
    from engine.llm import LLM

    return LLM(**engine_args).engine


def _import_builder(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"engine builder must look like 'package.module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)


@dataclass
class _Stream:
    """One request's published state: what the last step left, and what the caller has already seen."""

    request: Any  # engine.request.Request (read only under the router's lock)
    arrival: float
    holdback: int  # chars of text withheld while running: a stop string may still cut them off
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending_tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: tuple[str, int] | None = None  # (message, HTTP-like status)
    spec: dict[str, Any] = field(default_factory=lambda: {"num_drafts": 0, "num_draft_tokens": 0,
                                                          "num_accepted_tokens": 0, "accepted_per_position": []})
    num_published: int = 0  # output tokens already moved to pending_tokens
    sent_text: int = 0  # chars of text already yielded
    first_token_time: float | None = None
    last_token_time: float | None = None

    def take_delta(self) -> dict[str, Any]:
        done = self.finish_reason is not None
        end = len(self.text) if done else max(self.sent_text, len(self.text) - self.holdback)
        text = self.text[self.sent_text:end]
        self.sent_text = max(self.sent_text, end)
        tokens, self.pending_tokens = self.pending_tokens, []
        return {"request_id": self.request.request_id, "token_ids": tokens, "text": text,
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
                "num_prompt_tokens": self.request.num_prompt_tokens, "num_completion_tokens": self.num_published,
                "spec": dict(self.spec, accepted_per_position=list(self.spec["accepted_per_position"]))}


@ray.remote
class Router:
    """Owns one EngineCore. `engine_args` go to the builder (LLM's arguments for the local engine)."""

    def __init__(self, engine_args: dict[str, Any], engine_builder: str = DEFAULT_ENGINE_BUILDER,
                 model_name: str | None = None) -> None:
        from serving.metrics import EngineMetrics

        device = str(engine_args.get("device") or "")
        if not device.startswith("cuda"):
            import torch

            if device == "cpu" or not torch.cuda.is_available():
                # One thread: the replica, Ray's workers and other actors share the cores; oversubscribed
                # intra-op threads slow every step down.
                torch.set_num_threads(int(os.environ.get("SPECSERVE_TORCH_THREADS", "1")))
        self.engine_args = dict(engine_args)
        self.model_name = model_name or str(engine_args.get("model"))
        logger.info("router: building the engine with %s(%s)", engine_builder, engine_args)
        self.engine = _import_builder(engine_builder)(**engine_args)
        self.metrics = EngineMetrics()
        self._lock = asyncio.Lock()
        self._streams: dict[str, _Stream] = {}
        self._loop_task: asyncio.Task | None = None
        self._unhealthy: str | None = None
        self.metrics.set_queue(0, 0)
        self._update_kv_gauges()

    # --- public methods -------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream deltas: new token ids and text, finish_reason on the last one, token counts, spec stats.

        Invalid input yields one `{"error": message, "status": 400}` instead of raising, so the caller
        gets a plain message rather than a wrapped RayTaskError. Closing the stream early aborts the request.
        """
        try:
            stream = await self._add(request_id, prompt_token_ids, params)
        except (ValueError, TypeError) as e:
            yield {"error": str(e), "status": 400}
            return
        except RuntimeError as e:
            yield {"error": str(e), "status": 503}
            return
        finished = False
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    finished = True
                    yield {"error": stream.error[0], "status": stream.error[1]}
                    return
                delta = stream.take_delta()
                finished = delta["finish_reason"] is not None
                if delta["token_ids"] or delta["text"] or finished:
                    yield delta
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the caller went away (client disconnect): free the KV blocks now
                asyncio.get_running_loop().create_task(self.abort(request_id))

    async def abort(self, request_id: str) -> bool:
        async with self._lock:
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
        that died while the engine was idle is found by the next probe, not by the next request."""
        check = getattr(self.engine.executor, "check_health", None)
        if self._unhealthy is None and check is not None:
            async with self._lock:
                try:
                    await asyncio.to_thread(check, 10.0)
                except Exception as e:  # noqa: BLE001 - WorkerDiedError: a rank is dead or hung
                    self._declare_dead(e)
        return {"healthy": self._unhealthy is None, "reason": self._unhealthy,
                "num_running": len(self.engine.scheduler.running), "num_waiting": len(self.engine.scheduler.waiting)}

    async def metrics_text(self) -> str:
        return self.metrics.exposition()

    async def info(self) -> dict[str, Any]:
        spec = self.engine.spec_config
        return {"model": self.model_name, "max_model_len": self.engine.config.max_model_len,
                "vocab_size": self.engine.vocab_size, "draft_model": spec.draft_model if spec else None,
                "num_speculative_tokens": spec.num_speculative_tokens if spec else 0,
                "rejection_sampling": spec.rejection_sampling if spec else None}

    async def stats(self) -> dict[str, Any]:
        sched = self.engine.scheduler
        return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "num_streams": len(self._streams), "kv_cache_usage": {f"{m}/{g}": u for (m, g), u in
                                                                       self._kv_usage().items()},
                "healthy": self._unhealthy is None, **await self.info()}

    # --- requests -------------------------------------------------------------------------------------
    async def _add(self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any]) -> _Stream:
        from engine.request import Request, SamplingParams

        if self._unhealthy is not None:
            raise RuntimeError(f"the engine is unavailable: {self._unhealthy}")
        sp = SamplingParams(**params)  # validates; TypeError for an unknown field
        if any(not isinstance(t, int) or isinstance(t, bool) for t in prompt_token_ids):
            raise ValueError("prompt token ids must be integers")
        req = Request(request_id, list(prompt_token_ids), sp)
        holdback = max((len(s) for s in sp.stop), default=1) - 1
        stream = _Stream(request=req, arrival=time.perf_counter(), holdback=holdback)
        async with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.engine.add_request(req)  # raises ValueError before changing anything
            self._streams[request_id] = stream
            self.metrics.set_queue(len(self.engine.scheduler.running), len(self.engine.scheduler.waiting))
            if self._loop_task is None or self._loop_task.done():
                self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())
        return stream

    # --- the step loop --------------------------------------------------------------------------------
    async def _run_loop(self) -> None:
        while True:
            async with self._lock:
                if not self.engine.has_unfinished():
                    self._loop_task = None  # under the lock: `_add` starts a new loop if work arrives now
                    return
                try:
                    touched = await asyncio.to_thread(self.engine.step)
                    self._publish(touched, time.perf_counter())
                except Exception as e:  # noqa: BLE001 - any engine failure is reported to its requests
                    self._on_step_error(e)

    def _publish(self, touched: list[Any], now: float) -> None:
        """Move what the step produced into the streams, and into the metrics."""
        drafts = draft_tokens = 0
        for req in touched:
            s = self._streams.get(req.request_id)
            if s is None:
                continue
            new = req.output_token_ids[s.num_published:]
            s.num_published += len(new)
            s.pending_tokens.extend(new)
            s.text = req.output_text
            if new:
                if s.first_token_time is None:
                    s.first_token_time = now
                    self.metrics.on_first_token(req.num_prompt_tokens, now - s.arrival)
                    self.metrics.on_tokens(len(new), None)
                else:
                    self.metrics.on_tokens(len(new), now - (s.last_token_time or now))
                s.last_token_time = now
            d, dt, acc, per_pos = self._spec_increment(s, req.spec)
            drafts, draft_tokens = drafts + d, draft_tokens + dt
            self.metrics.on_spec(d, dt, acc, per_pos)
            if req.status.finished:
                s.finish_reason = req.finish_reason or req.status.value
                s.stop_reason = req.stop_reason
                self.metrics.on_finished(s.finish_reason, now - s.arrival)
            s.event.set()
        stats = self.engine.last_step
        self.metrics.on_step(stats.phase_seconds, len(self.engine.scheduler.running),
                             len(self.engine.scheduler.waiting), stats.num_preempted, self._kv_usage(),
                             draft_tokens / drafts if drafts else None)

    @staticmethod
    def _spec_increment(s: _Stream, spec: Any) -> tuple[int, int, int, list[int]]:
        old = s.spec
        per_pos = list(spec.accepted_per_position)
        old_pos = old["accepted_per_position"] + [0] * (len(per_pos) - len(old["accepted_per_position"]))
        inc = (spec.num_drafts - old["num_drafts"], spec.num_draft_tokens - old["num_draft_tokens"],
               spec.num_accepted_tokens - old["num_accepted_tokens"], [a - b for a, b in zip(per_pos, old_pos)])
        s.spec = {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
                  "num_accepted_tokens": spec.num_accepted_tokens, "accepted_per_position": per_pos}
        return inc

    def _on_step_error(self, error: Exception) -> None:
        """Fail the requests the error belongs to; if it cannot be pinned on some, fail them all."""
        culprits = [s for s in self._streams.values() if s.request.status.finished and s.finish_reason is None]
        dead = isinstance(error, ray.exceptions.RayActorError) or type(error).__name__ == "WorkerDiedError"
        if culprits and not dead:
            logger.warning("engine step failed for %d request(s): %s", len(culprits), error)
        else:
            logger.error("engine step failed; failing every request in flight", exc_info=error)
            culprits = [s for s in self._streams.values() if s.finish_reason is None]
            for s in culprits:
                try:
                    self.engine.abort_request(s.request.request_id)
                except Exception:  # noqa: BLE001 - the state is suspect; the streams still get their error
                    logger.exception("aborting %s after a failed step", s.request.request_id)
        for s in culprits:
            s.error = (f"the engine failed: {error}", 503 if dead else 500)
            s.finish_reason = "abort"
            self.metrics.on_finished("abort", 0.0)
            s.event.set()
        self._update_queue_and_kv()
        if dead:
            self._declare_dead(error)

    def _declare_dead(self, error: Exception) -> None:
        """A model worker died (serving.ray_executor.WorkerDiedError): this engine cannot step again. Say so
        (/health 503, new requests 503), let the streams deliver their errors, then end this actor: Serve's
        controller sees the deployment actor die and creates a new router, which builds new workers."""
        if self._unhealthy is None:
            self._unhealthy = f"a model worker died: {error}"
            asyncio.get_running_loop().create_task(self._exit_soon())

    async def _exit_soon(self, delay_s: float = 1.0) -> None:
        await asyncio.sleep(delay_s)
        logger.error("router exiting so that Serve replaces it: %s", self._unhealthy)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # --- gauges ---------------------------------------------------------------------------------------
    def _kv_usage(self) -> dict[tuple[str, int], float]:
        usage = {}
        for model, kv in (("target", self.engine.target_kv), ("draft", self.engine.draft_kv)):
            if kv is not None:
                for g in range(kv.num_groups):
                    usage[(model, g)] = kv.usage(g)
        return usage

    def _update_kv_gauges(self) -> None:
        for (model, group), usage in self._kv_usage().items():
            self.metrics.kv_usage.labels(model=model, kv_group=str(group)).set(usage)

    def _update_queue_and_kv(self) -> None:
        self.metrics.set_queue(len(self.engine.scheduler.running), len(self.engine.scheduler.waiting))
        self._update_kv_gauges()
