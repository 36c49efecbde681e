"""Two engine replicas behind one ingress, on a real local Ray + Serve: each replica a router with its own target
worker (tiny byte-level model), Serve's request router choosing the replica of each request.

One application serves every test here (they run in order): both replicas serve and their outputs equal the
offline engine's, requests sharing a long prompt prefix land on one replica (prefix affinity), and killing one
replica's worker fails only that replica's requests while the other keeps answering. Which replica served what is
read from /metrics, where every series carries its `replica` label.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from byte_models import byte_tokenizer, make_byte_models
from serve_support import (
    Server,
    engine_broadcast,
    engine_replica_actors,
    kill_worker,
    running_server,
    scrape,
    serve_config,
    stream_text,
    worker_handles,
)

from engine import LLM, SamplingParams

MAX_MODEL_LEN = 128
TOKENIZER = byte_tokenizer()
PREFIX = "You are a helpful assistant. Answer briefly and in English. "  # 60 bytes: 7 blocks of 8 tokens


def ids(prompt: str) -> list[int]:
    return list(TOKENIZER(prompt)["input_ids"])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> str:
    target, _ = make_byte_models(tmp_path_factory.mktemp("byte"))
    return target


@pytest.fixture(scope="module")
def server(models: str) -> Iterator[Server]:
    cfg = serve_config(models, None, max_model_len=MAX_MODEL_LEN, num_replicas=2, request_router="prefix_aware",
                       request_router_kwargs={"block_size": 8, "min_prefix_tokens": 32})
    with running_server(cfg, num_cpus=6) as srv:
        yield srv


@pytest.fixture(scope="module")
def oracle(models: str):
    """Greedy text of the target, offline, in this process."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(models, max_model_len=MAX_MODEL_LEN, block_size=4, num_kv_blocks=1024)
    torch.set_num_threads(threads)

    def get(prompt: str, n: int) -> str:
        return llm.generate([ids(prompt)], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].text

    return get


def _body(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def served(server: Server) -> dict[str, float]:
    """Requests each engine replica has finished normally, from /metrics (replica label -> count)."""
    with server.http() as c:
        metrics = scrape(c, by_replica=True)
    counts: dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith("specserve_request_success_total{"):
            replica = key.split('replica="')[1].split('"')[0]
            counts[replica] = counts.get(replica, 0.0) + value
    return counts


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {r: after[r] - before.get(r, 0.0) for r in after}


def test_two_replicas_both_serve_and_match_offline(server: Server, oracle) -> None:
    replicas = set(engine_replica_actors())
    assert len(replicas) == 2
    before = served(server)
    assert set(before) == replicas  # every replica's series, labelled, before any request
    prompts = [f"{i} {w}" for i, w in enumerate(["apple", "river", "stone", "cloud", "north", "light", "green",
                                                 "metal"])]
    results: dict[int, tuple[int, str]] = {}

    def send(i: int) -> None:
        with server.http() as c:
            r = c.post("/v1/completions", json=_body(prompts[i], 24))
            results[i] = (r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(prompts):
        assert results[i] == (200, oracle(p, 24)), (p, results[i])
    delta = _delta(served(server), before)
    assert sum(delta.values()) == len(prompts) and all(n > 0 for n in delta.values()), delta  # both served
    stats = engine_broadcast("stats")
    assert {s["replica"] for s in stats} == replicas and all(s["healthy"] for s in stats)
    with server.http() as c:
        health = c.get("/health").json()
    assert (health["engine_replicas"], health["engine_replicas_serving"]) == (2, 2), health


def test_shared_prefix_lands_on_one_replica(server: Server, oracle) -> None:
    """Ten requests sharing a 60-token prefix, one after another: all go to the replica that served the first
    (power of two choices alone would split them; all on one by chance: 2 in 1024)."""
    before = served(server)
    with server.http() as c:
        for i in range(10):
            prompt = f"{PREFIX}Q{i}?"
            r = c.post("/v1/completions", json=_body(prompt, 4))
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == oracle(prompt, 4), r.text
    delta = _delta(served(server), before)
    assert sorted(delta.values()) == [0, 10], delta


def test_worker_death_fails_only_its_replicas_requests(server: Server, oracle) -> None:
    """Six streams over both replicas; one replica's target worker is killed once every stream has its first
    tokens. That replica's streams end with an in-band 503, the other's finish with the exact output; /health
    stays 200 and new requests are served while the broken replica rebuilds its worker group."""
    prompts = [f"{w} is" for w in ("Sun", "Moon", "Mars", "Rain", "Snow", "Wind")]
    n_tokens = 100
    first = [threading.Event() for _ in prompts]
    results: dict[int, tuple[str, str | None, list]] = {}

    def stream(i: int) -> None:
        with server.http() as c, c.stream("POST", "/v1/completions", json=_body(prompts[i], n_tokens, True)) as r:
            assert r.status_code == 200
            results[i] = stream_text(r.iter_lines(), on_text=first[i].set)
        first[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for e in first:
        assert e.wait(60)
    per_replica = {s["replica"]: s["num_streams"] for s in engine_broadcast("stats")}
    victim = max(per_replica, key=lambda r: per_replica[r])
    survivor = next(r for r in per_replica if r != victim)
    assert per_replica[victim] > 0 and per_replica[survivor] > 0, per_replica  # power of two choices split them
    killed = kill_worker("target", victim)
    with server.http() as c:
        health = c.get("/health")
        assert health.status_code == 200, health.text  # the survivor serves
        assert health.json()["engine_replicas"] == 2, health.json()
        for p in ("while", "recovering"):  # served meanwhile: by the survivor (or a retry once the victim is back)
            r = c.post("/v1/completions", json=_body(p, 8))
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == oracle(p, 8), r.text
    for t in threads:
        t.join()
    failed = [i for i, (_, _, errors) in results.items() if errors]
    assert len(failed) == per_replica[victim], (per_replica, results)  # the victim's streams, and only those
    for i, (text, finish, errors) in results.items():
        if errors:
            assert errors[0]["type"] == "service_unavailable" and "worker" in errors[0]["message"], errors
        else:
            assert finish == "length" and text == oracle(prompts[i], n_tokens)
    deadline = time.monotonic() + 120
    while not all(h["healthy"] for h in engine_broadcast("health")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(h["healthy"] for h in engine_broadcast("health"))
    assert killed not in worker_handles(victim)  # the victim rebuilt its worker group in place
