"""Shared helpers of the serving tests: a real local Ray + Serve server on 127.0.0.1 (HTTP and gRPC), the
router's own view of its requests and KV blocks, and the checks several modules make of a running server. The tiny
models they serve are tests/byte_models.py's."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
# `specserve serve` in a process of its own, run from this checkout's code.
SERVE_CLI = [sys.executable, "-c", "import sys; from deploy.cli import main; sys.exit(main())", "serve"]

# Below the kernel's ephemeral range (32768-60999 on Linux) and above Ray's worker ports (10002-19999): a port
# the OS hands out for "port 0" can be taken by any other socket (a Ray process's) between our check and the
# server's own bind, as CI once saw for Serve's gRPC proxy; a port in this range is only taken by an explicit bind.
_PORT_RANGE = (20000, 32000)
_ports_given: set[int] = set()


def _families() -> list[tuple[socket.AddressFamily, str]]:
    families = [(socket.AF_INET, "0.0.0.0")]
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
        families.append((socket.AF_INET6, "::"))
    except OSError:  # no IPv6 on this machine: gRPC's [::] bind falls back to IPv4 there
        pass
    return families


_FAMILIES = _families()


def free_port() -> int:
    """A port free on every interface (gRPC binds [::]) that this process has not handed out before."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(*_PORT_RANGE)
        if port in _ports_given:
            continue
        try:
            for family, addr in _FAMILIES:
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    s.bind((addr, port))
        except OSError:
            continue
        _ports_given.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORT_RANGE}")


@dataclass
class Server:
    base: str
    grpc_target: str
    model: str
    headers: dict[str, str]

    def http(self, timeout: float = 60.0, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=timeout, headers=kw.pop("headers", self.headers), **kw)


def wait_for_serve_cli(proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """Wait until the `specserve serve` process `proc`, writing to `log`, says it is up; the log by then. Fails with
    the log's end if the process exits first, or if `timeout_s` seconds pass."""
    deadline = time.monotonic() + timeout_s
    while "Ctrl-C to stop." not in log.read_text():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"the server did not start in {timeout_s:g} s"
        time.sleep(0.5)
    return log.read_text()


def serve_config(target: str, draft: str | None, **overrides: Any) -> dict[str, Any]:
    """ServeConfig fields of a small, fast CPU server: short context, small blocks, a bounded KV pool."""
    engine_kwargs = {"block_size": 4, "num_kv_blocks": 256, "max_num_batched_tokens": 64}
    engine_kwargs.update(overrides.pop("engine_kwargs", {}))
    cfg = {"model": target, "draft_model": draft or "none", "num_speculative_tokens": 3,
           "rejection_sampling": "strict", "max_model_len": 128, "device": "cpu", "served_model_name": "tiny",
           "engine_kwargs": engine_kwargs}
    cfg.update(overrides)
    return cfg


@contextmanager
def running_server(config: dict[str, Any], num_cpus: int = 6, address: str | None = None,
                   proxy_location: str | None = None) -> Iterator[Server]:
    """A local Ray with Serve's HTTP and gRPC proxies on 127.0.0.1 serving `config` (ServeConfig fields).
    address: join that running cluster (a ray.cluster_utils.Cluster's) instead of starting one of num_cpus;
    proxy_location: Serve's (e.g. HeadOnly, so that no proxy runs on a node a test removes)."""
    import ray
    from ray import serve

    from deploy.app import build_app
    from serving.grpc_service import SERVICER_FUNCTION

    http_port, grpc_port = free_port(), free_port()
    from deploy.app import apply_local_cluster_env

    # An ingress replica behind HAProxy that stops waits this long for HAProxy to stop sending it connections: a
    # test server's shutdown need not (before apply_local_cluster_env, which would set specserve's 5 s).
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")
    # HAProxy's stats and metrics ports are fixed (8404, 9101) unless set: free ones, as for the HTTP and gRPC ports.
    os.environ["RAY_SERVE_HAPROXY_STATS_PORT"], os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"] = (
        str(free_port()), str(free_port()))
    apply_local_cluster_env(config)  # the Serve process settings `specserve serve` runs with
    where: dict[str, Any] = ({"address": address} if address
                             else {"address": "local", "num_cpus": num_cpus, "include_dashboard": False})
    ray.init(**where, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false",
                                       "OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                    **({"proxy_location": proxy_location} if proxy_location else {}),
                    grpc_options={"port": grpc_port, "grpc_servicer_functions": [SERVICER_FUNCTION]})
        serve.run(build_app(dict(config)), name=APP, route_prefix="/")
        key = config.get("api_key")
        yield Server(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}",
                     config.get("served_model_name") or config["model"],
                     {"Authorization": f"Bearer {key}"} if key else {})
    finally:
        serve.shutdown()
        ray.shutdown()


# --- the engine replicas' view ---------------------------------------------------------------------------
APP = "specserve"


def engine_replica_actors() -> dict[str, Any]:
    """The engine replicas' Serve actors: replica label (Serve's unique id) -> actor handle."""
    import ray

    from serving.engine_deployment import ENGINE_DEPLOYMENT

    tag = f"#{ENGINE_DEPLOYMENT}#"
    return {a["name"].rsplit("#", 1)[1]: ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True) if tag in a["name"]}


def router_handle(replica: str | None = None) -> Any:
    """The Serve actor of engine replica `replica` (None: the only one)."""
    actors = engine_replica_actors()
    if replica is None:
        if len(actors) != 1:
            raise LookupError(f"expected one engine replica, found {sorted(actors)}")
        return next(iter(actors.values()))
    return actors[replica]


def router_call(fn: Any, replica: str | None = None, timeout_s: float = 60.0) -> Any:
    """fn(router) run inside an engine replica's process, on its Router (serving.engine_deployment.EngineReplica):
    the tests' way to look at (or break) what only the replica holds."""
    import ray

    def call(actor: Any) -> Any:
        return fn(actor._replica_impl._user_callable_wrapper.user_callable)

    return ray.get(router_handle(replica).__ray_call__.remote(call), timeout=timeout_s)


def engine_broadcast(method: str, *args: Any, timeout_s: float = 30.0) -> list[Any]:
    """Every engine replica's answer to `method` (Serve's broadcast through a deployment handle)."""
    from ray import serve

    from serving.engine_deployment import ENGINE_DEPLOYMENT

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP)
    return handle.broadcast(method, *args).results(timeout_s=timeout_s)


def router_stats(timeout_s: float = 30.0) -> dict[str, Any]:
    """The only engine replica's stats."""
    stats = engine_broadcast("stats", timeout_s=timeout_s)
    if len(stats) != 1:
        raise LookupError(f"expected one engine replica, found {[s['replica'] for s in stats]}")
    return stats[0]


def kv_blocks_used(stats: dict[str, Any]) -> dict[str, int]:
    """KV blocks in use per `model/group` (both models, every KV-cache group)."""
    return dict(stats["kv_blocks_used"])


def wait_idle(timeout_s: float = 30.0, baseline: dict[str, int] | None = None) -> dict[str, Any]:
    """Poll the router until no request runs, waits or streams and every KV-cache group of both models is back
    to `baseline` (default: no blocks held); returns the last stats (the caller asserts on them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stats = router_stats()
        except LookupError:
            stats = None
        if stats is not None:
            used = kv_blocks_used(stats)
            base = baseline if baseline is not None else {k: 0 for k in used}
            if (stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_streams"] == 0
                    and used == base):
                return stats
        if time.monotonic() > deadline:
            return stats or {}
        time.sleep(0.1)


def assert_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """An OpenAI-shaped error with this status; returns its `error` object."""
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    return err


def sse_payloads(text: str) -> list[str]:
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def completion(server: Server, client: httpx.Client, prompt: str = "hello", max_tokens: int = 8,
               **extra: Any) -> httpx.Response:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    return client.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})


def worker_handles(replica: str | None = None) -> dict[str, tuple[str, Any]]:
    """An engine replica's model workers: actor id (hex) -> (role, actor handle)."""
    return router_call(lambda r: {w._actor_id.hex(): (role, w) for role, _, w in r.engine.workers()}, replica)


def kill_worker(role: str, replica: str | None = None) -> str:
    """Kill the first `role` worker by its actor id, as a crashed GPU process would die; returns the id."""
    import ray

    actor_id, (_, handle) = next((aid, v) for aid, v in worker_handles(replica).items() if v[0] == role)
    ray.kill(handle, no_restart=True)
    return actor_id


def scrape(client: httpx.Client, by_replica: bool = False) -> dict[str, float]:
    """`/metrics` as {sample name with sorted labels: value}: summed over the engine replicas (their `replica`
    label dropped: the totals; with one replica, its values), or per replica with `by_replica`."""
    from prometheus_client.parser import text_string_to_metric_families

    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            assert "replica" in sample.labels, sample  # every engine series says which replica it is
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())
                              if by_replica or k != "replica")
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            values[key] = values.get(key, 0.0) + sample.value
    return values


def sse_events(resp: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body; checks the framing on the way."""
    body = resp.text
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def stream_text(lines: Iterator[str], on_text: Callable[[], None] | None = None
                ) -> tuple[str, str | None, list[dict]]:
    """Concatenated text, the finish reason and any in-band error events of an SSE stream of completions;
    on_text: called after each event that carried text."""
    text, finish, errors = "", None, []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        if "error" in event:
            errors.append(event["error"])
            continue
        text += event["choices"][0]["text"]
        finish = event["choices"][0]["finish_reason"] or finish
        if on_text is not None:
            on_text()
    return text, finish, errors


def streamed_completion(client: httpx.Client, body: dict[str, Any]) -> tuple[list[int], str]:
    """(token ids, text) of a streamed completion (`body` with stream and return_token_ids on)."""
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


def check_disconnect_frees_kv(server: Server, body: dict[str, Any], events: int = 1) -> None:
    """A client that reads the first `events` events of a long stream (`body`) and hangs up: both models held KV
    blocks mid-stream, and every block is back and the abort counted within 20 s."""
    baseline = kv_blocks_used(wait_idle())
    assert set(baseline.values()) == {0}, baseline
    with server.http() as c:
        aborted = scrape(c).get("specserve_request_aborted_total", 0.0)
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = (line for line in r.iter_lines() if line)
            for _ in range(events):
                assert next(lines).startswith("data: ")
            held = kv_blocks_used(router_stats())
        closed = time.monotonic()
        stats = wait_idle(timeout_s=20, baseline=baseline)
        assert kv_blocks_used(stats) == baseline, stats
        assert time.monotonic() - closed < 10
        assert scrape(c)["specserve_request_aborted_total"] == aborted + 1
    assert held["target/0"] > 0 and held["draft/0"] > 0, held  # both models held blocks mid-stream
