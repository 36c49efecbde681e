"""The OpenAI-compatible HTTP API as a FastAPI app over a RouterClient.

`create_openai_app(client)` builds the routes: /v1/completions, /v1/chat/completions (both with SSE
streaming), /v1/models, /v1/models/{id}, /tokenize, /detokenize, /version, /health, /metrics. The Serve
deployment passes itself its RouterClient at replica start.

Errors always have OpenAI's shape. Client faults are 4xx: FastAPI's 422 for a body that does not parse or
validate becomes 400 (what OpenAI and vLLM return) naming the field, an unknown field included; engine
ValueErrors arrive as GenerationError(400), a full queue is 429 and an engine that is down or draining 503,
both with Retry-After. The API key and the body size limit are checked before any route (serving/openai/http_guard.py).

Each choice of a request (n > 1, or several prompts) is a request of its own in the router, so the choices are
independent samples; with a seed, choice i uses seed + i (as vLLM does), so each is reproducible.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.openai.chat_options import ChatOptions
from serving.openai.choices import Choice, collect_response, sse_stream
from serving.openai.http_guard import OPEN_PATHS, RequestGuard
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from serving.openai.responses import ModelCard, ModelList, error_body, error_type
from serving.openai.tokenizer_routes import (
    add_tokenizer_routes,
    apply_chat_template,
    bad_words_token_ids,
    check_model,
    tokenize_text,
)
from serving.router.client import GenerationError

logger = logging.getLogger("specserve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 64  # n times the number of prompts: each choice holds a router stream and its KV blocks


class Client(Protocol):
    model_name: str
    tokenizer: Any
    max_model_len: int
    # The model's generation_config.json settings (serving.openai.generation_config).
    generation_defaults: dict[str, Any]

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
            name = ".".join(loc) or None
            param = param or name
            if err.get("type") == "extra_forbidden":
                parts.append(f"{name}: unknown field (this server refuses fields it does not implement)")
            else:
                parts.append(f"{name or 'body'}: {err.get('msg')}")
        return _error_response(400, "invalid request: " + "; ".join(parts), param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error in the OpenAI API")
        return _error_response(500, f"internal error: {type(e).__name__}: {e}")


def create_openai_app(client: Client, api_key: str | None = None, max_body_bytes: int | None = None,
                      auth_health_metrics: bool = False, chat_options: ChatOptions | None = None) -> FastAPI:
    """api_key: required as a Bearer token (None: open); /health and /metrics stay open unless
    auth_health_metrics. max_body_bytes: larger request bodies get 413 (None: no limit). chat_options: tool-call
    and reasoning parsers, auto tool choice (the chat template is the client's tokenizer's)."""
    app = FastAPI(title="specserve", description="OpenAI-compatible LLM serving with speculative decoding")
    # Harmony (GPT-OSS) outputs when the tokenizer has its tokens; a harmony parser named for one without is an error.
    chat_options = (chat_options or ChatOptions()).for_tokenizer(getattr(client, "tokenizer", None))
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
        # Draft replicas only with a draft pool (draft_replicas); else each engine replica holds its own draft.
        return JSONResponse({"status": "ok", "speculation": report.get("speculation", True),
                             "degraded": report.get("degraded"), "engine_replicas": report.get("num_replicas"),
                             "engine_replicas_serving": report.get("num_serving"),
                             "draft_replicas": report.get("num_draft_replicas"),
                             "draft_replicas_serving": report.get("num_draft_serving"),
                             "weights": report.get("weights")})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(await client.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=client.model_name, max_model_len=client.max_model_len)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        check_model(client, model_id)
        return ModelCard(id=client.model_name, max_model_len=client.max_model_len)

    add_tokenizer_routes(app, client, chat_options)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        check_model(client, body.model)
        body.check_supported()
        texts = body.prompts()
        prompts = [_truncate(tokenize_text(client, p, body.add_special_tokens), body.truncate_prompt_tokens)
                   for p in texts]
        echoes = None
        if body.echo:  # the prompt as given, or as the model saw it when it was token ids or truncated
            echoes = [t if isinstance(t, str) and body.truncate_prompt_tokens is None else
                      client.tokenizer.decode(ids) for t, ids in zip(texts, prompts)]
        return await _serve(client, body, f"cmpl-{body.request_id or uuid.uuid4().hex}", prompts,
                            body.max_tokens, chat=False, echoes=echoes)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        check_model(client, body.model)
        body.use_options(chat_options)
        body.check_supported()
        ids = _truncate(apply_chat_template(client, body), body.truncate_prompt_tokens)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return await _serve(client, body, f"chatcmpl-{body.request_id or uuid.uuid4().hex}", [ids],
                            getattr(body, field), chat=True, max_tokens_field=field)

    return app


def _truncate(ids: list[int], keep: int | None) -> list[int]:
    """truncate_prompt_tokens (vLLM): keep the prompt's last `keep` tokens."""
    return ids[-keep:] if keep is not None else ids


def _max_tokens(client: Client, requested: int | None, num_prompt_tokens: int, chat: bool,
                field: str = "max_tokens") -> int:
    """The request's max_tokens, else OpenAI's default (16 for completions, the rest of the context for chat);
    capped by generation_config.json's max_new_tokens, as vLLM caps it. More than the context leaves after the
    prompt is a 400 naming the field, as vLLM answers (a prompt that fills the context is the engine's to name)."""
    room = client.max_model_len - num_prompt_tokens
    if requested is not None and requested > room > 0:
        raise GenerationError(f"'{field}' is too large: {requested}. This model's maximum context length is "
                              f"{client.max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
                              f"({requested} > {client.max_model_len} - {num_prompt_tokens})", 400, field)
    cap = client.generation_defaults.get("max_tokens")
    if requested is None:
        requested = max(1, client.max_model_len - num_prompt_tokens) if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        if cap is not None:
            requested = min(requested, cap)
    elif cap is not None and requested >= 1:  # a bad value is reported as the client wrote it
        requested = min(requested, cap)
    return requested


async def _serve(client: Client, body: CompletionRequest | ChatCompletionRequest, request_id: str,
                 prompts: list[list[int]], max_tokens: int | None, chat: bool,
                 echoes: list[str] | None = None, max_tokens_field: str = "max_tokens") -> Response:
    if len(prompts) * body.n > MAX_CHOICES:
        raise GenerationError(f"{len(prompts)} prompts x n={body.n} choices is over this server's limit of "
                              f"{MAX_CHOICES} choices per request", 400, "n")
    choices: list[Choice] = []
    try:
        for p, ids in enumerate(prompts):
            params = body.sampling_params(_max_tokens(client, max_tokens, len(ids), chat, max_tokens_field),
                                          client.generation_defaults)
            if body.bad_words:
                params["bad_words_token_ids"] = bad_words_token_ids(client.tokenizer, body.bad_words)
            harmony = body.options.harmony if chat else None
            if harmony is not None and not body.ignore_eos:  # a harmony turn ends at <|return|> or <|call|>
                params["stop_token_ids"] = list(params["stop_token_ids"] or []) + [
                    t for t in harmony.stop_token_ids if t not in (params["stop_token_ids"] or [])]
            for i in range(body.n):
                index = p * body.n + i
                seed = params["seed"]
                child = dict(params, seed=seed + i if seed is not None else None)
                stream = client.generate(f"{request_id}-{index}" if len(prompts) * body.n > 1 else request_id, ids,
                                         child)
                choices.append(Choice(index, p, stream, ids, echoes[p] if echoes else ""))
        # The first delta comes after prefill, or is the router's validation error: awaiting every choice's
        # first one here lets a bad request get a 400 even when it asked for a stream.
        await asyncio.gather(*(c.start() for c in choices))
    except BaseException:
        await asyncio.gather(*(c.close() for c in choices), return_exceptions=True)
        raise
    if body.stream:
        return StreamingResponse(sse_stream(choices, body, request_id, client, chat), media_type="text/event-stream")
    async with contextlib.AsyncExitStack() as stack:
        for c in choices:
            stack.push_async_callback(c.close)
        return JSONResponse(await collect_response(choices, body, request_id, client, chat))
