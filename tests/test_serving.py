"""The serving stack end to end: a real local Ray, Serve's HTTP and gRPC proxies on 127.0.0.1, the router
actor driving the real SmolLM2-135M with itself as the draft (k=3, so speculation really runs and accepts).

The oracle is the offline engine (engine.LLM) with the same settings in this process: served greedy and
seeded-sampled outputs must equal it token for token, whichever front end (raw HTTP, SSE, the official
openai client, gRPC) they come through.
"""

from __future__ import annotations

import json
import re
import threading
import time

import grpc
import openai
import pytest
from serve_support import (
    Server,
    assert_error,
    engine_replica_actors,
    router_call,
    router_handle,
    running_server,
    scrape,
    sse_events,
)

from engine import LLM, SamplingParams
from serving.proto import specserve_pb2 as pb
from serving.proto import specserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
ENGINE = dict(model=MODEL, draft_model=MODEL, num_speculative_tokens=3, rejection_sampling="probabilistic",
              max_model_len=512, device="cpu")
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=40, seed=1234)
DESIGN_METRICS = [
    "specserve_spec_decode_num_drafts_total", "specserve_spec_decode_num_draft_tokens_total",
    "specserve_spec_decode_num_accepted_tokens_total", "specserve_spec_decode_num_accepted_tokens_per_pos_total",
    "specserve_prompt_tokens_total", "specserve_generation_tokens_total", "specserve_request_success_total",
    "specserve_num_requests_running", "specserve_num_requests_waiting", "specserve_kv_cache_usage_perc",
    "specserve_time_to_first_token_seconds", "specserve_inter_token_latency_seconds",
    "specserve_e2e_request_latency_seconds", "specserve_step_duration_seconds",
    "specserve_prefix_cache_queries_total", "specserve_prefix_cache_hits_total",
    "specserve_spec_ahead_lookups_total", "specserve_spec_ahead_hits_total",
    "specserve_spec_ahead_drafted_tokens_total", "specserve_spec_ahead_unused_tokens_total",
]


@pytest.fixture(scope="module")
def server():
    with running_server(dict(ENGINE), num_cpus=4) as s:
        yield s


@pytest.fixture(scope="module")
def llm():
    import torch

    # One thread, like the router: on this project's small CPU runners two threads make a 135M-model step
    # many times slower, not faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(**ENGINE)
    finally:
        torch.set_num_threads(threads)


def _offline(llm: LLM, prompt: str | list[dict], **params) -> tuple[str, list[int]]:
    sp = SamplingParams(**params)
    out = llm.chat(prompt, sp) if isinstance(prompt, list) else llm.generate([prompt], sp)[0]
    return out.text, out.token_ids


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


# --- models, health, metrics ------------------------------------------------------------------------------
def test_models_and_health(server: Server) -> None:
    with server.http(timeout=120) as c:
        models = c.get("/v1/models").json()
        health = c.get("/health")
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert health.status_code == 200


def test_metrics_agree_with_responses(server: Server) -> None:
    with server.http(timeout=120) as c:
        assert c.get("/metrics").headers["content-type"].startswith("text/plain")  # Prometheus' text format
        before = scrape(c)
        usages = []
        for prompt, n in ((PROMPT, 10), ("Once upon a time", 6)):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0})
            usages.append(r.json()["usage"])
        after = scrape(c)
        text = c.get("/metrics").text

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for name in DESIGN_METRICS:
        assert re.search(rf"^{name}[{{ ]", text, re.M) or f"{name}_bucket" in text, name
    assert delta("specserve_generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("specserve_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    success = sum(delta(f'specserve_request_success_total{{finished_reason="{r}"}}') for r in ("stop", "length"))
    assert success == len(usages)
    drafted = after["specserve_spec_decode_num_draft_tokens_total"]
    accepted = after["specserve_spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafted and after["specserve_spec_decode_num_drafts_total"] > 0
    per_pos = sum(v for k, v in after.items() if k.startswith("specserve_spec_decode_num_accepted_tokens_per_pos"))
    assert per_pos == accepted
    assert after["specserve_num_requests_running"] == 0 and after["specserve_num_requests_waiting"] == 0
    for model in ("target", "draft"):
        assert f'specserve_kv_cache_usage_perc{{kv_group="0",model="{model}"}}' in after
    for phase in ("propose", "verify", "sample"):
        assert after[f'specserve_step_duration_seconds_count{{phase="{phase}"}}'] > 0
    assert delta("specserve_e2e_request_latency_seconds_count") == len(usages)
    assert delta("specserve_time_to_first_token_seconds_count") == len(usages)


def test_prefix_cache_in_usage_and_metrics(server: Server, llm: LLM) -> None:
    """A second prompt sharing a long prefix with the first reports the tokens it took from the cache (plain and
    streamed usage), gives the offline engine's text, and the per-model prefix-cache counters count the hit."""
    shared = "You answer questions about the sea in one short sentence, politely and without jargon. " * 3
    first, second = shared + "Why is it salty?", shared + "Why is it blue?"
    n_prompt = len(llm.tokenizer(second)["input_ids"])
    text, _ = _offline(llm, second, max_tokens=8, temperature=0.0)
    with server.http(timeout=120) as c:
        before = scrape(c)
        r1 = c.post("/v1/completions", json={"model": MODEL, "prompt": first, "max_tokens": 8, "temperature": 0})
        r2 = c.post("/v1/completions", json={"model": MODEL, "prompt": second, "max_tokens": 8, "temperature": 0})
        r3 = c.post("/v1/completions", json={"model": MODEL, "prompt": second, "max_tokens": 8, "temperature": 0,
                                             "stream": True, "stream_options": {"include_usage": True}})
        after = scrape(c)
    assert r1.status_code == r2.status_code == r3.status_code == 200, (r1.text, r2.text, r3.text)
    usage = r2.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    # The shared text is 3+ blocks of 16 tokens; the hit is whole blocks and leaves the last prompt token.
    assert 48 <= cached < n_prompt and cached % 16 == 0 and usage["prompt_tokens"] == n_prompt
    assert r2.json()["choices"][0]["text"] == text
    last = json.loads(sse_events(r3)[-2])  # the usage chunk, before [DONE]
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1 - (n_prompt - 1) % 16
    for model in ("target", "draft"):
        key = f'specserve_prefix_cache_hits_total{{model="{model}"}}'
        assert after[key] - before.get(key, 0.0) >= 2 * cached
        key = f'specserve_prefix_cache_queries_total{{model="{model}"}}'
        assert after[key] - before.get(key, 0.0) >= 2 * n_prompt


def test_client_disconnect_aborts_request(server: Server) -> None:
    """Closing a stream mid-generation aborts the request: it leaves the batch and frees its KV blocks."""
    with server.http(timeout=120) as c:
        before = scrape(c)
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 400,
                                                       "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        deadline = time.time() + 60
        while True:
            now = scrape(c)
            idle = now["specserve_num_requests_running"] == 0 and all(
                v == 0 for k, v in now.items() if k.startswith("specserve_kv_cache_usage_perc"))
            if idle or time.time() > deadline:
                break
            time.sleep(0.5)
    assert idle, {k: v for k, v in now.items() if "running" in k or "kv_cache" in k}
    assert now["specserve_generation_tokens_total"] - before["specserve_generation_tokens_total"] < 400
    assert now["specserve_request_aborted_total"] > before.get("specserve_request_aborted_total", 0)


def test_request_joins_a_running_batch(server: Server, llm: LLM) -> None:
    """A request that arrives mid-generation joins the batch between two steps: the router's step thread hands
    the engine over at the end of its step rather than running the requests it has to their end. Leaving the
    stream aborts the long request, so the next test finds an idle engine."""
    expected = _offline(llm, "Once upon a time", max_tokens=4, temperature=0)[0]
    with server.http(timeout=120) as c, server.http(timeout=120) as c2:
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 300,
                                                       "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the stream, which aborts the request
            assert next(lines).startswith("data: ")
            short = c2.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4,
                                                     "temperature": 0})
            during = scrape(c2)
    assert short.status_code == 200, short.text
    assert short.json()["choices"][0]["text"] == expected
    assert during["specserve_num_requests_running"] == 1  # the long request was still generating


# --- errors -----------------------------------------------------------------------------------------------
def test_errors_are_openai_shaped_4xx(server: Server) -> None:
    with server.http(timeout=120) as c:
        err = assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0}),
                            400)
        assert err["param"] == "max_tokens" and err["type"] == "invalid_request_error"
        assert_error(c.post("/v1/completions", content=b'{"model": "x", "prompt": ',
                             headers={"content-type": "application/json"}), 400)
        err = assert_error(c.post("/v1/completions", json={"model": "gpt-4", "prompt": PROMPT}), 404)
        assert err["code"] == "model_not_found"
        assert assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 0}),
                             400)["param"] == "n"
        assert_error(c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "n": 0}), 400)
        assert_error(c.post("/v1/completions", json={"model": MODEL}), 400)  # no prompt
        assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": -1}), 400)
        assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": "many"}),
                      400)
        assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": [10**9]}), 400)
        assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0,
                                                      "stream": True}), 400)
        assert_error(c.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400)
        # The server is unharmed: a good request still works.
        ok = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


# --- recovery (last: they replace the router) -------------------------------------------------------------
def _wait_until_served_again(server: Server) -> list[int]:
    """Statuses of a good request, retried until it succeeds; every failure must be an OpenAI-shaped 503."""
    statuses = []
    with server.http(timeout=120) as c:
        deadline = time.time() + 180
        while time.time() < deadline:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
            statuses.append(r.status_code)
            if r.status_code == 200:
                break
            assert_error(r, 503)
            time.sleep(1.0)
        assert statuses[-1] == 200, statuses
        assert c.get("/health").status_code == 200
    return statuses


def test_model_worker_death_replaces_router(server: Server) -> None:
    """A dead model worker (a crashed GPU process) is found by the next health probe; the engine replica reports
    unhealthy and rebuilds its worker groups (or Serve replaces the replica), and the server serves again."""
    import ray

    if not router_call(lambda r: bool(r.engine.workers())):
        pytest.skip("the router runs the models in-process: no worker actors to kill")
    workers = router_call(lambda r: [w for _, _, w in r.engine.workers()])
    ray.kill(workers[0], no_restart=True)
    with server.http(timeout=120) as c:
        assert c.get("/health").status_code == 503
    _wait_until_served_again(server)


def test_router_recreated_after_it_dies(server: Server) -> None:
    """Kill the engine replica (the router's process): requests get 503s in OpenAI's shape or wait for the new
    replica (never a hang or a 500) until Serve's controller has started a new one (with new model workers),
    which then serves."""
    import ray

    old = set(engine_replica_actors())
    ray.kill(router_handle(), no_restart=True)
    statuses = _wait_until_served_again(server)
    assert set(statuses) <= {200, 503}, statuses
    assert set(engine_replica_actors()).isdisjoint(old)
