"""The served models, health and metrics, the prefix cache, client aborts, OpenAI-shaped errors, and recovery from a
dead model worker or router (fixtures: conftest.py)."""

from __future__ import annotations

import json
import re
import time

import pytest
from serve_support import Server, assert_error, engine_replica_actors, router_call, router_handle, scrape, sse_events

from engine import LLM
from serving_e2e import CHAT, MODEL, PROMPT, _offline

pytestmark = pytest.mark.slow

DESIGN_METRICS = [
    "specserve_spec_decode_num_drafts_total", "specserve_spec_decode_num_draft_tokens_total",
    "specserve_spec_decode_num_accepted_tokens_total", "specserve_spec_decode_num_accepted_tokens_per_pos_total",
    "specserve_prompt_tokens_total", "specserve_generation_tokens_total", "specserve_request_success_total",
    "specserve_num_requests_running", "specserve_num_requests_waiting", "specserve_kv_cache_usage_perc",
    "specserve_time_to_first_token_seconds", "specserve_inter_token_latency_seconds",
    "specserve_e2e_request_latency_seconds", "specserve_step_duration_seconds",
    "specserve_prefix_cache_queries_total", "specserve_prefix_cache_hits_total",
    "specserve_speculation_ahead_lookups_total", "specserve_speculation_ahead_hits_total",
    "specserve_speculation_ahead_drafted_tokens_total", "specserve_speculation_ahead_unused_tokens_total",
    "specserve_speculation_ahead_skipped_branches_total", "specserve_speculation_ahead_branches",
    "specserve_speculation_ahead_trees_total", "specserve_speculation_ahead_tree_nodes_total",
    "specserve_speculation_ahead_off_steps_total",
]


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
