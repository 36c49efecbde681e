"""Helpers of the Kubernetes and monitoring tests: the k8s/ manifests, their schemas, kustomize, the test-only
programs (Prometheus, kubectl), and the PromQL of the Grafana dashboard and the alert rules.

Schemas: the KubeRay and prometheus-operator CRDs are vendored under tests/data/crds (their README says from which
release). CRD schemas leave objects open, relying on the API server to prune or (with
strict field validation, kubectl's default) reject unknown fields; `closed_schema` closes them so that a
misspelt field fails here as `kubectl apply` would fail against a cluster. Core kinds are checked against the
Kubernetes JSON schemas that the kubernetes-validate package ships, in their strict form.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
OVERLAYS = ("cpu", "gpu", "gpu-draft-pool")  # gpu-draft-pool: the GPU layout with a draft pool
SCHEMAS = REPO / "tests" / "data" / "crds"
DASHBOARD = K8S / "monitoring" / "dashboards" / "specserve.json"
PROMETHEUS_RULE = K8S / "monitoring" / "prometheusrule.yaml"
RAYSERVICE = K8S / "base" / "rayservice.yaml"
TOOLS = REPO / ".tools" / "root" / "usr" / "bin"  # where `make test-tools` unpacks Debian's packages


# --- programs -----------------------------------------------------------------------------------------------
def find_tools(name: str) -> list[str]:
    """Every copy of `name` the tests may use: the one on PATH, then the one `make test-tools` unpacked."""
    found = [p for p in (shutil.which(name), TOOLS / name) if p and Path(p).is_file()]
    return list(dict.fromkeys(str(p) for p in found))


def require_tool(name: str, package: str) -> str:
    tools = find_tools(name)
    if not tools:
        pytest.skip(f"{name} not found on PATH or in .tools/: `make test-tools` unpacks Debian's {package} there")
    return tools[0]


# --- manifests ----------------------------------------------------------------------------------------------
def load_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifest_files() -> list[Path]:
    """Every YAML file under k8s/ that holds Kubernetes objects (not kustomizations or JSON patches)."""
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        docs = load_docs(path)
        if path.name == "kustomization.yaml" or any(not isinstance(d, dict) for d in docs):
            continue
        out.append(path)
    return out


def render(kubectl: str, overlay: str) -> list[dict[str, Any]]:
    """`kubectl kustomize k8s/overlays/<overlay>`, parsed."""
    proc = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, f"{kubectl} kustomize {overlay} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o.get("kind") == kind]


def pod_templates(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{"head" | worker group name: pod template} of a RayService."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster.get("workerGroupSpecs", []):
        out[group["groupName"]] = group["template"]
    return out


def ray_start_resources(params: dict[str, str]) -> dict[str, float]:
    """The custom resources of a rayStartParams `resources` value: JSON quoted once more for the shell."""
    raw = params.get("resources")
    if raw is None:
        return {}
    text = raw.strip()
    if text.startswith('"') and text.endswith('"'):
        text = json.loads(text)  # the shell's quoting: '"{\"a\": 1}"' -> {"a": 1}
    return {k: float(v) for k, v in json.loads(text).items()}


# --- schemas ------------------------------------------------------------------------------------------------
def require_schemas() -> Path:
    if not SCHEMAS.is_dir():
        raise FileNotFoundError(f"the vendored CRD schemas are missing: {SCHEMAS}")
    return SCHEMAS


def closed_schema(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists its properties and does not
    preserve unknown fields: what the API server's pruning and strict field validation enforce."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: closed_schema(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "not"):
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_schema(out["additionalProperties"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = closed_schema(out[key])
    return out


@cache
def crd_schemas() -> dict[tuple[str, str, str], dict[str, Any]]:
    """(group, version, kind) -> the closed openAPIV3Schema of every CRD under tests/data/crds."""
    out = {}
    for path in sorted(require_schemas().rglob("*.yaml")):
        for doc in load_docs(path):
            if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                key = (spec["group"], version["name"], spec["names"]["kind"])
                out[key] = closed_schema(version["schema"]["openAPIV3Schema"])
    return out


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def validation_errors(obj: dict[str, Any]) -> list[str]:
    """Schema errors of one Kubernetes object: custom kinds against their CRD, core kinds against Kubernetes'."""
    import jsonschema

    group, _, version = obj.get("apiVersion", "").rpartition("/")
    kind = obj.get("kind", "")
    meta = obj.get("metadata") or {}
    errors = []
    if not _DNS_LABEL.match(str(meta.get("name", ""))):
        errors.append(f"metadata.name {meta.get('name')!r} is not a DNS-1123 label")
    for field in ("labels", "annotations"):
        for key, value in (meta.get(field) or {}).items():
            if not isinstance(value, str):
                errors.append(f"metadata.{field}.{key} must be a string, got {value!r}")
    if group and group.endswith(("ray.io", "monitoring.coreos.com")):
        schema = crd_schemas().get((group, version, kind))
        if schema is None:
            return errors + [f"no CRD schema for {group}/{version} {kind} under {SCHEMAS}"]
        validator = jsonschema.Draft7Validator(schema)
        errors += [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                   for e in validator.iter_errors(obj)]
        return errors
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as e:
        errors.append(f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}")
    return errors


# --- PromQL -------------------------------------------------------------------------------------------------
_COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")
_SET_OPERATOR = re.compile(r"(?<![\w:])(and|or|unless)(?![\w:])")
_MODIFIER = re.compile(r"^\s*(bool|(on|ignoring|group_left|group_right)\s*(\([^)]*\))?)\s*")
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def _strip_parens(expr: str) -> str:
    expr = expr.strip()
    while expr.startswith("(") and expr.endswith(")"):
        depth = 0
        for i, c in enumerate(expr):
            depth += c == "("
            depth -= c == ")"
            if depth == 0 and i < len(expr) - 1:
                return expr  # the first "(" closes before the end: not one wrapping pair
        expr = expr[1:-1].strip()
    return expr


def promql_signals(expr: str) -> list[str]:
    """The operands of `expr`'s top-level comparisons and set operators (and, or, unless), less the numeric
    thresholds: for an alert `signal > 0.95` that is `signal`, the series the alert watches whether it fires
    or not."""
    expr = _strip_parens(expr)
    parts, depth, start, i, quote = [], 0, 0, 0, None
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            op = next((o for o in _COMPARISONS if expr.startswith(o, i)), None)
            word = _SET_OPERATOR.match(expr, i)
            if word and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] in "_:")):
                op = word.group(1)
            if op:
                parts.append(expr[start:i])
                i += len(op)
                start = i
                continue
        i += 1
    parts.append(expr[start:])
    signals = []
    for part in parts:
        while (m := _MODIFIER.match(part)) and m.group(0):
            part = part[m.end():]
        part = _strip_parens(part)
        if part and not _NUMBER.match(part):
            signals.append(part)
    return signals


def alert_rules() -> list[dict[str, Any]]:
    (rule,) = load_docs(PROMETHEUS_RULE)
    return [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]


def rules_file_text() -> str:
    """The PrometheusRule's groups as a Prometheus rule file (the operator hands them to Prometheus as is)."""
    (rule,) = load_docs(PROMETHEUS_RULE)
    return yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included, rows themselves excluded."""
    out = []
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            out += panel.get("panels", [])
        else:
            out.append(panel)
    return out


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title / refId, PromQL) of every target of every panel."""
    return [(f"{p['title']} / {t['refId']}", t["expr"]) for p in dashboard_panels() for t in p.get("targets", [])]


def grafana_to_promql(expr: str, variables: dict[str, str], rate_interval: str = "1m", range_: str = "5m") -> str:
    """Grafana's substitutions: its interval variables, and each template variable as `variables` says."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__range", range_).replace("$__interval", "15s")
    for name, value in variables.items():
        expr = expr.replace("${" + name + "}", value)
        expr = re.sub(r"\$" + re.escape(name) + r"(?![\w])", value, expr)
    assert "$" not in expr, f"an unsubstituted Grafana variable in {expr!r}"
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (identifiers followed by a selector or a range, or bare ones that
    look like metric names), without functions, keywords and label names."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # drop string contents: label values
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # and matchers
    expr = re.sub(r"\[[^\]]*\]", "[]", expr)  # and ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        if m.group(2):  # a function call
            continue
        name = m.group(1)
        if name in {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}:
            continue
        names.add(name)
    return names
