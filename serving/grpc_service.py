"""gRPC `specserve.v1.Generation/Generate` on Ray Serve's gRPC proxy.

Serve's proxy calls the ingress deployment's method named like the RPC (`Generate`) with the parsed
request and, if the method takes it, a `grpc_context`. The deployment delegates here. Invalid arguments
end the call with INVALID_ARGUMENT: Serve keeps a status code set on the context when the method then
raises (its gRPCStatusError path), so we set code and details, then raise.

With an API key the call must carry the metadata `authorization: Bearer KEY` (UNAUTHENTICATED otherwise);
a full queue is RESOURCE_EXHAUSTED, an engine that is down or draining UNAVAILABLE. A client that cancels
the call ends the stream here, which aborts the request in the router (its KV blocks are freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

import grpc

from serving.openai.protocol import MAX_LOGPROBS
from serving.proto import specserve_pb2 as pb
from serving.router.client import GenerationError, spec_decode_summary

logger = logging.getLogger("specserve")

DEFAULT_MAX_TOKENS = 16
# What Serve's gRPC options name (`grpc_servicer_functions`, KubeRay `grpcServicerFunctions`). The generated
# `serving.proto.specserve_pb2_grpc.add_GenerationServicer_to_server` works too, without the cancel fix below.
SERVICER_FUNCTION = "serving.grpc_service.add_servicer"

_STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                 404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
                 429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


def _float(x: float) -> float:
    """proto floats are float32: 0.7 arrives as 0.699999988. Round back to the decimal the client wrote,
    so a request samples exactly like the same request over HTTP."""
    return round(float(x), 6)


def request_to_params(request: pb.GenerateRequest) -> dict[str, Any]:
    if request.max_tokens < 0:
        raise GenerationError(f"max_tokens must be an integer >= 1 (0 = default), got {request.max_tokens}",
                              400, "max_tokens")
    logprobs = request.logprobs if request.HasField("logprobs") else None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise GenerationError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", 400, "logprobs")
    return {"max_tokens": request.max_tokens or DEFAULT_MAX_TOKENS, "temperature": _float(request.temperature),
            "top_p": _float(request.top_p) if request.top_p else 1.0, "top_k": request.top_k,
            "seed": request.seed if request.HasField("seed") else None, "stop": list(request.stop),
            "stop_token_ids": list(request.stop_token_ids), "ignore_eos": request.ignore_eos, "logprobs": logprobs}


def request_to_ids(client: Any, request: pb.GenerateRequest) -> list[int]:
    if request.prompt_token_ids:
        if request.prompt:
            raise GenerationError("give prompt or prompt_token_ids, not both", 400, "prompt")
        return list(request.prompt_token_ids)
    if not request.prompt:
        raise GenerationError("prompt is empty: give at least one character", 400, "prompt")
    tok = client.tokenizer
    if request.chat and not getattr(tok, "chat_template", None):
        raise GenerationError("this model has no chat template", 400, "chat")
    try:
        if request.chat:
            ids = tok.apply_chat_template([{"role": "user", "content": request.prompt}],
                                          add_generation_prompt=True, tokenize=True)
            return list(ids if isinstance(ids, list) else ids["input_ids"])
        return list(tok(request.prompt)["input_ids"])
    except Exception as e:  # noqa: BLE001 - the template or the tokenizer rejected the text: the client's input
        raise GenerationError(f"the prompt cannot be tokenized: {type(e).__name__}: {e}", 400, "prompt") from e


def delta_to_response(delta: dict[str, Any]) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(text=delta["text"], token_ids=delta["token_ids"],
                               finish_reason=delta["finish_reason"] or "")
    for token_id, (logprob, top) in zip(delta["token_ids"], delta.get("logprobs") or []):
        resp.logprobs.append(pb.TokenLogprob(token_id=token_id, logprob=logprob, top_logprobs=[
            pb.TopLogprob(token_id=t, logprob=v) for t, v in top]))
    if delta["finish_reason"]:
        p, c = delta["num_prompt_tokens"], delta["num_completion_tokens"]
        resp.usage.CopyFrom(pb.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c))
        resp.spec_decode.CopyFrom(pb.SpecDecodeStats(**spec_decode_summary(delta["spec"])))
    return resp


def check_api_key(grpc_context: Any | None, api_key: str | None) -> None:
    """Raise GenerationError(401) unless the call's metadata carries `authorization: Bearer <api_key>`."""
    if api_key is None:
        return
    metadata = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
    scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
    # Constant time: how much of a guess matches must not show in the response time.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise GenerationError("incorrect or missing API key: send the metadata 'authorization: Bearer YOUR_KEY'",
                              401)


async def generate(client: Any, request: pb.GenerateRequest, grpc_context: Any | None,
                   api_key: str | None = None) -> AsyncIterator[pb.GenerateResponse]:
    """The body of `Generate`: stream one response per delta; map GenerationError to a status code."""
    try:
        check_api_key(grpc_context, api_key)
        ids = request_to_ids(client, request)
        stream = client.generate(f"grpc-{uuid.uuid4().hex}", ids, request_to_params(request))
        async with contextlib.aclosing(stream):
            async for delta in stream:
                yield delta_to_response(delta)
    except GenerationError as e:
        if grpc_context is not None:
            grpc_context.set_code(_STATUS_CODES.get(e.status, grpc.StatusCode.INTERNAL))
            grpc_context.set_details(e.message)
        raise


def add_servicer(servicer: Any, server: Any) -> None:
    """Serve's gRPC proxy calls this, in the proxy's process, to register the service (Serve then routes every
    method to the replicas). It also makes a client's cancel reach the replica every time, see below."""
    from serving.proto import specserve_pb2_grpc

    _cancel_dropped_replica_streams()
    specserve_pb2_grpc.add_GenerationServicer_to_server(servicer, server)


def _cancel_dropped_replica_streams() -> None:
    """Ray Serve's gRPC proxy cancels the replica's stream when the client cancels while the proxy waits for the
    next response, but a cancel that lands while it writes one drops the stream without cancelling it: the
    replica, and the router behind it, would generate on to max_tokens for nobody (measured: 2 of 8 cancels).
    So every response stream the proxy opens is tied to the proxy task that reads it: when that task ends
    (the RPC finished, failed or was cancelled) with the stream unfinished, the stream is cancelled, which
    aborts the request in the router. A stream that ran to its end is left alone."""
    try:
        from ray.serve._private.proxy_response_generator import ProxyResponseGenerator
    except ImportError:  # another Ray layout: keep Serve's own behaviour
        return
    if getattr(ProxyResponseGenerator, "_specserve_cancel_unfinished", False):
        return
    original_init = ProxyResponseGenerator.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running loop: nothing to tie the stream to
            return
        if task is not None:
            ref = weakref.ref(self)
            task.add_done_callback(lambda _: _cancel_unfinished(ref()))

    ProxyResponseGenerator.__init__ = init
    ProxyResponseGenerator._specserve_cancel_unfinished = True


def _cancel_unfinished(stream: Any) -> None:
    try:
        response = getattr(stream, "_response", None)
        if stream is not None and not stream._done and response is not None and not response.cancelled():
            response.cancel()
    except Exception:  # noqa: BLE001 - a done callback must not raise; the request then runs to its end
        logger.debug("cancelling a dropped replica stream failed", exc_info=True)
