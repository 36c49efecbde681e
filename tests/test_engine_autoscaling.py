"""Serve's autoscaler scales engine replicas (each a router with its own worker group) on load, on a real local
Ray + Serve with a tiny byte-level model: 1 replica idle, 2 under load, back to 1 once idle, with short delays.
Every request sent while replicas come and go gets 200 and the exact greedy output, those in flight while a replica
is stopped (and drained) included."""

from __future__ import annotations

import functools
import threading
import time

from byte_models import byte_tokenizer, make_byte_models
from serve_support import running_server, serve_config

from engine import LLM, SamplingParams
from serving.engine_deployment import ENGINE_DEPLOYMENT

MAX_MODEL_LEN = 512
LONG = 400  # tokens of the requests in flight while the extra replica goes
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0.5,
               "downscale_delay_s": 0.5, "metrics_interval_s": 0.5, "look_back_period_s": 1.0}


def running_replicas() -> int:
    from ray import serve

    states = serve.status().applications["specserve"].deployments[ENGINE_DEPLOYMENT].replica_states
    return int(states.get("RUNNING", 0))


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def test_autoscaling_one_to_two_and_back(tmp_path) -> None:
    target, _ = make_byte_models(tmp_path)
    tok = byte_tokenizer()
    offline = LLM(target, max_model_len=MAX_MODEL_LEN, block_size=4, num_kv_blocks=1024)

    @functools.cache
    def expected(prompt: str, n: int) -> str:
        ids = list(tok(prompt)["input_ids"])
        return offline.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].text

    cfg = serve_config(target, None, max_model_len=MAX_MODEL_LEN, num_replicas=None, autoscaling_config=AUTOSCALING,
                       drain_timeout_s=60.0)
    with running_server(cfg, num_cpus=6) as server:
        assert running_replicas() == 1
        stop = threading.Event()
        results: list[tuple[str, int, str]] = []

        def load(i: int) -> None:
            with server.http(timeout=120) as c:
                while not stop.is_set():
                    prompt = f"load {i}"
                    r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 40,
                                                        "temperature": 0, "ignore_eos": True})
                    results.append((prompt, r.status_code, r.json()["choices"][0]["text"] if r.is_success
                                    else r.text))

        loaders = [threading.Thread(target=load, args=(i,)) for i in range(6)]
        for t in loaders:
            t.start()
        long_results: list[tuple[int, str]] = []

        def long_request(i: int) -> None:
            with server.http(timeout=300) as c:
                r = c.post("/v1/completions", json={"model": "tiny", "prompt": f"long {i}", "max_tokens": LONG,
                                                    "temperature": 0, "ignore_eos": True})
                long_results.append((r.status_code, r.json()["choices"][0]["text"] if r.is_success else r.text))

        longs = [threading.Thread(target=long_request, args=(i,)) for i in range(2)]
        try:
            assert wait_for(lambda: running_replicas() == 2, 120), "no second engine replica under load"
            # Let the new replica take requests before the load stops.
            n = len(results)
            assert wait_for(lambda: len(results) >= n + 6, 60)
            # Two long requests join the load; once the load stops they are under one replica's target, and Serve
            # stops a replica while they run, draining it: both must still finish, exactly.
            for t in longs:
                t.start()
        finally:
            stop.set()
            for t in loaders:
                t.join()
        assert wait_for(lambda: running_replicas() == 1, 90), "the second engine replica stayed while idle"
        for t in longs:
            t.join()
        assert sorted(long_results) == sorted((200, expected(f"long {i}", LONG)) for i in range(2)), long_results
        with server.http() as c:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected("after", 8)
    assert results and all(status == 200 for _, status, _ in results), [r for r in results if r[1] != 200][:3]
    for prompt, _, text in results:
        assert text == expected(prompt, 40)
