"""The front ends' side of the engine replicas: tokenizer, request streaming and failure mapping, for HTTP and gRPC.

An ingress replica holds one RouterClient. It turns an engine replica's delta stream into an async iterator that
raises `GenerationError` (with an HTTP-like status) for bad input, overload or a lost replica, and aborts the
request when the consumer stops early (client disconnect). Serve picks the replica of each request and routes
around replicas that died or are being replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import ray

logger = logging.getLogger("specserve")


class GenerationError(Exception):
    """A request that cannot be served. `status` follows HTTP: 4xx the client's fault, 5xx ours."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.retry_after_s = retry_after_s  # HTTP Retry-After for 429/503


# The API's own limits, stricter than the engine's (whose offline users may want more): OpenAI's temperature
# range, and sizes that keep every value a machine integer on the step path (a top_k past int64 would fail
# the whole batch's sampling step, not just the one request).
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 2**31 - 1
# Below this a temperature is greedy: 1 / T overflows float32 logits into NaN probabilities (vLLM does the same).
GREEDY_BELOW_TEMPERATURE = 1e-5
_INT64 = 2**63
# Seconds an overloaded client is told to wait (HTTP Retry-After), as the router tells it for its own queue.
_RETRY_AFTER_S = 1
# A request refused with 503 before any output is tried this many times in all, this long apart: long enough for
# Serve's request routers to learn that the refusing replica takes no requests (serving.app's stats period).
_ATTEMPTS = 2
_RETRY_DELAY_S = 2.5


def check_api_params(params: dict[str, Any]) -> dict[str, Any]:
    """Check the front ends' sampling parameters against the API's limits; raises GenerationError(400). The
    engine's SamplingParams checks the rest (ranges, types) in the router."""
    t = params.get("temperature")
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        if not math.isfinite(t) or not 0.0 <= t <= MAX_TEMPERATURE:
            raise GenerationError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {t!r}", 400,
                                  "temperature")
        if t < GREEDY_BELOW_TEMPERATURE:
            params = dict(params, temperature=0.0)
    p = params.get("top_p")
    if isinstance(p, float) and not math.isfinite(p):
        raise GenerationError(f"top_p must be in (0, 1], got {p!r}", 400, "top_p")
    k = params.get("top_k")
    if isinstance(k, int) and k > MAX_TOP_K:
        raise GenerationError(f"top_k must be at most {MAX_TOP_K} (0 disables it), got {k}", 400, "top_k")
    seed = params.get("seed")
    if isinstance(seed, int) and not -_INT64 <= seed < _INT64:
        raise GenerationError(f"seed must fit in 64 bits, got {seed}", 400, "seed")
    if any(isinstance(t, int) and not 0 <= t < _INT64 for t in params.get("stop_token_ids") or []):
        raise GenerationError("stop_token_ids must be token ids (non-negative integers below 2**63)", 400,
                              "stop_token_ids")
    return params


# Engine validation messages start with the parameter's name ("max_tokens must be ..."): report it as
# the error's `param`, as OpenAI does.
_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "prompt", "logprobs",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
           "allowed_token_ids", "bad_words", "cache_salt")
_ENGINE_NAMES = {"bad_words_token_ids": "bad_words"}  # the engine's name -> the API field it comes from


def _param_of(message: str) -> str | None:
    first = message.split(" ", 1)[0]
    first = _ENGINE_NAMES.get(first, first)
    return first if first in _PARAMS else None


class RouterClient:
    """Streams requests to the engine replicas through a Serve DeploymentHandle of their deployment
    (serving/engine_deployment.py). Serve's request router picks a replica per request; health and metrics ask
    every replica (`broadcast`)."""

    def __init__(self, engine: Any, model_name: str, tokenizer: Any, max_model_len: int,
                 generation_defaults: dict[str, Any] | None = None) -> None:
        """generation_defaults: request field -> the model's default (serving.openai.generation_config)."""
        self._engine = engine
        self._stream = engine.options(stream=True)
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.generation_defaults = dict(generation_defaults or {})
        # A DeploymentHandle of the draft pool's replicas (serving/draft_pool/pool.py), if any.
        self.draft_pool: Any = None

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The replica's deltas; raises GenerationError. Stopping early (aclose/cancel) aborts the request.

        A request that fails with 503 before its first delta (its replica refused it while recovering or
        draining, or lost its worker before the first token) is sent once more, after the request routers have
        had time to learn which replicas take requests: another replica may serve it, and the client saw nothing
        of the first attempt."""
        params = check_api_params(params)
        for attempt in range(_ATTEMPTS):
            started = False
            try:
                async with contextlib.aclosing(self._attempt(request_id, prompt_token_ids, params)) as deltas:
                    async for delta in deltas:
                        started = True
                        yield delta
                return
            except GenerationError as e:
                if started or e.status != 503 or attempt == _ATTEMPTS - 1:
                    raise
                logger.warning("request %s got 503 before any output (%s); retrying", request_id, e.message)
                await asyncio.sleep(_RETRY_DELAY_S)

    async def _attempt(self, request_id: str, prompt_token_ids: list[int],
                       params: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        from ray.serve.exceptions import BackPressureError

        finished = False
        responses = self._stream.generate.remote(request_id, prompt_token_ids, params)
        try:
            async for delta in responses:
                if "error" in delta:
                    finished = True
                    raise GenerationError(delta["error"], delta["status"], _param_of(delta["error"]),
                                          delta.get("retry_after"))
                finished = delta["finish_reason"] is not None
                yield delta
        except ray.exceptions.RayActorError as e:
            finished = True  # the replica is gone, with the request
            raise GenerationError(f"the engine replica serving this request died ({type(e).__name__}); "
                                  "retry shortly", 503, retry_after_s=1) from e
        except BackPressureError as e:
            finished = True  # never reached a replica
            raise GenerationError(f"the server is overloaded: every engine replica is busy and Serve's queue in "
                                  f"front of them is full (max_queued_requests); retry after {_RETRY_AFTER_S} s",
                                  429, retry_after_s=_RETRY_AFTER_S) from e
        finally:
            if not finished:
                # The consumer is gone (client disconnect, cancelled task): cancelling the call ends the
                # replica's stream, whose router then frees the request's KV blocks at once.
                responses.cancel()

    async def _broadcast(self, method: str, timeout_s: float, *args: Any) -> list[Any]:
        """Every engine replica's answer (an exception for a replica that failed or died)."""
        try:
            return await self._engine.broadcast(method, *args).results_async(timeout_s=timeout_s,
                                                                              return_exceptions=True)
        except TimeoutError as e:
            raise GenerationError(f"the engine replicas did not answer {method} within {timeout_s} s", 503) from e

    async def replica_health(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Each engine replica's own health report; one that does not answer reads as unhealthy."""
        return [r if isinstance(r, dict) else {"healthy": False, "reason": f"{type(r).__name__}: {r}"}
                for r in await self._broadcast("health", timeout_s)]

    async def check_health(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Healthy while at least one engine replica serves (the others may be recovering); raises
        GenerationError(503) when none does. The report counts the replicas."""
        reports = await self.replica_health(timeout_s)
        serving = [r for r in reports if r.get("healthy") and not r.get("draining")]
        if not serving:
            if reports and all(r.get("draining") for r in reports):
                raise GenerationError("the server is shutting down (draining its requests in flight)", 503)
            reasons = "; ".join(str(r.get("reason")) for r in reports) or "no engine replica is running"
            raise GenerationError(f"the engine is unhealthy: {reasons}", 503, retry_after_s=1)
        report = {"speculation": all(r.get("speculation", False) for r in serving),
                  "degraded": "; ".join(r["degraded"] for r in serving if r.get("degraded")) or None,
                  "num_replicas": len(reports), "num_serving": len(serving),
                  "weights": serving[0].get("weights")}  # every replica serves the same models
        if self.draft_pool is not None:
            try:
                drafts = await self.draft_pool.broadcast("health").results_async(timeout_s=timeout_s,
                                                                                 return_exceptions=True)
            except TimeoutError:
                drafts = None  # the pool did not answer in time: unknown, not zero
            report["num_draft_replicas"] = len(drafts) if drafts is not None else None
            report["num_draft_serving"] = (sum(1 for d in drafts if isinstance(d, dict) and d.get("healthy"))
                                           if drafts is not None else None)
        return report

    async def metrics_text(self, timeout_s: float = 10.0) -> str:
        """Every engine replica's metrics, each series labelled with its `replica`; with a draft pool, its replicas'
        own series too, labelled with their `draft_replica`."""
        from serving.metrics import merge_replica_expositions

        parts = [r for r in await self._broadcast("replica_metrics", timeout_s) if not isinstance(r, BaseException)]
        text = merge_replica_expositions([tuple(p) for p in parts])
        if self.draft_pool is not None:  # the draft replicas' own series, labelled with their `draft_replica`
            try:
                drafts = await self.draft_pool.broadcast("metrics").results_async(timeout_s=timeout_s,
                                                                                  return_exceptions=True)
            except TimeoutError:
                drafts = []
            pool = [tuple(d) for d in drafts if not isinstance(d, BaseException)]
            if pool:
                text += merge_replica_expositions(pool, label="draft_replica")
        return text


def spec_decode_summary(spec: dict[str, Any]) -> dict[str, Any]:
    """The `spec_decode` object of responses: the router's counters plus vLLM's two derived rates."""
    drafts, drafted, accepted = spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "accepted_per_position": list(spec["accepted_per_position"]),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_length": 1.0 + accepted / drafts if drafts else 1.0}
