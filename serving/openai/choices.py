"""The choices of one OpenAI request (n per prompt), each a router stream of deltas, into a response body or SSE.

A delta is what serving.router.client streams: new token ids and text, finish_reason on the last one, token
counts and speculation counters, and the logprobs asked for (serving/openai/logprobs.py renders them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from serving.openai.harmony import HarmonyStream, parse_harmony
from serving.openai.logprobs import LogprobsBuilder, echo_logprobs, joined, logprobs_builder, vllm_prompt_logprobs
from serving.openai.reasoning_parser import ReasoningStream
from serving.openai.responses import ChatCompletionResponse, CompletionResponse, error_body, error_type
from serving.openai.tool_calls import ToolCallStream, parse_tool_calls
from serving.router.client import GenerationError, spec_decode_summary


def _tools(body: Any, chat: bool) -> Any:
    """The request's ToolSpec when its output is parsed for tool calls, else None."""
    spec = body.tool_spec() if chat else None
    return spec if spec is not None and spec.parses_calls else None


def _harmony_stream(body: Any, tokenizer: Any) -> HarmonyStream:
    tools = _tools(body, True)
    return HarmonyStream(body.options.harmony, tokenizer, set(tools.functions) if tools is not None else None)


def _harmony_message(token_ids: list[int], body: Any, finish: str | None,
                     tokenizer: Any) -> tuple[dict[str, Any], str | None]:
    """A finished harmony (GPT-OSS) choice, split from its token ids (serving/openai/harmony.py)."""
    tools = _tools(body, True)
    result = parse_harmony(token_ids, body.options.harmony, tokenizer,
                           set(tools.functions) if tools is not None else None, truncated=finish == "length")
    calls = [{k: v for k, v in c.items() if k != "index"} for c in result.calls]
    message: dict[str, Any] = {"role": "assistant", "content": (result.content or None) if calls else result.content}
    if tools is not None:
        message["tool_calls"] = calls
    if calls and finish == "stop":
        finish = "tool_calls"
    if result.reasoning is not None and body.include_reasoning:
        message["reasoning_content"] = result.reasoning
    return message, finish


def chat_message(text: str, body: Any, finish: str | None, token_ids: list[int] | None = None,
                 tokenizer: Any = None) -> tuple[dict[str, Any], str | None]:
    """A finished chat choice's message and finish_reason: the reasoning apart (with the server's reasoning
    parser), then the content's tool calls apart ("tool_calls" when a call ended the output; an unfinished call
    cut by max_tokens is dropped, never content). Harmony outputs (GPT-OSS) are split from their token ids."""
    if body.options.harmony is not None:
        return _harmony_message(token_ids or [], body, finish, tokenizer)
    reasoning, content = None, text
    parser = body.options.reasoning()
    if parser is not None:
        reasoning, content = parser.split(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    tools = _tools(body, True)
    if tools is not None:
        content, calls = parse_tool_calls(content, tools, truncated=finish == "length")
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        if calls and finish == "stop":
            finish = "tool_calls"
    if reasoning is not None and body.include_reasoning:
        message["reasoning_content"] = reasoning
    return message, finish


@dataclass
class Choice:
    index: int  # the choice's index in the response: prompt_index * n + i
    prompt_index: int
    stream: AsyncIterator[dict[str, Any]]
    prompt_token_ids: list[int]
    echo: str = ""  # the prompt's text, before the output (completions' echo)
    first: dict[str, Any] | None = None

    async def start(self) -> None:
        self.first = await anext(self.stream)

    async def close(self) -> None:
        await self.stream.aclose()  # an unfinished stream aborts its request in the router

    async def deltas(self) -> AsyncIterator[dict[str, Any]]:
        assert self.first is not None, "start() first"
        yield self.first
        if self.first["finish_reason"] is None:
            async for delta in self.stream:
                yield delta


# --- usage and speculation over choices ---------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def total_usage(lasts: list[tuple[Choice, dict[str, Any]]]) -> dict[str, Any]:
    """Prompt tokens once per prompt (as vLLM counts them with n > 1), completion tokens of every choice; a
    prompt's cached tokens as its choice that found the most in the cache."""
    prompts = {c.prompt_index: d["num_prompt_tokens"] for c, d in lasts}
    cached: dict[int, int] = {}
    for c, d in lasts:
        cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), d.get("num_cached_tokens", 0))
    return usage(sum(prompts.values()), sum(d["num_completion_tokens"] for _, d in lasts), sum(cached.values()))


def merged_spec(specs: list[dict[str, Any]]) -> dict[str, Any]:
    total = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": []}
    for s in specs:
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            total[key] += s[key]
        pos = total["accepted_per_position"]
        pos.extend([0] * (len(s["accepted_per_position"]) - len(pos)))
        for i, a in enumerate(s["accepted_per_position"]):
            pos[i] += a
    return spec_decode_summary(total)


# --- whole responses ------------------------------------------------------------------------------------------
async def _collect(choice: Choice) -> tuple[str, list[int], list[Any], dict[str, Any], list[Any] | None]:
    text, ids, lps, last, prompt_lps = "", [], [], {}, None
    async for delta in choice.deltas():
        text += delta["text"]
        ids += delta["token_ids"]
        lps += delta.get("logprobs") or []
        prompt_lps = delta.get("prompt_logprobs") or prompt_lps
        last = delta
    return text, ids, lps, last, prompt_lps


def _rendered(builder: LogprobsBuilder | None, choice: Choice, body: Any, ids: list[int], lps: list[Any],
              prompt_lps: list[Any] | None) -> Any:
    """A choice's logprobs object for these output tokens; with completions' echo, the first one of a choice
    lists the prompt's tokens first (their logprobs come on the choice's first delta)."""
    if builder is None:
        return None
    if getattr(body, "echo", False) and prompt_lps is not None:
        return joined(echo_logprobs(builder, choice.prompt_token_ids, prompt_lps), builder.render(ids, lps))
    return builder.render(ids, lps)


def _prompt_logprobs_field(choice: Choice, body: Any, client: Any, prompt_lps: list[Any] | None) -> Any:
    """vLLM's `prompt_logprobs` of a choice, where the request asked for them."""
    if body.prompt_logprobs is None or prompt_lps is None:
        return None
    return vllm_prompt_logprobs(client.tokenizer, choice.prompt_token_ids, prompt_lps, body.prompt_logprobs,
                                body.return_tokens_as_token_ids)


async def collect_response(choices: list[Choice], body: Any, request_id: str, client: Any,
                           chat: bool) -> dict[str, Any]:
    results = await asyncio.gather(*(_collect(c) for c in choices))
    out_choices = []
    for c, (text, ids, lps, last, prompt_lps) in zip(choices, results):
        logprobs = _rendered(logprobs_builder(body, client.tokenizer, chat), c, body, ids, lps, prompt_lps)
        entry: dict[str, Any] = {"index": c.index, "finish_reason": last["finish_reason"], "logprobs": logprobs,
                                 "stop_reason": last["stop_reason"]}
        if chat:
            entry["message"], entry["finish_reason"] = chat_message(text, body, entry["finish_reason"], ids,
                                                                    client.tokenizer)
        else:
            entry["text"] = c.echo + text
            entry["prompt_logprobs"] = _prompt_logprobs_field(c, body, client, prompt_lps)
        if body.return_token_ids:
            entry["prompt_token_ids"], entry["token_ids"] = c.prompt_token_ids, ids
        out_choices.append(entry)
    lasts = [(c, r[3]) for c, r in zip(choices, results)]
    model = ChatCompletionResponse if chat else CompletionResponse
    response = {"id": request_id, "model": client.model_name, "choices": out_choices, "usage": total_usage(lasts),
                "spec_decode": merged_spec([d["spec"] for _, d in lasts])}
    if chat:  # vLLM puts a chat request's prompt logprobs beside its choices (every choice has the same prompt)
        response["prompt_logprobs"] = _prompt_logprobs_field(choices[0], body, client, results[0][4])
    return model.model_validate(response).model_dump()


# --- server-sent events ---------------------------------------------------------------------------------------
def _call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's streamed shape: per call, its index, id, type and name with empty arguments, then the arguments
    as a fragment of the same index (clients concatenate the fragments)."""
    out = []
    for c in calls:
        fn = c["function"]
        out.append({"index": c["index"], "id": c["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": ""}})
        out.append({"index": c["index"], "function": {"arguments": fn["arguments"]}})
    return out


def _sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, dict[str, Any]]]:
    """Every choice's deltas as they come, interleaved (one task per choice)."""
    if len(choices) == 1:
        async for delta in choices[0].deltas():
            yield choices[0], delta
        return
    queue: asyncio.Queue[tuple[Choice, dict[str, Any] | BaseException | None]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for delta in choice.deltas():
                await queue.put((choice, delta))
            await queue.put((choice, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((choice, e))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            choice, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield choice, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse_stream(choices: list[Choice], body: Any, request_id: str, client: Any,
                     chat: bool) -> AsyncIterator[str]:
    """One chunk per delta and choice; spec_decode rides on each choice's last chunk. Usage as vLLM sends it:
    only with `stream_options.include_usage`, on a final choices-less chunk (and on every chunk with
    `continuous_usage_stats`); then `data: [DONE]`."""
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    builders = {c.index: logprobs_builder(body, client.tokenizer, chat) for c in choices}
    tools = _tools(body, chat)
    harmony = {c.index: _harmony_stream(body, client.tokenizer) for c in choices} \
        if chat and body.options.harmony is not None else {}
    splitters = {c.index: ToolCallStream(tools) for c in choices} if tools is not None and not harmony else {}
    reasoning = body.options.reasoning() if chat and not harmony else None
    thinkers = {c.index: ReasoningStream(reasoning) for c in choices} if reasoning is not None else {}
    started: set[int] = set()
    lasts: dict[int, tuple[Choice, dict[str, Any]]] = {}
    try:
        async for choice, delta in _merged(choices):
            finish = delta["finish_reason"]
            entry: dict[str, Any] = {"index": choice.index}
            if chat:
                text, calls, thought = delta["text"], [], ""
                if harmony:  # GPT-OSS: reasoning, content and calls from the token ids
                    split = harmony[choice.index].feed(delta["token_ids"], final=finish is not None,
                                                       truncated=finish == "length")
                    text, calls = split.content, split.calls
                    thought = split.reasoning if body.include_reasoning else ""
                    if harmony[choice.index].num_calls and finish == "stop":
                        finish = "tool_calls"
                if thinkers:
                    thought, text = thinkers[choice.index].feed(text, final=finish is not None)
                    thought = thought if body.include_reasoning else ""
                if splitters:
                    splitter = splitters[choice.index]
                    text, calls = splitter.feed(text, final=finish is not None, truncated=finish == "length")
                    if splitter.num_calls and finish == "stop":
                        finish = "tool_calls"
                if choice.index not in started:
                    entry["delta"] = {"role": "assistant", "content": text}
                else:
                    entry["delta"] = {"content": text} if text or not (finish or thought) else {}
                if thought:
                    entry["delta"]["reasoning_content"] = thought
                if calls:
                    entry["delta"]["tool_calls"] = _call_deltas(calls)
            else:
                entry["text"] = (choice.echo if choice.index not in started else "") + delta["text"]
            if body.return_token_ids:
                if choice.index not in started:
                    entry["prompt_token_ids"] = choice.prompt_token_ids
                entry["token_ids"] = delta["token_ids"]
            started.add(choice.index)
            entry["logprobs"] = _rendered(builders[choice.index], choice, body, delta["token_ids"],
                                          delta.get("logprobs") or [], delta.get("prompt_logprobs"))
            entry["finish_reason"] = finish
            if not chat or finish:
                entry["stop_reason"] = delta["stop_reason"]
            out: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": client.model_name,
                                   "choices": [entry]}
            if body.continuous_usage:
                out["usage"] = usage(delta["num_prompt_tokens"], delta["num_completion_tokens"],
                                     delta.get("num_cached_tokens", 0))
            if finish:
                out["spec_decode"] = spec_decode_summary(delta["spec"])
                lasts[choice.index] = (choice, delta)
            yield _sse_event(out)
        if body.include_usage_chunk:
            done = list(lasts.values())
            yield _sse_event({"id": request_id, "object": obj, "created": created, "model": client.model_name,
                              "choices": [], "usage": total_usage(done),
                              "spec_decode": merged_spec([d["spec"] for _, d in done])})
    except GenerationError as e:
        # Headers are already sent: report the failure in-band, as vLLM does, and still end the stream.
        yield _sse_event(error_body(e.message, error_type(e.status), e.param))
    finally:
        for c in choices:  # a client disconnect cancels us here: closing aborts the requests in the router
            with contextlib.suppress(Exception):
                await c.close()
    yield "data: [DONE]\n\n"
