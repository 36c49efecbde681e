"""GPT-OSS chat in the harmony format, served for real (local Ray, Serve's HTTP proxy) on a tiny random model whose
tokenizer has harmony's special tokens, through the official `openai` client, with vLLM's flags
(`--tool-call-parser openai --reasoning-parser openai_gptoss --enable-auto-tool-choice`).

`reasoning_effort` reaches the chat template (the prompt equals HF's rendering with it). A random model's free
output, whatever it holds, is split without an error and streams to what the whole response says. A grammar
(vLLM's guided_grammar, which llguidance writes special tokens in) makes the model emit harmony structure: reasoning
then an answer, a tool call, a malformed header; `tool_choice: required` forces a call through the `openai`
parser's own grammar. Greedy, so the streamed and the whole response of a request are the same output."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from harmony_support import harmony_tokenizer, make_harmony_model
from serve_support import Server, assert_error, running_server, serve_config

from serving.openai.harmony import HarmonyTokens, parse_harmony
from serving.openai.tokenizer_routes import harmony_messages

MODEL = "tiny"
TOK = harmony_tokenizer()
HT = HarmonyTokens.of(TOK)
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
REASON_FINAL = ('start: <|channel|> "analysis" <|message|> /[a-z]{1,6}/ <|end|> <|start|> "assistant" <|channel|> '
                '"final" <|message|> "ok" <|return|>\n')
CALL = ('start: <|channel|> "analysis" <|message|> "need weather" <|end|> <|start|> "assistant" <|channel|> '
        '"commentary to=functions.get_weather " <|constrain|> "json" <|message|> "{\\"city\\": \\"Paris\\"}" '
        '<|call|>\n')
# Two channels in the first header, then a header that never reaches <|message|>.
MALFORMED = ('start: <|channel|> "bogus" <|channel|> <|message|> "hi" <|end|> <|channel|> "final" <|return|>\n')


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_harmony_model(tmp_path_factory.mktemp("harmony"))
    config = serve_config(model, None, max_model_len=512, enable_auto_tool_choice=True, tool_call_parser="openai",
                          reasoning_parser="openai_gptoss")
    with running_server(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def oc(server: Server) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0, timeout=120)


def _chat(oc: Any, **kw: Any) -> tuple[Any, dict[str, Any]]:
    """The whole response's choice, and the same request streamed, its deltas joined as a client joins them."""
    kw = {"model": MODEL, "messages": HI, "temperature": 0, "max_tokens": 96, **kw}
    whole = oc.chat.completions.create(**kw).choices[0]
    joined: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": {}, "finish_reason": None}
    for chunk in oc.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            d = choice.delta
            joined["content"] += d.content or ""
            joined["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
            for call in d.tool_calls or []:
                entry = joined["tool_calls"].setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += (call.function.name or "") if call.function else ""
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
            joined["finish_reason"] = choice.finish_reason or joined["finish_reason"]
    return whole, joined


def _same(whole: Any, joined: dict[str, Any]) -> None:
    m = whole.message
    assert joined["content"] == (m.content or "")
    assert joined["reasoning_content"] == (getattr(m, "reasoning_content", None) or "")
    assert [(c["name"], c["arguments"]) for _, c in sorted(joined["tool_calls"].items())] == \
        [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    assert joined["finish_reason"] == whole.finish_reason


def test_reasoning_effort_reaches_the_template(oc: Any, server: Server) -> None:
    """The prompt is HF's rendering of the checkpoint's template with the request's reasoning_effort (medium, the
    template's default, without it); the random model's free output is split (no error), the whole response as the
    split of its token ids says and the stream as the whole response."""
    for effort in ("low", "high", None):
        extra = {"reasoning_effort": effort} if effort else {}
        whole = oc.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=48,
                                           extra_body={"return_token_ids": True}, **extra).choices[0]
        expected = TOK.apply_chat_template(HI, tokenize=True, add_generation_prompt=True, return_dict=False, **extra)
        assert whole.prompt_token_ids == list(expected)
        assert f"Reasoning: {effort or 'medium'}\n" in TOK.decode(whole.prompt_token_ids)
        split = parse_harmony(whole.token_ids, HT, TOK, None, truncated=whole.finish_reason == "length")
        assert (getattr(whole.message, "reasoning_content", None), whole.message.content) == \
            (split.reasoning, split.content)
        _same(*_chat(oc, max_tokens=48, **extra))
    with httpx.Client(base_url=server.base, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "reasoning_effort": "extreme"})
        assert assert_error(r, 400)["param"] == "reasoning_effort"


def test_reasoning_then_final(oc: Any) -> None:
    whole, joined = _chat(oc, extra_body={"guided_grammar": REASON_FINAL})
    assert re.fullmatch(r"[a-z]{1,6}", whole.message.reasoning_content)
    assert whole.message.content == "ok" and whole.finish_reason == "stop" and not whole.message.tool_calls
    _same(whole, joined)
    whole = oc.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=96,
                                       extra_body={"guided_grammar": REASON_FINAL, "include_reasoning": False})
    assert whole.choices[0].message.content == "ok" and getattr(whole.choices[0].message, "reasoning_content",
                                                                 None) is None


def test_tool_call_auto(oc: Any) -> None:
    """The model's commentary message to functions.get_weather is a tool call, its end (<|call|>) a stop."""
    whole, joined = _chat(oc, tools=[WEATHER], extra_body={"guided_grammar": CALL})
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert whole.message.reasoning_content == "need weather"
    [call] = whole.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    _same(whole, joined)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call(oc: Any, choice: Any) -> None:
    """tool_choice required / named: the `openai` parser's grammar makes the model write a harmony call."""
    whole, joined = _chat(oc, tools=[WEATHER], tool_choice=choice)
    assert whole.finish_reason == "tool_calls"
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    _same(whole, joined)


def test_malformed_header_is_not_an_error(oc: Any) -> None:
    whole, joined = _chat(oc, extra_body={"guided_grammar": MALFORMED})
    assert whole.message.content == "hi" and whole.finish_reason == "stop"
    _same(whole, joined)


def test_history_renders_reasoning_and_calls(oc: Any) -> None:
    """An earlier turn's reasoning_content, tool call (its arguments JSON text, as OpenAI's clients send them) and
    the tool's result go to the template as GPT-OSS's reads them: the prompt is HF's rendering of those."""
    messages = [*HI, {"role": "assistant", "content": None, "reasoning_content": "hmm",
                      "tool_calls": [{"id": "call_1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    whole = oc.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=8,
                                       extra_body={"return_token_ids": True}).choices[0]
    prompt = TOK.decode(whole.prompt_token_ids)
    assert '<|channel|>analysis<|message|>hmm<|end|>' in prompt
    assert '<|constrain|>json<|message|>{"city": "Paris"}<|call|>' in prompt
    rendered = [{"role": m["role"], "content": m["content"] or "", **{k: v for k, v in m.items()
                 if k in ("reasoning_content", "tool_calls", "tool_call_id")}} for m in messages]
    expected = TOK.apply_chat_template(harmony_messages(rendered), tools=[WEATHER], tokenize=True,
                                       add_generation_prompt=True, return_dict=False)
    assert whole.prompt_token_ids == list(expected)
