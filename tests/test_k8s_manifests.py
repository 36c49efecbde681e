"""The k8s/ manifests: every object validates against its schema (KubeRay and prometheus-operator CRDs, Kubernetes'
own kinds), both overlays render with kustomize and validate too, the pieces refer to each other correctly
(selectors, ports, custom resources, volumes), the serveConfigV2 validates as Ray Serve's config and its import
path builds the app, and the dashboard and alert rules read metrics that exist. Fast: no cluster, no Ray.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml
from k8s_support import (
    DASHBOARD,
    OVERLAYS,
    REPO,
    alert_rules,
    by_kind,
    dashboard,
    dashboard_panels,
    dashboard_queries,
    find_tools,
    grafana_to_promql,
    load_docs,
    manifest_files,
    metric_names,
    pod_templates,
    promql_signals,
    ray_start_resources,
    render,
    require_tool,
    rules_file_text,
    validation_errors,
)

# Ray's own series the dashboard and alerts read (from the PodMonitor), and Prometheus' `up`.
RAY_METRICS = {"ray_serve_deployment_replica_healthy", "ray_serve_autoscaling_target_replicas", "up"}


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    kubectl = require_tool("kubectl", "kubernetes-client")
    return request.param, render(kubectl, request.param)


def _rayservice(objects: list[dict]) -> dict:
    (rs,) = by_kind(objects, "RayService")
    return rs


def _containers(template: dict) -> list[dict]:
    return template["spec"]["containers"]


# --- schemas ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_manifest_validates_against_its_schema(path) -> None:
    docs = load_docs(path)
    assert docs, f"{path} holds no object"
    for obj in docs:
        assert validation_errors(obj) == [], f"{path}: {obj.get('kind')} {obj['metadata'].get('name')}"


def test_schema_check_rejects_a_misspelt_field() -> None:
    """The check must be able to fail: a typo deep in a RayService pod template, a wrong type in a PodMonitor,
    an unknown field in a core Service."""
    (rs,) = load_docs(REPO / "k8s" / "base" / "rayservice.yaml")
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelecter"] = {"a": "b"}
    assert any("nodeSelecter" in e for e in validation_errors(rs))
    (pm,) = load_docs(REPO / "k8s" / "monitoring" / "podmonitor.yaml")
    pm["spec"]["podMetricsEndpoints"][0]["interval"] = 15
    assert validation_errors(pm)
    (svc,) = load_docs(REPO / "k8s" / "base" / "metrics-service.yaml")
    svc["spec"]["portz"] = []
    assert validation_errors(svc)


def test_rendered_overlay_validates(rendered) -> None:
    overlay, objects = rendered
    kinds = sorted(o["kind"] for o in objects)
    assert {"RayService", "Service", "ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap",
            "Namespace"} <= set(kinds), kinds
    for obj in objects:
        assert validation_errors(obj) == [], f"{overlay}: {obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "specserve", obj["metadata"]


def test_every_kubectl_renders_the_same() -> None:
    """kubectl's built-in kustomize differs by version (Debian's kubernetes-client has v2.0.3, current kubectl
    v5): the overlays stick to what both read, and both must give the same objects."""
    kubectls = find_tools("kubectl")
    if len(kubectls) < 2:
        pytest.skip(f"only {len(kubectls)} kubectl found; comparing kustomize versions needs two")
    for overlay in OVERLAYS:
        outs = [sorted(render(k, overlay), key=lambda o: (o["kind"], o["metadata"]["name"])) for k in kubectls]
        assert all(o == outs[0] for o in outs[1:]), overlay


# --- the overlays -------------------------------------------------------------------------------------------
def test_gpu_and_cpu_pools(rendered) -> None:
    overlay, objects = rendered
    templates = pod_templates(_rayservice(objects))
    assert set(templates) == {"head", "target", "draft"}
    for name, template in templates.items():
        for c in _containers(template):
            gpus = {**c["resources"].get("requests", {}), **c["resources"].get("limits", {})}.get("nvidia.com/gpu")
            expect_gpu = overlay.startswith("gpu") and name != "head"
            assert (gpus is not None and int(gpus) >= 1) == expect_gpu, (overlay, name, c["resources"])
            assert c["image"] == f"specserve:0.1.0-{'cuda' if overlay.startswith('gpu') else 'cpu'}", c["image"]
        spec = template["spec"]
        if overlay.startswith("gpu") and name != "head":
            assert spec["nodeSelector"] == {"specserve.io/pool": name}
            assert {"nvidia.com/gpu", "specserve.io/pool"} <= {t["key"] for t in spec["tolerations"]}
        else:
            assert "nodeSelector" not in spec and "tolerations" not in spec, (overlay, name)


def test_every_pod_runs_serve_with_the_process_settings_of_specserve_serve(rendered) -> None:
    """Serve reads its event-loop settings in each process: every pod (head: the ingress and routers; target and
    draft: their ranks) carries serving/serve_process_env.py's values, as the CLI's local cluster does, and HAProxy
    in front of the ingress (what `http_proxy: auto` picks for GPU engines)."""
    from serving.serve_process_env import HAPROXY_ENV, SERVE_PROCESS_ENV

    _, objects = rendered
    for name, template in pod_templates(_rayservice(objects)).items():
        for c in _containers(template):
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert {k: env.get(k) for k in SERVE_PROCESS_ENV} == SERVE_PROCESS_ENV, (name, env)
            assert env.get(HAPROXY_ENV) == "1", (name, env)


def test_models_volume(rendered) -> None:
    """The GPU overlay mounts the ReadWriteMany models claim it creates on every pod; the CPU demo has no claim."""
    overlay, objects = rendered
    claims = {o["metadata"]["name"] for o in by_kind(objects, "PersistentVolumeClaim")}
    for name, template in pod_templates(_rayservice(objects)).items():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        for c in _containers(template):
            assert {m["name"] for m in c["volumeMounts"]} <= set(volumes), name
            assert any(m["mountPath"] == "/models" for m in c["volumeMounts"]), name
        models = volumes["models"]
        if overlay.startswith("gpu"):
            assert models["persistentVolumeClaim"]["claimName"] in claims, (name, claims)
        else:
            assert "emptyDir" in models and not claims, (name, claims)
    if overlay.startswith("gpu"):
        (pvc,) = by_kind(objects, "PersistentVolumeClaim")
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_monitors_select_what_exists(rendered) -> None:
    """ServiceMonitor -> the metrics Service -> the head pod's Serve port; PodMonitor -> every Ray pod's metrics
    port. A label or port name out of step would leave Prometheus with nothing to scrape."""
    _, objects = rendered
    templates = pod_templates(_rayservice(objects))
    (svc,) = [s for s in by_kind(objects, "Service") if s["metadata"]["name"] == "specserve-metrics"]
    (smon,) = by_kind(objects, "ServiceMonitor")
    (pmon,) = by_kind(objects, "PodMonitor")
    assert _selects(smon["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    selected = [n for n, t in templates.items() if _selects(svc["spec"]["selector"], t["metadata"]["labels"])]
    assert selected == ["head"], selected  # one scrape per Ray cluster: the router's metrics, once
    head_ports = {p["name"]: p["containerPort"] for c in _containers(templates["head"]) for p in c["ports"]}
    for endpoint in smon["spec"]["endpoints"]:
        (port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
        assert head_ports["serve"] == port["targetPort"] == 8000
        assert endpoint["path"] == "/metrics"
    for name, template in templates.items():
        assert _selects(pmon["spec"]["selector"]["matchLabels"], template["metadata"]["labels"]), name
        ports = {p["name"]: p["containerPort"] for c in _containers(template) for p in c["ports"]}
        for endpoint in pmon["spec"]["podMetricsEndpoints"]:
            assert ports.get(endpoint["port"]) == 8080, (name, ports)
    head_params = _rayservice(objects)["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert head_params["metrics-export-port"] == "8080"


def test_dashboard_configmap_is_the_dashboard(rendered) -> None:
    _, objects = rendered
    (cm,) = by_kind(objects, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert yaml.safe_load(cm["data"]["specserve.json"]) == dashboard()


# --- serveConfigV2 ------------------------------------------------------------------------------------------
def test_serve_config_imports_and_builds_the_app(rendered) -> None:
    """What KubeRay's serveConfigV2 goes through on the head: Ray Serve's config schema, then the controller's
    own import-and-build of each application (the builder called with `args`), then the custom resources that
    pin the target's and draft's ranks to their pools."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app
    from ray.serve.schema import ServeDeploySchema

    from deploy.config import ServeConfig
    from engine.models.source import BUNDLED_MODELS, resolve_model
    from serving.app import DEPLOYMENT_NAME
    from serving.draft_pool.pool import DRAFT_DEPLOYMENT
    from serving.engine_deployment import ENGINE_DEPLOYMENT

    _, objects = rendered
    rs = _rayservice(objects)
    config = ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    assert config.http_options.port == 8000 and config.grpc_options.port == 9000
    for fn in config.grpc_options.grpc_servicer_functions:
        assert callable(import_attr(fn)), fn
    (app_cfg,) = config.applications
    app = call_user_app_builder_with_args_if_necessary(import_attr(app_cfg.import_path), app_cfg.args)
    built = build_app(app, name=app_cfg.name, route_prefix=app_cfg.route_prefix)
    pool = [DRAFT_DEPLOYMENT] if ServeConfig.from_dict(app_cfg.args).uses_draft_pool() else []
    assert sorted(d.name for d in built.deployments) == sorted([DEPLOYMENT_NAME, ENGINE_DEPLOYMENT, *pool])
    assert built.ingress_deployment_name == DEPLOYMENT_NAME

    engine_args = ServeConfig.from_dict(app_cfg.args).engine_args()
    for model in (engine_args["model"], engine_args["draft_model"]):
        assert model in BUNDLED_MODELS, f"{model} is not baked into the image (deploy/Dockerfile)"
    resolve_model(engine_args["draft_model"])  # the bundled draft ships inside the package
    groups = {g["groupName"]: ray_start_resources(g["rayStartParams"])
              for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    head = ray_start_resources(rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"])
    for role in ("target", "draft"):
        wanted = engine_args[f"{role}_resources"]
        assert wanted, f"{role}_resources must pin the {role}'s ranks to the {role} pool"
        # The declared option (docs/configuration.md), not a pass-through engine_kwargs entry.
        assert app_cfg.args.get(f"{role}_resources") == wanted, app_cfg.args
        for resource, amount in wanted.items():
            offered = {g: r.get(resource, 0) for g, r in groups.items()}
            assert offered[role] >= amount and head.get(resource, 0) == 0, (resource, offered)
            assert all(v == 0 for g, v in offered.items() if g != role), (resource, offered)


def test_engine_autoscaling_has_pods_to_grow_into(rendered) -> None:
    """Serve may run up to max_replicas engine replicas, each with a target worker group and (without a draft pool)
    a draft worker group on its own pool: Ray's autoscaler must be on and every pool must be allowed the pods
    (custom resources) that many replicas ask for, and keep those that min_replicas needs. With a draft pool
    (draft_replicas, or draft_autoscaling_config's bounds) the draft's pods follow the draft replicas, apart from
    the engine replicas."""
    from deploy.config import ServeConfig

    _, objects = rendered
    rs = _rayservice(objects)
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (app_cfg,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    cfg = ServeConfig.from_dict(app_cfg["args"])
    cfg.validate()
    scaling = cfg.autoscaling_config
    assert scaling and scaling["max_replicas"] > scaling["min_replicas"] >= 1, scaling
    engine_args = cfg.engine_args()
    ranks = {"target": engine_args["tensor_parallel_size"], "draft": engine_args["draft_tensor_parallel_size"]}
    for group in cluster["workerGroupSpecs"]:
        role = group["groupName"]
        (resource, per_rank), = engine_args[f"{role}_resources"].items()
        per_pod = ray_start_resources(group["rayStartParams"])[resource]
        pods_per_replica = -(-ranks[role] * per_rank // per_pod)
        if role == "draft" and cfg.uses_draft_pool():
            draft_scaling = cfg.draft_autoscaling_config or {}
            lo = draft_scaling.get("min_replicas", 1) if draft_scaling else cfg.draft_replicas
            hi = draft_scaling.get("max_replicas", 1) if draft_scaling else cfg.draft_replicas
            # The draft's pods scale apart: none more than the pool needs at its smallest, as many as at its largest.
            assert group["minReplicas"] == lo * pods_per_replica, (role, group["minReplicas"])
            assert scaling["max_replicas"] > lo, "a pool shares each draft between several targets"
        else:
            lo, hi = scaling["min_replicas"], scaling["max_replicas"]
        assert group["maxReplicas"] >= hi * pods_per_replica, (role, group["maxReplicas"])
        assert group["minReplicas"] >= lo * pods_per_replica, (role, group["minReplicas"])
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], role


# --- dashboard and alerts -----------------------------------------------------------------------------------
def _engine_metric_names() -> set[str]:
    """The series names the router exports (and their histogram/counter suffixes)."""
    from serving.metrics import EngineMetrics

    m = EngineMetrics()
    m.on_spec(1, 3, 1, [1])
    m.on_step({"propose": 0.01}, 1, 0, 0, {("target", 0): 0.5}, 3.0, True)
    m.draft_rule.on_rule((10, 2, {"step_seconds": {0: 0.01}, "tokens_per_second": {0: 100.0},
                                  "acceptance": {1: 0.5}, "draft_forward_seconds": {0: 0.002}}))
    return {line.split("{")[0].split(" ")[0] for line in m.exposition().splitlines()
            if line and not line.startswith("#")}


def test_dashboard_reads_existing_metrics_and_covers_the_panels() -> None:
    known = _engine_metric_names() | RAY_METRICS
    for where, expr in dashboard_queries():
        unknown = metric_names(grafana_to_promql(expr, {"namespace": ".*", "cluster": ".*"})) - known
        assert not unknown, f"{where}: {sorted(unknown)} in {expr!r}"
    titles = " | ".join(p["title"].lower() for p in dashboard_panels())
    for wanted in ("acceptance rate", "acceptance length", "acceptance by position", "drafted vs accepted",
                   "time to first token", "inter-token latency", "end-to-end", "running and waiting",
                   "kv cache usage by model and kv-cache group", "step phase", "draft length", "prefix cache hit rate",
                   "draft length rule: k chosen per step", "draft length rule: estimated tokens/s"):
        assert wanted in titles, wanted
    kv = [e for _, e in dashboard_queries() if "kv_cache_usage_perc" in e and "by (model, kv_group)" in e]
    assert kv, "KV usage must be split per model and KV-cache group"


def test_dashboard_layout() -> None:
    dash = dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
    for p in dashboard_panels():
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    names = {v["name"] for v in dash["templating"]["list"]}
    assert names == {"datasource", "namespace", "cluster"}, names
    assert DASHBOARD.read_text().endswith("\n")


def test_alert_rules() -> None:
    known = _engine_metric_names() | RAY_METRICS
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    assert {"SpecServeAcceptanceCollapse", "SpecServeKVCacheNearlyFull", "SpecServeQueueGrowing",
            "SpecServeReplicasUnhealthy"} <= names, names
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        signals = promql_signals(rule["expr"])
        assert signals and all(s != rule["expr"].strip() for s in signals), rule["alert"]
        for s in signals:
            assert not metric_names(s) - known, (rule["alert"], s)


def test_promql_signals() -> None:
    assert promql_signals("(sum(rate(a[5m])) / sum(rate(b[5m]))) < 0.25") == ["sum(rate(a[5m])) / sum(rate(b[5m]))"]
    assert promql_signals('up{job="x", a!="b"} == 0') == ['up{job="x", a!="b"}']
    assert promql_signals("sum by (x) (a) > 0\nand\nsum by (x) (deriv(a[10m])) > 0") == [
        "sum by (x) (a)", "sum by (x) (deriv(a[10m]))"]
    assert promql_signals("sum by (d) (h) < on (d) group_left sum by (d) (t)") == ["sum by (d) (h)", "sum by (d) (t)"]
    assert promql_signals("band_or_more > 1") == ["band_or_more"]


def test_promtool_accepts_the_rules(tmp_path) -> None:
    promtool = require_tool("promtool", "prometheus")
    rules = tmp_path / "rules.yaml"
    rules.write_text(rules_file_text())
    proc = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(alert_rules())} rules found" in proc.stdout, proc.stdout
