"""The OpenAI-compatible HTTP API as a FastAPI app over a RouterClient.

`create_openai_app(client)` builds the routes: /v1/completions, /v1/chat/completions (both with SSE
streaming), /v1/models, /health, /metrics. The Serve deployment passes itself its RouterClient at replica
start; anything else with the same methods (a fake in a unit test) works as well.

Errors always have OpenAI's shape. Client faults are 4xx: FastAPI's 422 for a body that does not parse or
validate becomes 400 (what OpenAI and vLLM return), engine ValueErrors arrive as GenerationError(400), a full
queue is 429 and an engine that is down or draining 503, both with Retry-After. The API key and the body size
limit are checked before any route (serving/http_guard.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.http_guard import OPEN_PATHS, RequestGuard
from serving.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
    error_body,
    error_type,
)
from serving.router_client import GenerationError, spec_decode_summary

logger = logging.getLogger("specserve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class Client(Protocol):
    model_name: str
    tokenizer: Any
    max_model_len: int

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...

    async def check_health(self) -> dict[str, Any]: ...

    async def metrics_text(self) -> str: ...


def _error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                    retry_after_s: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(error_body(message, error_type(status), param, code), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GenerationError)
    async def _generation_error(_: Request, e: GenerationError) -> JSONResponse:
        code = {404: "model_not_found", 429: "rate_limit_exceeded"}.get(e.status)
        return _error_response(e.status, e.message, e.param, code, e.retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return _error_response(400, "the request body is not valid JSON: " + errors[0].get("msg", ""))
        parts, param = [], None
        for err in errors:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = param or (".".join(loc) or None)
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return _error_response(400, "invalid request: " + "; ".join(parts), param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error in the OpenAI API")
        return _error_response(500, f"internal error: {type(e).__name__}: {e}")


def create_openai_app(client: Client, api_key: str | None = None, max_body_bytes: int | None = None,
                      auth_health_metrics: bool = False) -> FastAPI:
    """api_key: required as a Bearer token (None: open); /health and /metrics stay open unless
    auth_health_metrics. max_body_bytes: larger request bodies get 413 (None: no limit)."""
    app = FastAPI(title="specserve", description="OpenAI-compatible LLM serving with speculative decoding")
    install_error_handlers(app)
    if api_key is not None or max_body_bytes is not None:
        app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes,
                           open_paths=frozenset() if auth_health_metrics else OPEN_PATHS)

    @app.get("/health")
    async def health() -> Response:
        try:
            report = await client.check_health()
        except GenerationError as e:
            return _error_response(503, e.message, retry_after_s=e.retry_after_s)
        # Serving, perhaps degraded: speculation off while a new draft group starts (still lossless), or some
        # engine replicas not serving (recovering, draining) while others do.
        return JSONResponse({"status": "ok", "speculation": report.get("speculation", True),
                             "degraded": report.get("degraded"), "engine_replicas": report.get("num_replicas"),
                             "engine_replicas_serving": report.get("num_serving")})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(await client.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=client.model_name, max_model_len=client.max_model_len)])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        _check_request(client, body)
        prompt = body.single_prompt()
        ids = _tokenize(client, prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        return await _serve(client, body, f"cmpl-{uuid.uuid4().hex}", ids, max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        _check_request(client, body)
        ids = _apply_chat_template(client, body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI: up to the context length
            max_tokens = max(1, client.max_model_len - len(ids))
        return await _serve(client, body, f"chatcmpl-{uuid.uuid4().hex}", ids, max_tokens, chat=True)

    return app


def _check_request(client: Client, body: CompletionRequest | ChatCompletionRequest) -> None:
    if body.model is not None and body.model != client.model_name:
        raise GenerationError(f"The model `{body.model}` does not exist; this server serves "
                              f"`{client.model_name}`", 404, "model")
    body.check_supported()


def _tokenize(client: Client, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if not prompt:
        raise GenerationError("prompt is empty: give at least one character", 400, "prompt")
    try:
        return list(client.tokenizer(prompt)["input_ids"])
    except Exception as e:  # noqa: BLE001 - e.g. text the tokenizer cannot encode (lone surrogates)
        raise GenerationError(f"the prompt cannot be tokenized: {type(e).__name__}: {e}", 400, "prompt") from e


def _apply_chat_template(client: Client, body: ChatCompletionRequest) -> list[int]:
    tok = client.tokenizer
    if not getattr(tok, "chat_template", None):
        raise GenerationError(f"model {client.model_name} has no chat template: use /v1/completions", 400)
    messages = [m.template_dict() for m in body.messages]
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, tokenize=True)
    except Exception as e:  # noqa: BLE001 - jinja raises TemplateError for messages the template rejects
        raise GenerationError(f"the chat template rejected the messages: {e}", 400, "messages") from e
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return list(ids)


async def _serve(client: Client, body: CompletionRequest | ChatCompletionRequest, request_id: str,
                 ids: list[int], max_tokens: int, chat: bool) -> Response:
    stream = client.generate(request_id, ids, body.sampling_params(max_tokens))
    try:
        # The first delta comes after prefill, or is the router's validation error: awaiting it here lets a
        # bad request get a 400 even when it asked for a stream.
        first = await anext(stream)
    except BaseException:
        await stream.aclose()
        raise
    if body.stream:
        return StreamingResponse(_sse(stream, first, request_id, client.model_name, chat, body.include_usage_chunk),
                                 media_type="text/event-stream")
    async with contextlib.aclosing(stream):
        text, last = first["text"], first
        async for delta in stream:
            text += delta["text"]
            last = delta
    usage = _usage(last)
    spec = spec_decode_summary(last["spec"])
    if chat:
        resp: ChatCompletionResponse | CompletionResponse = ChatCompletionResponse(
            id=request_id, model=client.model_name, usage=usage, spec_decode=spec,
            choices=[ChatChoice(message=ChatMessageOut(content=text), finish_reason=last["finish_reason"])])
    else:
        resp = CompletionResponse(id=request_id, model=client.model_name, usage=usage, spec_decode=spec,
                                  choices=[CompletionChoice(text=text, finish_reason=last["finish_reason"])])
    return JSONResponse(resp.model_dump())


def _usage(delta: dict[str, Any]) -> Usage:
    p, c = delta["num_prompt_tokens"], delta["num_completion_tokens"]
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=delta.get("num_cached_tokens", 0)))


def _sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse(stream: AsyncIterator[dict[str, Any]], first: dict[str, Any], request_id: str, model: str,
               chat: bool, usage_chunk: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per delta; usage and spec_decode ride on the last chunk (on a separate
    choices-less chunk with `stream_options.include_usage`, as OpenAI sends it); then `data: [DONE]`."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], first_chunk: bool) -> dict[str, Any]:
        finish = delta["finish_reason"]
        if chat:
            msg = DeltaMessage(role="assistant", content=delta["text"]) if first_chunk else \
                DeltaMessage(content=delta["text"] if delta["text"] or not finish else None)
            out: dict[str, Any] = ChatCompletionChunk(
                id=request_id, created=created, model=model,
                choices=[ChatChunkChoice(delta=msg, finish_reason=finish)]).model_dump(exclude={"usage", "spec_decode"})
            out["choices"][0]["delta"] = msg.model_dump(exclude_none=True)
        else:
            out = CompletionResponse(id=request_id, created=created, model=model,
                                     choices=[CompletionChoice(text=delta["text"], finish_reason=finish)]
                                     ).model_dump(exclude={"usage", "spec_decode"})
        if finish and not usage_chunk:
            out["usage"] = _usage(delta).model_dump()
            out["spec_decode"] = spec_decode_summary(delta["spec"])
        return out

    try:
        delta = first
        yield _sse_event(chunk(first, True))
        if first["finish_reason"] is None:
            async for delta in stream:
                yield _sse_event(chunk(delta, False))
        if usage_chunk:
            yield _sse_event({"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                              "created": created, "model": model, "choices": [],
                              "usage": _usage(delta).model_dump(), "spec_decode": spec_decode_summary(delta["spec"])})
    except GenerationError as e:
        # Headers are already sent: report the failure in-band, as vLLM does, and still end the stream.
        yield _sse_event(error_body(e.message, error_type(e.status), e.param))
    finally:
        await stream.aclose()  # a client disconnect cancels us here: closing aborts the request in the router
    yield "data: [DONE]\n\n"
