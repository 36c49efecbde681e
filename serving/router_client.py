"""The front ends' side of the router: tokenizer, request streaming and failure mapping, for HTTP and gRPC.

A Serve replica holds one RouterClient. It turns the router's delta stream into an async iterator that
raises `GenerationError` (with an HTTP-like status) for bad input or a lost engine, aborts the request
when the consumer stops early (client disconnect), and re-resolves the router's handle when the router
was recreated (Serve recreates a deployment-scoped actor that failed its health checks).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable
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
           "allowed_token_ids", "bad_words")
_ENGINE_NAMES = {"bad_words_token_ids": "bad_words"}  # the engine's name -> the API field it comes from


def _param_of(message: str) -> str | None:
    first = message.split(" ", 1)[0]
    first = _ENGINE_NAMES.get(first, first)
    return first if first in _PARAMS else None


class RouterClient:
    """Streams requests through a Router actor. `get_router` returns a fresh handle (after recreation)."""

    def __init__(self, get_router: Callable[[], Any], model_name: str, tokenizer: Any,
                 max_model_len: int, generation_defaults: dict[str, Any] | None = None) -> None:
        """generation_defaults: request field -> the model's default (serving.generation_config)."""
        self._get_router = get_router
        self._router: Any = get_router()
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.generation_defaults = dict(generation_defaults or {})

    def router(self) -> Any:
        """The router's handle, re-resolved after it died. A new router answers once its engine is built;
        until Serve has created it at all, requests get a 503 right away instead of waiting here."""
        if self._router is None:
            try:
                self._router = self._get_router()
            except ValueError as e:
                raise GenerationError("the engine is restarting (no router actor yet); retry shortly", 503) from e
        return self._router

    def _lost(self, error: BaseException) -> GenerationError:
        self._router = None
        return GenerationError(f"the engine is unavailable (the router actor died: {type(error).__name__}); "
                               "retry shortly", 503, retry_after_s=1)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The router's deltas; raises GenerationError. Stopping early (aclose/cancel) aborts the request."""
        params = check_api_params(params)
        router = self.router()
        finished = False
        try:
            gen = router.generate.options(num_returns="streaming").remote(request_id, prompt_token_ids, params)
            async for ref in gen:
                delta = await ref
                if "error" in delta:
                    finished = True
                    raise GenerationError(delta["error"], delta["status"], _param_of(delta["error"]),
                                          delta.get("retry_after"))
                finished = delta["finish_reason"] is not None
                yield delta
        except ray.exceptions.RayActorError as e:
            finished = True  # nothing left to abort
            raise self._lost(e) from e
        finally:
            if not finished:
                # Fire and forget: the consumer is gone (client disconnect, cancelled task); the router frees
                # the request's KV blocks without waiting for it to run to max_tokens.
                router.abort.remote(request_id)

    async def router_health(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The router's own report; raises GenerationError(503) when no live router answers in time."""
        try:
            return await asyncio.wait_for(self.router().health.remote(), timeout_s)
        except ray.exceptions.RayActorError as e:
            raise self._lost(e) from e
        except asyncio.TimeoutError as e:
            raise GenerationError(f"the router did not answer a health check within {timeout_s} s", 503) from e

    async def check_health(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The router's health; raises GenerationError(503) when it is gone, stuck or unhealthy."""
        health = await self.router_health(timeout_s)
        if not health.get("healthy", False):
            raise GenerationError(f"the engine is unhealthy: {health.get('reason')}", 503)
        if health.get("draining"):
            raise GenerationError("the server is shutting down (draining its requests in flight)", 503)
        return health

    async def metrics_text(self) -> str:
        try:
            return await self.router().metrics_text.remote()
        except ray.exceptions.RayActorError as e:
            raise self._lost(e) from e


def spec_decode_summary(spec: dict[str, Any]) -> dict[str, Any]:
    """The `spec_decode` object of responses: the router's counters plus vLLM's two derived rates."""
    drafts, drafted, accepted = spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "accepted_per_position": list(spec["accepted_per_position"]),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_length": 1.0 + accepted / drafts if drafts else 1.0}
