"""The clients users already have, against the package's server (conftest.py: Hermes tool-call parser with auto
tool choice, Qwen3 reasoning parser, the draft speculating): LangChain's bind_tools, instructor's modes, the
official client's tool choices, streamed and not, and the reasoning split.

The model is random: where a test needs a call or a thought from it that no grammar forces (tool_choice "auto",
instructor's MD_JSON, reasoning), a guided_regex or guided_grammar makes it write one, and the test checks what
the server and the client make of it. What must hold without help, it gets none: a forced call's schema lists
no additionalProperties (as client libraries send them), and strictness is what makes the call end.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel
from serve_support import Server, sse_events

from openai_parity import MODEL

HERMES_CALL = (r'<tool_call>\n\{"name": "paint", "arguments": \{"c": "(r|g)", "n": [123]\}\}\n</tool_call>')


class paint(BaseModel):  # noqa: N801 - the tool's name as the model sees it
    """Paint the wall."""

    c: Literal["r", "g"]
    n: Literal[1, 2, 3]


class stop(BaseModel):  # noqa: N801
    """Stop painting."""


PAINT_TOOL = {"type": "function", "function": {"name": "paint", "parameters": paint.model_json_schema()}}
STOP_TOOL = {"type": "function", "function": {"name": "stop", "parameters": stop.model_json_schema()}}


def _chat_model(server: Server, **kwargs: object):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=f"{server.base}/v1", api_key="x", max_tokens=96, temperature=1.0,
                      seed=3, max_retries=0, **kwargs)


def _openai(server: Server):
    import openai

    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("tool_choice", ["paint", "any"])
def test_langchain_bind_tools_forced(server: Server, tool_choice: str) -> None:
    bound = _chat_model(server).bind_tools([paint, stop], tool_choice=tool_choice, parallel_tool_calls=False)
    msg = bound.invoke("hi")
    assert msg.response_metadata["finish_reason"] == "tool_calls", msg
    assert msg.content == "" and len(msg.tool_calls) == 1 and not msg.invalid_tool_calls, msg
    call = msg.tool_calls[0]
    assert call["name"] == "paint" or (tool_choice == "any" and call["name"] == "stop")
    {"paint": paint, "stop": stop}[call["name"]].model_validate(call["args"], strict=True)
    # Streamed: LangChain's chunks add up to the same kind of message.
    full = None
    for chunk in bound.stream("hi"):
        full = chunk if full is None else full + chunk
    assert full.response_metadata["finish_reason"] == "tool_calls" and full.content == "", full
    assert len(full.tool_calls) == 1 and not full.invalid_tool_calls


def test_langchain_bind_tools_auto(server: Server) -> None:
    # Left to choose, the random model answers in text: no call, nothing lost.
    msg = _chat_model(server).bind_tools([paint], tool_choice="auto").invoke("hi")
    assert msg.tool_calls == [] and msg.content and msg.response_metadata["finish_reason"] in ("stop", "length")
    # When it writes a call (made to, here), the hermes parser takes it out of the content.
    made = _chat_model(server, extra_body={"guided_regex": HERMES_CALL}).bind_tools([paint], tool_choice="auto")
    for msg in (made.invoke("hi"), sum(made.stream("hi"), start=_Sum())):
        assert msg.response_metadata["finish_reason"] == "tool_calls" and msg.content == "", msg
        (call,) = msg.tool_calls
        assert call["name"] == "paint" and paint.model_validate(call["args"], strict=True)


class _Sum:
    """The start of sum() over LangChain chunks."""

    def __add__(self, other):
        return other


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "MD_JSON", "TOOLS"])
def test_instructor_modes(server: Server, mode: str) -> None:
    import instructor

    client = instructor.from_openai(_openai(server), mode=getattr(instructor.Mode, mode))
    extra = {}
    if mode == "MD_JSON":  # the random model does not follow the instruction to write a json code block: made to
        schema = json.dumps({**paint.model_json_schema(), "additionalProperties": False})
        extra = {"extra_body": {"guided_grammar": f'start: "```json\\n" body "\\n```"\nbody: %json {schema}\n'}}
    out = client.chat.completions.create(model=MODEL, response_model=paint, max_retries=0, max_tokens=96,
                                         temperature=1.0, seed=4, messages=[{"role": "user", "content": "hi"}],
                                         **extra)
    assert isinstance(out, paint)


def _streamed_calls(stream) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] += (d.function.name or "") if d.function else ""
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice, parallel", [("required", False), ("required", True),
                                                   ({"type": "function", "function": {"name": "paint"}}, None)])
def test_openai_client_forced_calls_end(server: Server, tool_choice: object, parallel: bool | None) -> None:
    oc = _openai(server)
    args = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [PAINT_TOOL, STOP_TOOL],
            "tool_choice": tool_choice, "max_tokens": 200, "temperature": 1.0, "seed": 7}
    if parallel is not None:
        args["parallel_tool_calls"] = parallel
    out = oc.chat.completions.create(**args).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None, out
    calls = [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
    content, streamed, finish = _streamed_calls(oc.chat.completions.create(**args, stream=True))
    assert finish == "tool_calls" and content == "" and all(c["id"].startswith("call_") for c in streamed)
    for name, arguments in calls + [(c["name"], c["arguments"]) for c in streamed]:
        assert name == "paint" or (tool_choice == "required" and name == "stop")
        {"paint": paint, "stop": stop}[name].model_validate_json(arguments, strict=True)
    if not parallel:
        assert len(calls) == len(streamed) == 1


def test_openai_client_parallel_calls_are_each_complete(server: Server) -> None:
    oc = _openai(server)
    args = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [PAINT_TOOL, STOP_TOOL],
            "tool_choice": "auto", "parallel_tool_calls": True, "max_tokens": 200, "temperature": 1.0, "seed": 1,
            "extra_body": {"guided_regex": f"{HERMES_CALL}\\n{HERMES_CALL}"}}  # 2 x 75 bytes
    out = oc.chat.completions.create(**args).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    assert [c.function.name for c in out.message.tool_calls] == ["paint"] * 2
    content, streamed, finish = _streamed_calls(oc.chat.completions.create(**args, stream=True))
    assert finish == "tool_calls" and content == "" and [c["name"] for c in streamed] == ["paint"] * 2
    assert len({c["id"] for c in streamed}) == 2


def test_call_cut_by_max_tokens_leaves_no_markup(server: Server) -> None:
    oc = _openai(server)
    args = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [PAINT_TOOL],
            "tool_choice": "required", "max_tokens": 20, "seed": 2}
    out = oc.chat.completions.create(**args).choices[0]
    assert out.finish_reason == "length" and not out.message.content and not out.message.tool_calls, out
    content, streamed, finish = _streamed_calls(oc.chat.completions.create(**args, stream=True))
    assert finish == "length" and content == "" and streamed == []


def test_reasoning_content_apart(client: httpx.Client) -> None:
    req = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "seed": 3,
           "temperature": 1.0, "guided_regex": "<think>[a-z]{3,8}</think>[a-z]{3,8}"}
    msg = client.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]
    assert msg["reasoning_content"].isalpha() and msg["content"].isalpha(), msg
    reasoning = content = ""
    for event in sse_events(client.post("/v1/chat/completions", json={**req, "stream": True}))[:-1]:
        delta = json.loads(event)["choices"][0]["delta"]
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
    assert (reasoning, content) == (msg["reasoning_content"], msg["content"])
    hidden = client.post("/v1/chat/completions", json={**req, "include_reasoning": False}).json()
    assert "reasoning_content" not in hidden["choices"][0]["message"]
    assert hidden["choices"][0]["message"]["content"] == msg["content"]


def test_served_chat_template_is_the_flags(client: httpx.Client) -> None:
    # The server's --chat-template (a file, conftest.py) renders a request's tools as "[tools]"; the model's own
    # template ignores them.
    messages = [{"role": "user", "content": "hi"}]
    ids = client.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": [PAINT_TOOL]}).json()["tokens"]
    text = client.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert text.startswith("[tools]<user>hi"), text
