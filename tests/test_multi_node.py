"""The real Serve app on a cluster of several Ray nodes (ray.cluster_utils.Cluster: a head for the router, the
ingress and Serve, and a node for each model, each a raylet with its own object store), over real HTTP: the worker
groups land on the nodes their resources ask for (read back from Ray), greedy output is the one-process greedy
output, and a node removed under a steady stream of requests loses none and serves none twice:

- the draft's node: the requests in flight go on without speculation, token for token (continue_without_draft),
  and a new draft group starts on a node that brings the draft's resource back;
- the target's node: the requests in flight end with a clear 503, none hangs, and the router rebuilds its groups
  on a node that brings the target's resource back;
- one replica's router's node: the other replica serves the requests sent once Ray has marked the node dead, and
  Serve starts a replacement on a node that brings the router's resource back.

Every request of the stream is accounted for: it completed with the greedy text, or failed with a clear error;
the server's own count of finished requests matches the client's completed ones (none ran twice).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import ray
from byte_models import byte_ids, greedy_oracle, make_byte_models
from ray.cluster_utils import Cluster
from serve_support import Server, engine_replica_actors, running_server, scrape, serve_config, worker_handles

from serving.workers.node_placement import actor_node_ids

MAX_MODEL_LEN = 128
MAX_TOKENS = 24
PROMPTS = ["hello", "The sea is", "def f(x):", "0123456789", "abc abc", "Once upon"]
# Worker nodes offer only their model's resource (no CPU), so nothing but that model's ranks lands there: removing
# one takes exactly that group. The ranks ask for no CPU either (CPU 0 drops it from the bundle).
REPLICAS = 2
TARGET = {"specserve_target": 1}
DRAFT = {"specserve_draft": 1}
ROUTER = {"specserve_router": 1}  # one engine replica's router on the head, the other on a node of its own
# The draft's node also carries a label the draft's group is placed by (draft_node_labels), as a KubeRay worker
# group's rayStartParams may set; the target's is chosen by its resource alone.
DRAFT_LABELS = {"specserve/pool": "draft"}
NODE_RESOURCES = {"target": {"specserve_target": REPLICAS}, "draft": {"specserve_draft": REPLICAS}, "router": ROUTER}
# Node deaths found within seconds, not Ray's default of half a minute.
FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 4}


@dataclass
class Nodes:
    cluster: Cluster
    target: object
    draft: object
    router: object

    def replace(self, role: str) -> str:
        """Remove `role`'s node at once (its raylet and every process on it killed) and return its node id."""
        node = getattr(self, role)
        self.cluster.remove_node(node, allow_graceful=False)
        return node.node_id

    def add(self, role: str) -> str:
        node = self.cluster.add_node(num_cpus=0, resources=NODE_RESOURCES[role],
                                     labels=DRAFT_LABELS if role == "draft" else {})
        setattr(self, role, node)
        return node.node_id


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_byte_models(tmp_path_factory.mktemp("byte"))


@pytest.fixture(scope="module")
def oracle(models: tuple[str, str]):
    return greedy_oracle(models[0], MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def cluster(models: tuple[str, str]) -> Iterator[tuple[Server, Nodes]]:
    target, draft = models
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": ROUTER, "include_dashboard": False,
                                                      "_system_config": FAST_HEALTH})
    try:
        nodes = Nodes(c, *(c.add_node(num_cpus=0, resources=NODE_RESOURCES[role],
                                      labels=DRAFT_LABELS if role == "draft" else {})
                           for role in ("target", "draft", "router")))
        c.wait_for_nodes()
        cfg = serve_config(target, draft, max_model_len=MAX_MODEL_LEN, continue_without_draft=True,
                           num_replicas=REPLICAS, router_actor_options={"num_cpus": 0, "resources": ROUTER},
                           target_resources={"CPU": 0, **TARGET}, draft_resources={"CPU": 0, **DRAFT},
                           draft_node_labels=DRAFT_LABELS, adaptive_draft_length=False,  # drafts every step
                           engine_kwargs={"max_num_seqs": 4, "step_timeout_s": 30.0})
        with running_server(cfg, address=c.address, proxy_location="HeadOnly") as srv:
            yield srv, nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def _body(prompt: str) -> dict:
    return {"model": "tiny", "prompt": byte_ids(prompt), "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}


def _group_nodes() -> dict[str, list[str | None]]:
    """role -> the node of each of its worker ranks over every engine replica, as Ray reports where each actor
    runs; "router" -> each replica's router's node."""
    routers = engine_replica_actors()
    out: dict[str, list[str | None]] = {"router": sorted(actor_node_ids(list(routers.values())))}
    for replica in routers:
        handles = list(worker_handles(replica).values())
        for (role, _), node in zip(handles, actor_node_ids([h for _, h in handles]), strict=True):
            out.setdefault(role, []).append(node)
    return out


def _health(server: Server) -> tuple[int, dict]:
    with server.http(timeout=10) as c:
        r = c.get("/health")
        return r.status_code, r.json()


def _wait_for(what: str, check, timeout_s: float) -> float:
    """Poll `check` until true; returns the seconds it took (fails past timeout_s)."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"{what} not within {timeout_s} s"
        time.sleep(0.2)
    return time.monotonic() - t0


def _finished_on_server(server: Server) -> float:
    with server.http() as c:
        return sum(v for k, v in scrape(c).items() if k.startswith("specserve_request_success_total"))


@dataclass
class Outcome:
    prompt: str
    start: float
    end: float
    status: int  # 0: no answer (a client timeout: a hang)
    text: str | None = None
    error: str | None = None


@dataclass
class SteadyStream:
    """`clients` threads, each sending a greedy completion as soon as its last one answered."""

    server: Server
    clients: int = 3
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> SteadyStream:
        for i in range(self.clients):
            self._threads.append(threading.Thread(target=self._run, args=(i,), daemon=True))
            self._threads[-1].start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in self._threads), "a client is still waiting for an answer"

    def _run(self, i: int) -> None:
        n = 0
        with self.server.http(timeout=60) as c:
            while not self._stop.is_set():
                prompt = PROMPTS[(i + n * self.clients) % len(PROMPTS)]
                n += 1
                t0 = time.monotonic()
                try:
                    r = c.post("/v1/completions", json=_body(prompt))
                except httpx.TimeoutException:
                    self.outcomes.append(Outcome(prompt, t0, time.monotonic(), 0))
                    continue
                out = Outcome(prompt, t0, time.monotonic(), r.status_code)
                if r.status_code == 200:
                    out.text = r.json()["choices"][0]["text"]
                else:
                    out.error = r.json()["error"]["message"]
                    time.sleep(0.2)  # a client backs off after an error
                self.outcomes.append(out)

    def completed(self) -> int:
        return sum(o.status == 200 for o in self.outcomes)

    def wait_completed(self, n: int, timeout_s: float) -> None:
        _wait_for(f"{n} completions", lambda: self.completed() >= n, timeout_s)


def _account(stream: SteadyStream, oracle, finished_before: float, server: Server) -> tuple[int, int]:
    """Every request completed with the greedy text or failed with a clear error; the server finished exactly the
    completed ones. Returns (completed, failed)."""
    ok = [o for o in stream.outcomes if o.status == 200]
    failed = [o for o in stream.outcomes if o.status != 200]
    assert not [o for o in failed if o.status == 0], "a request got no answer within 60 s"
    for o in ok:
        assert o.text == oracle(o.prompt, MAX_TOKENS)[1], o
    for o in failed:
        assert o.status == 503 and o.error and ("worker" in o.error or "retry" in o.error.lower()), o
    assert _finished_on_server(server) - finished_before == len(ok)
    return len(ok), len(failed)


def test_groups_on_the_nodes_asked_for_and_greedy_output_of_one_process(cluster, oracle) -> None:
    server, nodes = cluster
    where = _group_nodes()
    head = ray.get_runtime_context().get_node_id()  # the driver runs on the head
    assert where == {"target": [nodes.target.node_id] * REPLICAS, "draft": [nodes.draft.node_id] * REPLICAS,
                     "router": sorted([head, nodes.router.node_id])}, where
    with server.http() as c:
        for prompt in PROMPTS[:3]:
            r = c.post("/v1/completions", json=_body(prompt))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["text"] == oracle(prompt, MAX_TOKENS)[1]
            assert body["spec_decode"]["num_drafts"] > 0  # the draft on its node proposed
        series = {k: v for k, v in scrape(c).items() if k.startswith("specserve_worker_group_node_info")}
    # Summed over the replicas: both replicas' groups on the same two nodes.
    assert series == {f'specserve_worker_group_node_info{{node_id="{nodes.target.node_id}",rank="0",role="target"}}':
                      REPLICAS, f'specserve_worker_group_node_info{{node_id="{nodes.draft.node_id}",rank="0",'
                      'role="draft"}': REPLICAS}, series


def test_draft_node_lost_under_load_loses_no_request(cluster, oracle) -> None:
    server, nodes = cluster
    before = _finished_on_server(server)
    with SteadyStream(server) as stream:
        stream.wait_completed(3, 60)
        t_fault = time.monotonic()
        nodes.replace("draft")
        degraded_s = _wait_for("serving without the draft", lambda: not _health(server)[1]["speculation"], 30)
        done = stream.completed()
        stream.wait_completed(done + 3, 60)  # the target alone keeps serving
        new_node = nodes.add("draft")
        back_s = _wait_for("a new draft group", lambda: _health(server)[1]["speculation"], 90)
        done = stream.completed()
        stream.wait_completed(done + 2, 60)
    completed, failed = _account(stream, oracle, before, server)
    assert failed == 0, [o for o in stream.outcomes if o.status != 200]
    assert _group_nodes()["draft"] == [new_node] * REPLICAS
    in_flight = sorted(o.end - o.start for o in stream.outcomes if o.start < t_fault < o.end)
    assert in_flight, "no request was in flight when the node went"
    p99 = in_flight[min(len(in_flight) - 1, int(0.99 * len(in_flight)))]
    normal = [o.end - o.start for o in stream.outcomes if o.end < t_fault]
    print(f"\ndraft node lost: {completed} completed, 0 failed; speculation off after {degraded_s:.1f} s, back "
          f"{back_s:.1f} s after the node returned; requests in flight at the loss: {len(in_flight)}, p99 "
          f"{p99:.2f} s (before the loss: median {statistics.median(normal):.2f} s)")


def test_target_node_lost_under_load_fails_in_flight_clearly_then_serves(cluster, oracle) -> None:
    server, nodes = cluster
    _wait_for("healthy", lambda: _health(server)[0] == 200 and _health(server)[1]["speculation"], 60)
    before = _finished_on_server(server)
    with SteadyStream(server) as stream:
        stream.wait_completed(3, 60)
        t_fault = time.monotonic()
        nodes.replace("target")
        _wait_for("unhealthy", lambda: _health(server)[0] == 503, 30)
        new_node = nodes.add("target")
        back_s = _wait_for("serving again", lambda: _health(server)[0] == 200, 150)
        done = stream.completed()
        stream.wait_completed(done + 3, 60)
    completed, failed = _account(stream, oracle, before, server)
    in_flight = [o for o in stream.outcomes if o.start < t_fault < o.end]
    assert in_flight and all(o.status == 503 for o in in_flight if o.end > t_fault + 1), in_flight
    assert failed >= 1
    where = _group_nodes()
    assert where["target"] == [new_node] * REPLICAS and where["draft"] == [nodes.draft.node_id] * REPLICAS, where
    print(f"\ntarget node lost: {completed} completed, {failed} failed with 503; serving again {back_s:.1f} s "
          "after the node returned")


def _node_alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def test_router_node_lost_the_other_replica_serves_on(cluster, oracle) -> None:
    """The node of one engine replica's router goes (its worker groups go with their owner): the other replica
    keeps serving the stream; Serve starts a replacement once a node brings the router's resource back."""
    server, nodes = cluster
    _wait_for("both replicas serving", lambda: _health(server)[0] == 200
              and _health(server)[1]["engine_replicas_serving"] == REPLICAS, 120)
    with SteadyStream(server) as stream:
        stream.wait_completed(3, 60)
        t_fault = time.monotonic()
        lost = nodes.replace("router")
        # Until Ray marks the node dead, the lost router's process may still finish a request or two (its worker
        # groups are on nodes that live on). Only requests sent after that show that the other replica serves: on
        # an idle machine a request takes a fraction of a second, so counting completions from the fault on would
        # count the ones that were in flight or sent within that second.
        dead_s = _wait_for("Ray marking the router's node dead", lambda: not _node_alive(lost), 30)
        t_dead = time.monotonic()

        def served_after() -> list[Outcome]:
            return [o for o in stream.outcomes if o.start > t_dead and o.status == 200]

        _wait_for("3 requests sent after the node was marked dead served", lambda: len(served_after()) >= 3, 60)
        first_s = min(o.end for o in served_after()) - t_fault
        new_node = nodes.add("router")
        back_s = _wait_for("the replacement replica", lambda: _health(server)[1]["engine_replicas_serving"]
                           == REPLICAS, 150)
        done = stream.completed()
        stream.wait_completed(done + 2, 60)
    ok = [o for o in stream.outcomes if o.status == 200]
    failed = [o for o in stream.outcomes if o.status != 200]
    assert not [o for o in failed if o.status == 0], "a request got no answer within 60 s"
    for o in ok:
        assert o.text == oracle(o.prompt, MAX_TOKENS)[1], o
    for o in failed:  # only requests that were on the lost replica, with a clear error
        assert o.status in (500, 503) and o.error and o.start < t_fault + 15, o
    assert new_node in _group_nodes()["router"]
    print(f"\nrouter node lost: {len(ok)} completed, {len(failed)} failed; the node marked dead after {dead_s:.1f} s, "
          f"the first request sent after that served {first_s:.1f} s after the loss; the replacement replica served "
          f"{back_s:.1f} s after the node returned")
