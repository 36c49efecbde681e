"""Served completions, chat, streams, the openai client, batching and gRPC equal the offline engine's output token
for token (fixtures: conftest.py)."""

from __future__ import annotations

import json
import threading

import grpc
import openai
import pytest
from serve_support import Server, sse_events

from engine import LLM
from serving.proto import specserve_pb2 as pb
from serving.proto import specserve_pb2_grpc as pb_grpc
from serving_e2e import CHAT, MODEL, PROMPT, _offline

pytestmark = pytest.mark.slow

SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=40, seed=1234)


def _assert_spec(spec: dict, completion_tokens: int) -> None:
    assert spec["num_drafts"] > 0  # speculation really ran
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
    assert spec["num_accepted_tokens"] < completion_tokens
    assert spec["acceptance_rate"] == pytest.approx(spec["num_accepted_tokens"] / spec["num_draft_tokens"])
    assert spec["acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])


# --- completions and chat ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), SAMPLED], ids=["greedy", "seeded"])
def test_completion_matches_offline(server: Server, llm: LLM, sampling: dict) -> None:
    text, ids = _offline(llm, PROMPT, max_tokens=16, **sampling)
    with server.http(timeout=120) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16, **sampling})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == text and choice["index"] == 0 and choice["logprobs"] is None
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["completion_tokens"] == len(ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    _assert_spec(body["spec_decode"], usage["completion_tokens"])


def test_completion_token_id_prompt(server: Server, llm: LLM) -> None:
    prompt_ids = llm.tokenizer(PROMPT)["input_ids"]
    text, _ = _offline(llm, PROMPT, max_tokens=8, temperature=0.0)
    with server.http(timeout=120) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt_ids, "max_tokens": 8,
                                            "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), SAMPLED], ids=["greedy", "seeded"])
def test_chat_matches_offline(server: Server, llm: LLM, sampling: dict) -> None:
    text, ids = _offline(llm, CHAT, max_tokens=16, **sampling)
    with server.http(timeout=120) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 16, **sampling})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["usage"]["completion_tokens"] == len(ids)
    _assert_spec(body["spec_decode"], len(ids))


def test_completion_stream_sse(server: Server, llm: LLM) -> None:
    text, ids = _offline(llm, PROMPT, max_tokens=16, temperature=0.0)
    with server.http(timeout=120) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                            "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    usage_chunk = chunks.pop()  # with include_usage, usage comes on a last chunk without choices (as vLLM)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len(ids)
    assert len(chunks) > 1
    assert all(ch["object"] == "text_completion" for ch in chunks)
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == text
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length" and "usage" not in last
    _assert_spec(last["spec_decode"], len(ids))


def test_chat_stream_sse(server: Server, llm: LLM) -> None:
    text, _ = _offline(llm, CHAT, max_tokens=16, temperature=0.0)
    with server.http(timeout=120) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 16,
                                                 "temperature": 0, "stream": True})
    chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] is not None and "spec_decode" in chunks[-1]


def test_stop_string_streamed_equals_offline(server: Server, llm: LLM) -> None:
    """A stop string cut off inside a speculative window: no stream ever shows text past it."""
    full, _ = _offline(llm, PROMPT, max_tokens=16, temperature=0.0)
    stop = full.strip().split()[2]
    text, _ = _offline(llm, PROMPT, max_tokens=16, temperature=0.0, stop=[stop])
    req = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": stop}
    with server.http(timeout=120) as c:
        plain = c.post("/v1/completions", json=req).json()
        streamed = c.post("/v1/completions", json={**req, "stream": True})
    assert plain["choices"][0]["text"] == text and plain["choices"][0]["finish_reason"] == "stop"
    chunks = [json.loads(e) for e in sse_events(streamed)[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == text
    assert stop not in text


def test_openai_client(server: Server, llm: LLM) -> None:
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x")
    text, _ = _offline(llm, PROMPT, max_tokens=12, temperature=0.0)
    chat_text, _ = _offline(llm, CHAT, max_tokens=12, temperature=0.0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert resp.choices[0].text == text and resp.usage.completion_tokens > 0
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == chat_text and chat.choices[0].message.role == "assistant"
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == text
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat_text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)


def test_concurrent_requests_batch(server: Server, llm: LLM) -> None:
    """Requests in flight together share the router's batch and each still gets its own offline output."""
    prompts = [PROMPT, "Once upon a time", "def fibonacci(n):"]
    expected = [_offline(llm, p, max_tokens=12, **SAMPLED)[0] for p in prompts]
    results: list[str | None] = [None] * len(prompts)

    def run(i: int) -> None:
        with server.http(timeout=120) as c:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompts[i], "max_tokens": 12, **SAMPLED})
            results[i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


# --- gRPC -------------------------------------------------------------------------------------------------
def test_grpc_generate_streams(server: Server, llm: LLM) -> None:
    text, ids = _offline(llm, PROMPT, max_tokens=16, temperature=0.0)
    with server.http(timeout=120) as c:
        http_text = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16,
                                                    "temperature": 0}).json()["choices"][0]["text"]
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        responses = list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=16, temperature=0.0),
                                       timeout=120))
    assert len(responses) > 1
    assert "".join(r.text for r in responses) == http_text == text
    assert [t for r in responses for t in r.token_ids] == ids
    assert any(len(r.token_ids) > 1 for r in responses)  # speculation: several tokens in one step
    assert [r.finish_reason for r in responses[:-1]] == [""] * (len(responses) - 1)
    last = responses[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == len(ids)
    assert 0 < last.spec_decode.num_accepted_tokens <= last.spec_decode.num_draft_tokens


def test_grpc_seeded_matches_http(server: Server) -> None:
    with server.http(timeout=120) as c:
        http_text = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                                    **SAMPLED}).json()["choices"][0]["text"]
    with grpc.insecure_channel(server.grpc_target) as channel:
        req = pb.GenerateRequest(prompt=PROMPT, max_tokens=12, temperature=SAMPLED["temperature"],
                                 top_p=SAMPLED["top_p"], top_k=SAMPLED["top_k"], seed=SAMPLED["seed"])
        text = "".join(r.text for r in pb_grpc.GenerationStub(channel).Generate(req, timeout=120))
    assert text == http_text


@pytest.mark.parametrize("request_kwargs", [dict(prompt=""), dict(prompt=PROMPT, max_tokens=-1),
                                            dict(prompt=PROMPT, temperature=-1.0)], ids=["empty", "max", "temp"])
def test_grpc_invalid_argument(server: Server, request_kwargs: dict) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(**request_kwargs), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details()

