"""gRPC `specserve.v1.Generation/Generate` on Ray Serve's gRPC proxy.

Serve's proxy calls the ingress deployment's method named like the RPC (`Generate`) with the parsed
request and, if the method takes it, a `grpc_context`. The deployment delegates here. Invalid arguments
end the call with INVALID_ARGUMENT: Serve keeps a status code set on the context when the method then
raises (its gRPCStatusError path), so we set code and details, then raise.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from serving.proto import specserve_pb2 as pb
from serving.router_client import GenerationError, spec_decode_summary

DEFAULT_MAX_TOKENS = 16
SERVICER_FUNCTION = "serving.proto.specserve_pb2_grpc.add_GenerationServicer_to_server"

_STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                 503: grpc.StatusCode.UNAVAILABLE}


def _float(x: float) -> float:
    """proto floats are float32: 0.7 arrives as 0.699999988. Round back to the decimal the client wrote,
    so a request samples exactly like the same request over HTTP."""
    return round(float(x), 6)


def request_to_params(request: pb.GenerateRequest) -> dict[str, Any]:
    if request.max_tokens < 0:
        raise GenerationError(f"max_tokens must be an integer >= 1 (0 = default), got {request.max_tokens}",
                              400, "max_tokens")
    return {"max_tokens": request.max_tokens or DEFAULT_MAX_TOKENS, "temperature": _float(request.temperature),
            "top_p": _float(request.top_p) if request.top_p else 1.0, "top_k": request.top_k,
            "seed": request.seed if request.HasField("seed") else None, "stop": list(request.stop),
            "stop_token_ids": list(request.stop_token_ids), "ignore_eos": request.ignore_eos}


def request_to_ids(client: Any, request: pb.GenerateRequest) -> list[int]:
    if request.prompt_token_ids:
        if request.prompt:
            raise GenerationError("give prompt or prompt_token_ids, not both", 400, "prompt")
        return list(request.prompt_token_ids)
    if not request.prompt:
        raise GenerationError("prompt is empty: give at least one character", 400, "prompt")
    tok = client.tokenizer
    if request.chat:
        if not getattr(tok, "chat_template", None):
            raise GenerationError("this model has no chat template", 400, "chat")
        ids = tok.apply_chat_template([{"role": "user", "content": request.prompt}], add_generation_prompt=True,
                                      tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])
    return list(tok(request.prompt)["input_ids"])


def delta_to_response(delta: dict[str, Any]) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(text=delta["text"], token_ids=delta["token_ids"],
                               finish_reason=delta["finish_reason"] or "")
    if delta["finish_reason"]:
        p, c = delta["num_prompt_tokens"], delta["num_completion_tokens"]
        resp.usage.CopyFrom(pb.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c))
        resp.spec_decode.CopyFrom(pb.SpecDecodeStats(**spec_decode_summary(delta["spec"])))
    return resp


async def generate(client: Any, request: pb.GenerateRequest, grpc_context: Any | None
                   ) -> AsyncIterator[pb.GenerateResponse]:
    """The body of `Generate`: stream one response per delta; map GenerationError to a status code."""
    try:
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
