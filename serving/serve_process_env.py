"""The Ray Serve process settings specserve runs with: user code and the request router on each replica's own event
loop, instead of Serve's defaults of a thread (user code) and an event loop (router) of their own.

Every streamed token event and every handle call otherwise crosses between threads in the ingress and engine
replicas. Measured on one H200 (benchmarks/RESULTS.md, "Serve's own event loops"): with the draft sharing the GPU,
c=1 TPOT 2.57 -> 2.38 ms and c=16 tokens/s 3278 -> 3593. Serve's throughput-optimized preset
(`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`, which adds gRPC between proxy and replicas and direct ingress) measured worse at
c=16 for a target alone (TTFT 261 against 60 ms), so only these two are set.

Serve reads them when a process imports it, so every Ray process needs them in its environment: `apply()` sets them
(where the user has not) before a local cluster starts, whose processes inherit them; on a cluster the pod spec sets
them (k8s/base/rayservice.yaml).
"""

from __future__ import annotations

import os

SERVE_PROCESS_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def apply() -> dict[str, str]:
    """Set each of SERVE_PROCESS_ENV in this process's environment unless already set (a user's choice wins), before
    Ray starts; returns the values now in effect."""
    for key, value in SERVE_PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in SERVE_PROCESS_ENV}
