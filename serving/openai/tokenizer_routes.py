"""Prompt rendering (text and chat template) and the routes that expose it: /tokenize, /detokenize, /version.

The routes take vLLM's request shapes, so tools written against vLLM's server (token counting, prompt
budgeting) work here. Tokenizing goes through the same code as generation, so /tokenize counts exactly the
tokens a completion or chat request with the same fields would prefill.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI

from serving.openai.chat_options import ChatOptions
from serving.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from serving.openai.responses import DetokenizeResponse, TokenizeResponse
from serving.openai.tool_calls import render_messages
from serving.router.client import GenerationError


def tokenize_text(client: Any, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    """A completion prompt's token ids: token lists as they are, text through the model's tokenizer."""
    if isinstance(prompt, list):
        return prompt
    try:
        return list(client.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
    except Exception as e:  # noqa: BLE001 - e.g. text the tokenizer cannot encode (lone surrogates)
        raise GenerationError(f"the prompt cannot be tokenized: {type(e).__name__}: {e}", 400, "prompt") from e


def apply_chat_template(client: Any, body: ChatCompletionRequest | TokenizeChatRequest) -> list[int]:
    """The chat request's prompt ids: its messages through the chat template (the request's own template when it
    gives one), then tokenized with or without the tokenizer's special tokens (add_special_tokens)."""
    tok = client.tokenizer
    if body.chat_template is None and not getattr(tok, "chat_template", None):
        raise GenerationError(f"model {client.model_name} has no chat template: use /v1/completions or give "
                              "chat_template", 400, "messages")
    messages = [m.template_dict() for m in body.messages]
    if getattr(body, "reasoning_effort", None) is not None and "reasoning_effort" not in _template_text(tok, body):
        raise GenerationError(f"reasoning_effort={body.reasoning_effort!r} is not supported: this model's chat "
                              "template does not read it (a template that takes a thinking switch gets it through "
                              "chat_template_kwargs, e.g. enable_thinking)", 400, "reasoning_effort")
    if body.options.harmony is not None:
        messages = harmony_messages(messages)
    tools = body.tool_spec()
    try:
        text = tok.apply_chat_template(messages, tokenize=False, **body.template_kwargs())
        if tools is not None and tools.choice != "none":
            with_tools = tok.apply_chat_template(messages, tokenize=False, tools=tools.tools,
                                                 **body.template_kwargs())
            # A template that renders the same text with and without tools ignores them: a system prompt lists
            # them in the tool-call parser's format.
            text = with_tools if with_tools != text else tok.apply_chat_template(
                render_messages(messages, tools, True), tokenize=False, **body.template_kwargs())
    except Exception as e:  # noqa: BLE001 - jinja raises TemplateError for messages the template rejects
        raise GenerationError(f"the chat template rejected the messages: {e}", 400, "messages") from e
    if not isinstance(text, str) or not text:
        raise GenerationError("the chat template rendered no text for these messages", 400, "messages")
    try:
        return list(tok(text, add_special_tokens=body.add_special_tokens)["input_ids"])
    except Exception as e:  # noqa: BLE001
        raise GenerationError(f"the messages cannot be tokenized: {type(e).__name__}: {e}", 400, "messages") from e


def _template_text(tok: Any, body: ChatCompletionRequest | TokenizeChatRequest) -> str:
    """The Jinja source that renders this request (named templates: all of them)."""
    template = body.chat_template if body.chat_template is not None else getattr(tok, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return str(template or "")


def harmony_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as GPT-OSS's template reads them: an assistant's reasoning as `thinking` (its analysis message),
    its calls' arguments as objects (the template writes them with tojson; OpenAI's clients send JSON text)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("reasoning_content") is not None:
            m["thinking"] = m["reasoning_content"]
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function") if isinstance(call, dict) else None
                args = fn.get("arguments") if isinstance(fn, dict) else None
                if isinstance(args, str):
                    try:
                        call = {**call, "function": {**fn, "arguments": json.loads(args) if args.strip() else {}}}
                    except ValueError:
                        pass  # not JSON: the template writes the text as the client gave it
                calls.append(call)
            m["tool_calls"] = calls
        out.append(m)
    return out


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each bad word as token ids, as it would be tokenized at the start of the text and after a space (vLLM bans
    both); words that tokenize to nothing are refused."""
    out: list[list[int]] = []
    for i, word in enumerate(words):
        variants = [tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False) for prefix in ("", " ")]
        if not variants[0]:
            raise GenerationError(f"bad_words.{i}: {word!r} has no tokens", 400, "bad_words")
        for ids in variants:
            if ids and ids not in out:
                out.append(list(ids))
    return out


def server_version() -> str:
    try:
        return version("specserve")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown"


def check_model(client: Any, model: str | None) -> None:
    """Raise GenerationError(404) unless `model` is unset or the served model's name."""
    if model is not None and model != client.model_name:
        raise GenerationError(f"The model `{model}` does not exist; this server serves `{client.model_name}`",
                              404, "model")


def add_tokenizer_routes(app: FastAPI, client: Any, chat_options: ChatOptions | None = None) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        check_model(client, body.model)
        if isinstance(body, TokenizeChatRequest):
            body.use_options(chat_options)
            body.check_supported()
            ids = apply_chat_template(client, body)
        else:
            ids = tokenize_text(client, body.prompt, body.add_special_tokens)
        strs = client.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=client.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(client, body.model)
        vocab = len(client.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise GenerationError(f"token ids {bad[:5]} are outside the tokenizer's vocabulary [0, {vocab})", 400,
                                  "tokens")
        return DetokenizeResponse(prompt=client.tokenizer.decode(body.tokens))

    @app.get("/version")
    async def server_version_route() -> dict[str, str]:
        return {"version": server_version()}
