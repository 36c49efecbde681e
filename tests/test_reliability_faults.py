"""Faults injected into a real server (local Ray, Serve's HTTP and gRPC proxies on 127.0.0.1, the router and
its worker actors stepping tiny byte-level models): client disconnects, overload, KV exhaustion in the
target or the draft, a worker killed mid-stream by its actor id, and a graceful drain.

After each fault the KV blocks of BOTH models must be back at their baseline (none held), and outputs that
survive a fault must equal the offline engine's greedy output without speculation (speculation is lossless,
so preemption, recompute or losing the draft may slow a request down but never change it).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import ray
from byte_models import byte_ids, greedy_oracle, make_byte_models
from serve_support import (
    Server,
    assert_error,
    check_disconnect_frees_kv,
    kill_worker,
    kv_blocks_used,
    router_handle,
    router_stats,
    running_server,
    scrape,
    serve_config,
    sse_payloads,
    stream_text,
    wait_idle,
    worker_handles,
)

from serving.proto import specserve_pb2 as pb
from serving.proto import specserve_pb2_grpc as pb_grpc

MAX_MODEL_LEN = 512
MAX_QUEUED = 2
MAX_SEQS = 2
PROMPTS = ["hello", "The sea is", "def f(x):", "0123456789"]
ids = byte_ids


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_byte_models(tmp_path_factory.mktemp("byte"))


@pytest.fixture(scope="module")
def server(models: tuple[str, str]) -> Iterator[Server]:
    target, draft = models
    cfg = serve_config(target, draft, max_model_len=MAX_MODEL_LEN, max_queued_requests=MAX_QUEUED,
                       continue_without_draft=True, engine_kwargs={"max_num_seqs": MAX_SEQS},
                       adaptive_draft_length=False)  # drafts every step: the new draft group must propose
    with running_server(cfg, num_cpus=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def oracle(models: tuple[str, str]):
    """Greedy token ids and text of the target alone, offline, with a KV cache that never runs out."""
    return greedy_oracle(models[0], MAX_MODEL_LEN)


def _body(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": ids(prompt), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


# --- client disconnect -------------------------------------------------------------------------------------
def test_http_disconnect_frees_kv_of_both_models(server: Server) -> None:
    check_disconnect_frees_kv(server, _body("hello", 500, stream=True))


def test_grpc_cancel_frees_kv_of_both_models(server: Server) -> None:
    baseline = kv_blocks_used(wait_idle())
    with server.http() as c:
        aborted = scrape(c).get("specserve_request_aborted_total", 0.0)
    with grpc.insecure_channel(server.grpc_target) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(prompt_token_ids=ids("hello"), max_tokens=500, ignore_eos=True), timeout=120)
        first = next(call)
        assert first.token_ids
        call.cancel()
    stats = wait_idle(timeout_s=20, baseline=baseline)
    assert kv_blocks_used(stats) == baseline, stats
    with server.http() as c:
        assert scrape(c)["specserve_request_aborted_total"] == aborted + 1


# --- overload ----------------------------------------------------------------------------------------------
def test_overload_gets_429_with_retry_after(server: Server, oracle) -> None:
    """2 run, at most 2 wait, the rest are refused at once with 429 + Retry-After: the queue never grows past
    its bound, and every admitted request still gets its exact output."""
    n = 8
    results: list[tuple[int, dict, str]] = [None] * n  # type: ignore[list-item]
    max_waiting = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            max_waiting[0] = max(max_waiting[0], router_stats()["num_waiting"])
            time.sleep(0.02)

    def send(i: int) -> None:
        with server.http() as c:
            r = c.post("/v1/completions", json=_body(PROMPTS[i % len(PROMPTS)], 120, stream=True))
            results[i] = (r.status_code, dict(r.headers), r.text)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= MAX_SEQS, statuses
    for i, (status, headers, text) in enumerate(results):
        if status == 429:
            err = json.loads(text)["error"]
            assert err["code"] == "rate_limit_exceeded" and "max_queued_requests" in err["message"]
            assert int(headers["retry-after"]) >= 1
        else:
            got, finish, errors = stream_text(sse_payloads_lines(text))
            assert not errors and finish == "length"
            assert got == oracle(PROMPTS[i % len(PROMPTS)], 120)[1]
    assert max_waiting[0] <= MAX_QUEUED
    stats = wait_idle(timeout_s=30)
    assert set(kv_blocks_used(stats).values()) == {0}, stats


def sse_payloads_lines(text: str) -> list[str]:
    return [f"data: {p}" for p in sse_payloads(text)]


# --- KV exhaustion -----------------------------------------------------------------------------------------
def _router_run(engine_args: dict, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], dict, str,
                                                                                 dict[str, int]]:
    """Run prompts concurrently through a Router actor of their own (real worker actors, no HTTP); return the
    token ids, the router's stats once idle, its metrics exposition and each model's KV pool size in blocks."""
    from serving.router.router import RouterActor

    router = RouterActor.options(num_cpus=0).remote(engine_args, model_name="tiny")
    try:
        params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        gens = [router.generate.options(num_returns="streaming").remote(f"kv-{i}", ids(p), params)
                for i, p in enumerate(prompts)]
        out: list[list[int]] = []
        for gen in gens:
            tokens = []
            for ref in gen:
                delta = ray.get(ref)
                assert "error" not in delta, delta
                tokens += delta["token_ids"]
            out.append(tokens)
        deadline = time.monotonic() + 10
        while (stats := ray.get(router.stats.remote()))["num_streams"] and time.monotonic() < deadline:
            time.sleep(0.05)
        pools = ray.get(router.__ray_call__.remote(lambda r: {
            "target": r.engine.target_kv.pools[0].num_usable, "draft": r.engine.draft_kv.pools[0].num_usable}))
        return out, stats, ray.get(router.metrics_text.remote()), pools
    finally:
        ray.get(router.__ray_call__.remote(lambda r: r.engine.executor.shutdown()))
        ray.kill(router)


def _preemptions(exposition: str) -> float:
    line = next(x for x in exposition.splitlines() if x.startswith("specserve_num_preemptions_total"))
    return float(line.split()[-1])


@pytest.mark.parametrize("which", ["target", "draft"])
def test_kv_exhaustion_preempts_and_recomputes(server: Server, tmp_path: Path, oracle, which: str) -> None:
    """Four requests that together need more KV than one model has: requests are preempted and recomputed,
    nothing fails, greedy outputs equal the offline engine's, and every block comes back.

    target: both models get 40 blocks; the target, which holds k more positions per request, runs out first.
    draft: an 8-layer draft and a 2-layer target share one byte budget, so the target gets 160 blocks (all
    four requests fit) and the draft 40: only the draft can run out."""
    target, _ = make_byte_models(tmp_path / "m", draft_layers=3 if which == "target" else 8)
    draft = str(tmp_path / "m" / "draft")
    kv = {"num_kv_blocks": 40} if which == "target" else {"kv_cache_memory_bytes": 160 * 2 * 1024}
    # A fixed k: the draft's KV must fill up, so it must draft every step (the draft length rule, timed on a loaded
    # machine, may rest the draft at k = 0 long enough that it never runs out).
    args = dict(model=target, draft_model=draft, num_speculative_tokens=3, rejection_sampling="strict",
                max_model_len=128, device="cpu", block_size=4, max_num_batched_tokens=64, adaptive_draft_length=False,
                **kv)
    out, stats, exposition, pools = _router_run(args, PROMPTS, 100)
    need = sum(-(-(len(ids(p)) + 100 + 3) // 4) for p in PROMPTS)  # blocks for every request at full length
    if which == "draft":
        assert pools["target"] >= need > pools["draft"], pools  # only the draft can run out
    else:
        assert pools["target"] == pools["draft"] < need, pools
    assert out == [oracle(p, 100)[0] for p in PROMPTS]
    assert _preemptions(exposition) > 0
    assert stats["kv_blocks_used"] == {"target/0": 0, "draft/0": 0}, stats
    assert stats["healthy"] and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["gc_frozen_objects"] > 10_000, stats  # the router's startup heap (engine/gc_heap.py)


# --- a worker killed mid-stream ----------------------------------------------------------------------------
def _wait_health(server: Server, want: int, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    with server.http() as c:
        while True:
            r = c.get("/health")
            if r.status_code == want or time.monotonic() > deadline:
                assert r.status_code == want, r.text
                return r.json()
            time.sleep(0.1)


def _stream_and_kill(server: Server, prompt: str, max_tokens: int, role: str) -> tuple[str, str | None, list, str,
                                                                                      float]:
    """Start a greedy stream, kill a `role` worker by actor id after its first chunk, read the stream to its
    end; returns (text, finish reason, in-band errors, killed actor id, seconds from the kill to the end)."""
    with server.http() as c:
        with c.stream("POST", "/v1/completions", json=_body(prompt, max_tokens, stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            head = [next(lines)]
            assert head[0].startswith("data: ")
            killed = kill_worker(role)
            t0 = time.monotonic()
            text, finish, errors = stream_text(iter(head + list(lines)))
            return text, finish, errors, killed, time.monotonic() - t0


def test_draft_worker_killed_mid_stream_continues_without_speculation(server: Server, oracle) -> None:
    """continue_without_draft: the stream in flight survives the draft's death with the exact greedy output;
    the router serves on the target alone, attaches a new draft group, and speculates again."""
    wait_idle()
    text, finish, errors, killed, _ = _stream_and_kill(server, "The sea is", 400, "draft")
    assert not errors and finish == "length"
    assert text == oracle("The sea is", 400)[1]
    deadline = time.monotonic() + 60
    health = _wait_health(server, 200)
    while not health["speculation"] and time.monotonic() < deadline:
        time.sleep(0.2)
        health = _wait_health(server, 200)
    assert health["speculation"] and health["degraded"] is None, health
    roles = {aid: role for aid, (role, _) in worker_handles().items()}
    assert killed not in roles and sorted(roles.values()) == ["draft", "target"]
    with server.http() as c:
        again = c.post("/v1/completions", json=_body("The sea is", 60)).json()
    assert again["spec_decode"]["num_drafts"] > 0  # the new draft group proposes
    assert again["choices"][0]["text"] == oracle("The sea is", 60)[1]
    assert set(kv_blocks_used(wait_idle()).values()) == {0}


def test_target_worker_killed_mid_stream_fails_fast_then_recovers(server: Server, oracle) -> None:
    """The target's death ends the streams in flight at once with a clear in-band error, /health turns 503, new
    requests get 503 in OpenAI's shape, and the router rebuilds both worker groups and serves again."""
    wait_idle()
    text, finish, errors, killed, took = _stream_and_kill(server, "hello", 400, "target")
    assert errors and "worker" in errors[0]["message"] and errors[0]["type"] == "service_unavailable", errors
    assert finish is None and took < 10, took
    unhealthy = _wait_health(server, 503, timeout_s=10)
    assert unhealthy["error"]["message"]
    _wait_health(server, 200, timeout_s=120)
    assert killed not in worker_handles()
    with server.http() as c:
        r = c.post("/v1/completions", json=_body("hello", 40))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == oracle("hello", 40)[1]
    assert set(kv_blocks_used(wait_idle()).values()) == {0}


def test_requests_during_recovery_get_503(server: Server) -> None:
    """While the worker groups are rebuilt, a request is refused with 503 + Retry-After, not left hanging."""
    wait_idle()
    kill_worker("target")
    _wait_health(server, 503, timeout_s=10)
    with server.http() as c:
        r = c.post("/v1/completions", json=_body("hello", 4))
    if r.status_code != 200:  # the rebuild may already be done on a fast machine
        assert_error(r, 503)
        assert int(r.headers["retry-after"]) >= 1
    _wait_health(server, 200, timeout_s=120)


# --- graceful drain (last: the server takes no requests afterwards) ----------------------------------------
def test_drain_finishes_in_flight_and_refuses_new(server: Server, oracle) -> None:
    from serving.app import drain

    wait_idle()
    results: dict[int, tuple[str, str | None, list]] = {}

    def stream(i: int) -> None:
        with server.http() as c:
            with c.stream("POST", "/v1/completions", json=_body(PROMPTS[i], 150, stream=True)) as r:
                results[i] = stream_text(r.iter_lines())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while router_stats()["num_running"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    report: list = []
    drainer = threading.Thread(target=lambda: report.extend(drain(60.0)))
    drainer.start()
    _wait_health(server, 503, timeout_s=10)
    with server.http() as c:
        err = assert_error(c.post("/v1/completions", json=_body("hello", 4)), 503)
    assert "shutting down" in err["message"]
    for t in threads:
        t.join()
    drainer.join()
    assert report == [{"drained": True, "num_in_flight": 0}]
    for i in range(2):
        text, finish, errors = results[i]
        assert not errors and finish == "length" and text == oracle(PROMPTS[i], 150)[1]
    assert set(kv_blocks_used(router_stats()).values()) == {0}
    assert router_handle() is not None
