"""OpenAI output parity, served: n > 1 and prompt batches, logprobs, logits processing and stop options, structured
outputs and tools; outputs equal the offline engine's (fixtures: conftest.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_support import Server, assert_error, sse_events

from engine import LLM, SamplingParams
from openai_parity import CHAT, CMPL, MODEL, _offline

# --- n > 1 and prompt batches ---------------------------------------------------------------------------------
SAMPLED = {"temperature": 1.0, "top_k": 0, "max_tokens": 8, "ignore_eos": True}


def test_n_choices_are_independent_seeded_samples(client: httpx.Client, llm: LLM) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "n": 3, "seed": 11, **SAMPLED})
    assert r.status_code == 200, r.text
    body = r.json()
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    # Choice i is the request with seed + i (as vLLM seeds its n children): reproducible, and not a copy.
    assert texts == [_offline(llm, "hello", seed=11 + i, **SAMPLED) for i in range(3)]
    assert len(set(texts)) > 1
    assert body["usage"]["completion_tokens"] == 3 * 8 and body["usage"]["prompt_tokens"] == len("hello")


def test_prompt_batch_with_n(client: httpx.Client, llm: LLM) -> None:
    prompts = ["hello", "the cat"]
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "n": 2, "seed": 3,
                                                **SAMPLED}).json()
    by_index = {c["index"]: c["text"] for c in body["choices"]}
    assert by_index == {p * 2 + i: _offline(llm, prompts[p], seed=3 + i, **SAMPLED) for p in range(2) for i in range(2)}
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)  # once per prompt, not per choice


def test_n_streamed_and_chat(client: httpx.Client) -> None:
    req = {"model": MODEL, "prompt": "hello", "n": 2, "seed": 4, **SAMPLED}
    whole = client.post("/v1/completions", json=req).json()
    chunks = [json.loads(e) for e in sse_events(client.post("/v1/completions", json={
        **req, "stream": True, "stream_options": {"include_usage": True}}))[:-1]]
    streamed = {0: "", 1: ""}
    for ch in chunks[:-1]:
        (choice,) = ch["choices"]
        streamed[choice["index"]] += choice["text"]
    assert streamed == {c["index"]: c["text"] for c in whole["choices"]}
    assert chunks[-1]["usage"] == whole["usage"]
    chat = client.post("/v1/chat/completions", json={**CHAT, "n": 2, "seed": 4, "temperature": 1.0}).json()
    assert sorted(c["index"] for c in chat["choices"]) == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in chat["choices"])


def test_openai_client_reads_choices(server: Server) -> None:
    import openai

    oc = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x")
    resp = oc.completions.create(model=MODEL, prompt="hello", n=3, max_tokens=4, seed=1, temperature=1.0)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2] and all(c.text is not None for c in resp.choices)
    chat = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                      max_tokens=4, seed=1)
    assert len(chat.choices) == 2


# --- logprobs ---------------------------------------------------------------------------------------------------
def _offline_logprobs(llm: LLM, prompt: str | list[int], k: int, **params) -> tuple[list[int], list[dict]]:
    out = llm.generate([prompt], SamplingParams(logprobs=k, **params))[0]
    return out.token_ids, out.logprobs


def test_completion_logprobs(client: httpx.Client, llm: LLM) -> None:
    """Served logprobs (with the draft speculating) are the offline engine's, which equal HF's (test_logprobs.py)."""
    ids, ref = _offline_logprobs(llm, "hello", 3, max_tokens=8, temperature=0.0, ignore_eos=True)
    req = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    body = client.post("/v1/completions", json=req).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([r[t] for t, r in zip(ids, ref)], abs=1e-4)
    assert len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 8
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # Each position lists the emitted token and the 3 most likely (fewer keys where byte tokens decode alike).
    for top, r in zip(lp["top_logprobs"], ref):
        assert 1 <= len(top) <= 4 and max(top.values()) == pytest.approx(max(r.values()), abs=1e-4)
    chunks = [json.loads(e) for e in sse_events(client.post("/v1/completions", json={**req, "stream": True}))[:-1]]
    streamed = [v for ch in chunks for v in ch["choices"][0]["logprobs"]["token_logprobs"]]
    # Each request is its own forward pass (other batch shapes, other verify widths): float32 rounding differs
    # by a few ulps, the tolerance the offline comparison above uses.
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert client.post("/v1/completions", json={**req, "logprobs": None}).json()["choices"][0]["logprobs"] is None


def test_chat_logprobs(client: httpx.Client, llm: LLM) -> None:
    req = {**CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    body = client.post("/v1/chat/completions", json=req).json()
    prompt = client.post("/tokenize", json={"model": MODEL, "messages": CHAT["messages"]}).json()["tokens"]
    ids, ref = _offline_logprobs(llm, prompt, 2, max_tokens=6, temperature=0.0, ignore_eos=True)
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx([r[t] for t, r in zip(ids, ref)], abs=1e-4)
    assert all(len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode()) for c in content)
    assert [c["top_logprobs"][0]["logprob"] for c in content] == pytest.approx([max(r.values()) for r in ref],
                                                                              abs=1e-4)
    only = client.post("/v1/chat/completions", json={**req, "top_logprobs": None}).json()
    assert all(c["top_logprobs"] == [] for c in only["choices"][0]["logprobs"]["content"])


def test_openai_client_reads_logprobs(server: Server) -> None:
    import openai

    oc = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x")
    resp = oc.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs) and len(lp.top_logprobs) == 4
    chat = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                      temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    stream = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                        temperature=0, logprobs=True, stream=True)
    streamed = [c.logprob for ch in stream if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-4)  # separate passes round apart


def test_grpc_logprobs(server: Server, llm: LLM) -> None:
    import grpc

    from serving.proto import specserve_pb2 as pb
    from serving.proto import specserve_pb2_grpc as pb_grpc

    ids, ref = _offline_logprobs(llm, "hello", 2, max_tokens=6, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        responses = list(stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=6, ignore_eos=True, logprobs=2),
                                       timeout=120))
        entries = [e for r in responses for e in r.logprobs]
        assert [e.token_id for e in entries] == [t for r in responses for t in r.token_ids] == ids
        assert [e.logprob for e in entries] == pytest.approx([r[t] for t, r in zip(ids, ref)], abs=1e-4)
        assert all(len(e.top_logprobs) == 2 for e in entries)
        plain = list(stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=3), timeout=120))
        assert not any(r.logprobs for r in plain)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(prompt="hello", logprobs=21), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# --- logits processing and stop options, served -------------------------------------------------------------------
@pytest.mark.parametrize("fields", [
    dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3),
    dict(logit_bias={"104": 5.0, "111": 3.0}, min_p=0.2),
    dict(allowed_token_ids=list(range(97 + 3, 123 + 3)), min_tokens=3),
], ids=["penalties", "bias-minp", "allowed-min-tokens"])
def test_processing_fields_match_offline(client: httpx.Client, llm: LLM, fields: dict) -> None:
    req = {"model": MODEL, "prompt": "hello", "max_tokens": 10, "temperature": 0.9, "seed": 8, "top_k": 0, **fields}
    body = client.post("/v1/completions", json=req)
    assert body.status_code == 200, body.text
    offline = dict(fields, logit_bias={int(k): v for k, v in fields["logit_bias"].items()}) \
        if "logit_bias" in fields else fields
    assert body.json()["choices"][0]["text"] == _offline(llm, "hello", max_tokens=10, temperature=0.9, seed=8,
                                                         top_k=0, **offline)


def test_bad_words_and_stop_string_options(client: httpx.Client, llm: LLM) -> None:
    greedy = {"model": MODEL, "prompt": "hello", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    text = client.post("/v1/completions", json=greedy).json()["choices"][0]["text"]
    word = next(ch for ch in text if ch.strip())
    banned = client.post("/v1/completions", json={**greedy, "bad_words": [word]}).json()["choices"][0]["text"]
    assert word not in banned
    # The word is banned as it tokenizes at the start and after a space (vLLM's two variants).
    variants = [client.post("/tokenize", json={"prompt": p + word, "add_special_tokens": False}).json()["tokens"]
                for p in ("", " ")]
    assert banned == _offline(llm, "hello", max_tokens=10, temperature=0.0, ignore_eos=True,
                              bad_words_token_ids=variants)
    stop = text[3:5]
    cut = client.post("/v1/completions", json={**greedy, "stop": stop}).json()["choices"][0]
    kept = client.post("/v1/completions", json={**greedy, "stop": stop, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == cut["text"] + stop and cut["finish_reason"] == "stop"
    assert kept["choices"][0]["stop_reason"] == stop


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("repetition_penalty", 0), ("min_p", 1.5),
                                          ("min_tokens", 50), ("logit_bias", {"x": 1.0}),
                                          ("logit_bias", {"100000": 1.0}), ("logit_bias", {"5": 500}),
                                          ("allowed_token_ids", []), ("allowed_token_ids", [10**6]),
                                          ("bad_words", [""])])
def test_bad_processing_values(client: httpx.Client, field: str, value: object) -> None:
    err = assert_error(client.post("/v1/completions", json={**CMPL, field: value}), 400)
    assert err["param"] == field, err


def test_echo_and_token_id_options(client: httpx.Client) -> None:
    req = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json=req).json()["choices"][0]
    echoed = client.post("/v1/completions", json={**req, "echo": True}).json()["choices"][0]
    assert echoed["text"] == "hello" + plain["text"]
    chunks = [json.loads(e) for e in sse_events(client.post("/v1/completions", json={**req, "echo": True,
                                                                                       "stream": True}))[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == echoed["text"]
    with_ids = client.post("/v1/completions", json={**req, "return_token_ids": True}).json()["choices"][0]
    prompt_ids = client.post("/tokenize", json={"prompt": "hello"}).json()["tokens"]
    assert with_ids["prompt_token_ids"] == prompt_ids and len(with_ids["token_ids"]) == 5
    lp = client.post("/v1/completions", json={**req, "logprobs": 1, "return_tokens_as_token_ids": True}).json()
    assert lp["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in with_ids["token_ids"]]


# --- structured outputs and tools (engine-side exactness: tests/test_structured_outputs.py) ----------------------
PICK = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "size": {"type": "integer",
        "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}}, "required": ["color", "size", "ok"],
        "additionalProperties": False}
ARGS = {"type": "object", "properties": {"c": {"enum": ["r", "g"]}, "n": {"type": "integer", "minimum": 0,
        "maximum": 9}}, "required": ["c", "n"], "additionalProperties": False}  # short: the context is 128 bytes
TOOLS = [{"type": "function", "function": {"name": "paint", "parameters": ARGS}},
         {"type": "function", "function": {"name": "stop", "parameters": {"type": "object", "properties": {},
                                                                  "additionalProperties": False}}}]
# The tiny model's context is 128 bytes: a template that shows it has tools, not the Hermes system prompt.
TOOL_TEMPLATE = ("{% if tools %}[tools]{% endif %}{% for m in messages %}<{{ m['role'] }}>"
                                            "{{ m['content'] }}\n{% endfor %}<assistant>")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(client: httpx.Client, temperature: float) -> None:
    import jsonschema

    fields = [{"response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK,
                                                                          "strict": True}}},
              {"guided_json": PICK}, {"structured_outputs": {"json": PICK}}]
    for extra in fields:
        r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 60, "temperature": temperature,
                                                      "seed": 2, **extra})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PICK)
    r = client.post("/v1/completions", json={**CMPL, "max_tokens": 8, "guided_choice": ["yes", "no"],
                                             "temperature": temperature, "stream": True})
    text = "".join(json.loads(e)["choices"][0]["text"] for e in sse_events(r)[:-1])
    assert text in ("yes", "no")


def test_openai_client_parse_helper(server: Server) -> None:
    from typing import Literal

    import openai
    from pydantic import BaseModel, Field

    class Pick(BaseModel):
        color: Literal["red", "green"]
        size: int = Field(ge=0, le=9)
        ok: bool

    oc = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x")
    out = oc.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=60,
                                         response_format=Pick, seed=1)
    assert isinstance(out.choices[0].message.parsed, Pick)


def _tool_request(**extra: object) -> dict:
    return {**CHAT, "max_tokens": 96, "tools": TOOLS, "chat_template": TOOL_TEMPLATE, "seed": 5, **extra}


def test_tool_choice_required_and_streamed_deltas_reassemble(client: httpx.Client) -> None:
    import jsonschema

    for choice in ("required", {"type": "function", "function": {"name": "paint"}}):
        body = _tool_request(tool_choice=choice, parallel_tool_calls=False, temperature=1.0)
        out = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert out["finish_reason"] == "tool_calls", out
        (call,) = out["message"]["tool_calls"]
        assert call["id"].startswith("call_") and call["type"] == "function"
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
        # The same request streamed: the deltas' fragments reassemble into the same call.
        calls: dict[int, dict] = {}
        finish = None
        for event in sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}))[:-1]:
            c = json.loads(event)["choices"][0]
            finish = c["finish_reason"] or finish
            for d in c["delta"].get("tool_calls", []):
                entry = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.get("id") or entry["id"]
                entry["name"] += d.get("function", {}).get("name") or ""
                entry["arguments"] += d.get("function", {}).get("arguments") or ""
        assert finish == "tool_calls" and list(calls) == [0]
        assert calls[0]["name"] == call["function"]["name"] and calls[0]["id"].startswith("call_")
        assert json.loads(calls[0]["arguments"]) == json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("extra, param", [
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"), ({"guided_json": PICK, "guided_regex": "a"}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"), ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
])
def test_structured_outputs_refusals(client: httpx.Client, extra: dict, param: str) -> None:
    err = assert_error(client.post("/v1/chat/completions", json={**CHAT, **extra}), 400)
    assert err["param"] == param, err
