"""Monitoring end to end: a real Prometheus scrapes a running specserve and its Ray, and every PromQL expression of
the Grafana dashboard and of the alert rules returns data.

The server is deployed the way KubeRay deploys it: the RayService's serveConfigV2 (k8s/base/rayservice.yaml) is
validated as Ray Serve's config and applied through the Serve controller, as Ray's dashboard does when KubeRay
submits it, on a local Ray that offers the target and draft pools' custom resources. Only the models are swapped
for tiny byte-level ones (tests/serve_support.py) and the endpoints moved to free ports on 127.0.0.1.

Prometheus (Debian's build, started here) scrapes the app's /metrics as the ServiceMonitor does (job="specserve")
and Ray's metrics export port as the PodMonitor does (job="ray"), with the namespace and ray_io_cluster labels the
operator adds, and loads the PrometheusRule's groups as its rule file.

Dashboard: each query, with Grafana's variables substituted ("All" for namespace and cluster), must return at least
one series with a number (not NaN). Alerts: Prometheus evaluates every rule without error, and every signal of a
rule (its expression less the threshold comparisons, k8s_support.promql_signals) must return series: an alert
watching a series nobody exports could never fire. The thresholds themselves are not crossed by a healthy test
server, so firing is not asserted.
"""

from __future__ import annotations

import math
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml
from byte_models import make_byte_models
from k8s_support import (
    RAYSERVICE,
    alert_rules,
    dashboard,
    dashboard_queries,
    grafana_to_promql,
    load_docs,
    promql_signals,
    ray_start_resources,
    require_tool,
    rules_file_text,
)
from serve_support import REPO, completion, free_port, serve_config

pytestmark = pytest.mark.slow

LABELS = {"namespace": "specserve", "ray_io_cluster": "specserve-test"}  # what the operator's discovery adds
ALL = {"namespace": ".*", "cluster": ".*"}  # Grafana's "All" (allValue) for the dashboard's variables


@dataclass
class Stack:
    prometheus: str  # base URL of the Prometheus HTTP API
    app: str  # base URL of specserve's HTTP endpoint

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr!r}: {body}"
        data = body["data"]
        return data["result"] if data["resultType"] in ("vector", "matrix") else [{"value": data["result"]}]


def _deploy_serve_config(target: str, draft: str, http_port: int, grpc_port: int) -> dict[str, Any]:
    """The RayService's serveConfigV2 with tiny models on free local ports, applied as Ray's dashboard applies it
    for KubeRay (ray/dashboard/modules/serve: start Serve with the config's options, then deploy_apps)."""
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    (rs,) = load_docs(RAYSERVICE)
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    config["http_options"].update(host="127.0.0.1", port=http_port)
    config["grpc_options"]["port"] = grpc_port
    (app,) = config["applications"]
    tiny = serve_config(target, draft)
    app["args"].update(model=target, draft_model=draft, served_model_name=tiny["served_model_name"],
                       max_model_len=tiny["max_model_len"], device="cpu")
    app["args"]["engine_kwargs"] = {**app["args"]["engine_kwargs"], **tiny["engine_kwargs"]}
    schema = ServeDeploySchema.model_validate(config)
    client = serve_start(http_options=schema.http_options.model_dump(),
                         grpc_options=schema.grpc_options.model_dump(), proxy_location=schema.proxy_location,
                         global_logging_config=schema.logging_config, controller_options=schema.controller_options)
    client.deploy_apps(schema)
    return app


def _wait_running(name: str, timeout_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(name)
        status = app.status if app else None
        if status == "RUNNING":
            return
        if status == "DEPLOY_FAILED" or time.monotonic() > deadline:
            raise AssertionError(f"application {name} is {status}: {app.message if app else 'not deployed'}")
        time.sleep(0.5)


def _prometheus_config(app_port: int, ray_port: int) -> str:
    return yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [
            {"job_name": "specserve", "metrics_path": "/metrics",
             "static_configs": [{"targets": [f"127.0.0.1:{app_port}"], "labels": LABELS}]},
            {"job_name": "ray", "metrics_path": "/metrics",
             "static_configs": [{"targets": [f"127.0.0.1:{ray_port}"], "labels": LABELS}]},
        ]})


def _wait_for(stack: Stack, expr: str, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not stack.query(expr):
        assert time.monotonic() < deadline, f"{what}: no data for {expr!r} within {timeout_s:.0f} s"
        time.sleep(0.5)


def _traffic(app: str, model: str) -> None:
    """Rounds of concurrent completions, a second apart, so counters grow across several scrapes (rate() needs
    two samples that differ) and requests overlap (running > 1, per-position acceptance, ITL)."""
    from serve_support import Server

    server = Server(app, "", model, {})
    with httpx.Client(base_url=app, timeout=120) as client, ThreadPoolExecutor(3) as pool:
        drafts = 0
        for i in range(4):
            prompts = [f"round {i} request {j}: the sea is" for j in range(3)]
            responses = list(pool.map(lambda p: completion(server, client, prompt=p, max_tokens=24), prompts))
            for r in responses:
                assert r.status_code == 200, r.text
                drafts += r.json()["spec_decode"]["num_drafts"]
            time.sleep(1.0)
        # Speculation ran, so its series exist (the draft length rule, on as by default, may stop drafting with this
        # random draft once it has measured it: its own series must have data too).
        assert drafts > 0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prometheus = require_tool("prometheus", "prometheus")
    import ray
    from ray import serve

    root = tmp_path_factory.mktemp("monitoring")
    target, draft = make_byte_models(root)
    (rs,) = load_docs(RAYSERVICE)
    pools: dict[str, float] = {}
    for group in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        pools.update(ray_start_resources(group["rayStartParams"]))
    http_port, grpc_port, ray_port, prom_port = (free_port() for _ in range(4))
    (root / "rules.yaml").write_text(rules_file_text())
    (root / "prometheus.yml").write_text(_prometheus_config(http_port, ray_port))

    from serving import serve_process_env

    serve_process_env.apply()  # the Serve process settings `specserve serve` runs with
    ray.init(address="local", num_cpus=6, resources=pools, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=ray_port,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false",
                                       "OMP_NUM_THREADS": "1"}})
    proc = None
    try:
        app = _deploy_serve_config(target, draft, http_port, grpc_port)
        proc = subprocess.Popen(
            [prometheus, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(root / "prometheus.log", "w"))
        _wait_running(app["name"], timeout_s=240)
        stack = Stack(f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{http_port}")
        # Counters must be scraped before the traffic, or their first sample already holds it and rate() is 0.
        _wait_for(stack, 'up{job="specserve"} == 1', 30, "Prometheus scraping the app's /metrics")
        _traffic(stack.app, app["args"]["served_model_name"])
        # Ray's metrics agent exports Serve's controller gauges every few seconds.
        _wait_for(stack, "ray_serve_deployment_replica_healthy", 60, "Ray's metrics export")
        time.sleep(2.5)  # a few more scrapes and rule evaluations after the last request
        yield stack
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        serve.shutdown()
        ray.shutdown()


def _numbers(result: list[dict[str, Any]]) -> list[float]:
    out = []
    for series in result:
        samples = series.get("values") or [series["value"]]
        out += [float(v) for _, v in samples]
    return out


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    def has_data(expr: str) -> bool:
        return any(math.isfinite(v) for v in _numbers(stack.query(grafana_to_promql(expr, ALL))))

    missing = {where: expr for where, expr in dashboard_queries() if not has_data(expr)}
    # A scrape that timed out (1 s, on a loaded machine) marks the app's gauges stale until the next one succeeds:
    # ask again for a few seconds before calling a query empty.
    deadline = time.monotonic() + 15
    while missing and time.monotonic() < deadline:
        time.sleep(0.5)
        missing = {where: expr for where, expr in missing.items() if not has_data(expr)}
    assert not missing, "dashboard queries without data:\n" + "\n".join(f"{w}: {e}" for w, e in missing.items())


def test_dashboard_values_are_sane(stack: Stack) -> None:
    """The same queries read what the server did: acceptance rate in [0, 1], acceptance length in [1, k+1], per
    position acceptance never rising with position, tokens generated."""
    queries = {where.split(" / ")[0]: grafana_to_promql(expr, ALL) for where, expr in dashboard_queries()}
    (rate,) = _numbers(stack.query(queries["Acceptance rate"]))
    (length,) = _numbers(stack.query(queries["Acceptance length"]))
    assert 0 <= rate <= 1 and 1 <= length <= 1 + 4, (rate, length)
    by_pos = {int(s["metric"]["position"]): float(s["value"][1])
              for s in stack.query(queries["Acceptance by position (time range)"])}
    ordered = [by_pos[p] for p in sorted(by_pos)]
    assert ordered == sorted(ordered, reverse=True) and all(0 <= v <= 1 for v in ordered), by_pos
    assert max(_numbers(stack.query(queries["Output tokens/s"]))) > 0


def test_dashboard_variables_have_values(stack: Stack) -> None:
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"])
        assert m, var["definition"]
        selector, label = grafana_to_promql(m.group(1), ALL), m.group(2)
        r = httpx.get(f"{stack.prometheus}/api/v1/series", params={"match[]": selector}, timeout=10).json()
        values = {s.get(label) for s in r["data"]} - {None}
        assert values == {LABELS[label]}, (var["name"], r)


def test_alert_rules_evaluate_and_watch_live_series(stack: Stack) -> None:
    expected = {r["alert"] for r in alert_rules()}
    deadline = time.monotonic() + 30
    while True:  # every rule evaluated at least once since the traffic
        groups = httpx.get(f"{stack.prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"]}
        if set(rules) == expected and all(r.get("lastEvaluation", "").startswith("2") for r in rules.values()):
            break
        assert time.monotonic() < deadline, rules
        time.sleep(0.5)
    for name, rule in rules.items():
        assert rule["health"] == "ok" and not rule.get("lastError"), (name, rule)
        assert rule["state"] != "firing", (name, rule)  # a healthy, idle test server trips none of them
    missing = [f"{rule['alert']}: {signal}" for rule in alert_rules() for signal in promql_signals(rule["expr"])
               if not stack.query(signal)]
    assert not missing, "alert signals without series:\n" + "\n".join(missing)
