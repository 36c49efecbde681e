"""A short bounded soak (benchmarks/soak.py for 45 s): mixed streaming, non-streaming, chat, gRPC, abandoned and
invalid requests against a real server with tiny models, then the leak checks: no unexpected answer, the router
idle with no KV block held by either model, and resident memory after warm-up growing by less than the bound.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from byte_models import make_byte_models
from serve_support import Server, kv_blocks_used, router_call, running_server, serve_config, wait_idle

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from soak import run_soak  # noqa: E402

pytestmark = pytest.mark.slow

DURATION_S = 45.0
# Growth of resident memory from the end of warm-up to the end of the run: all server processes, and the router
# alone (it holds every request's state). Measured growth is far smaller (benchmarks/RESULTS.md, "Soak").
MAX_GROWTH_MB = 150.0
MAX_ROUTER_GROWTH_MB = 40.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    target, draft = make_byte_models(tmp_path_factory.mktemp("byte"))
    cfg = serve_config(target, draft, max_model_len=512, engine_kwargs={"num_kv_blocks": 1024})
    with running_server(cfg, num_cpus=8) as srv:
        yield srv


def test_bounded_soak(server: Server) -> None:
    router_pid = router_call(lambda r: os.getpid())
    result = run_soak(server.base, server.grpc_target, server.model, DURATION_S, concurrency=6, seed=1,
                      router_pid=router_pid)
    assert result["unexpected"] == [], result["unexpected"][:10]
    assert result["total_requests"] > 100 and set(result["requests"]) == {
        "complete", "stream", "chat", "cancel", "grpc", "grpc_cancel", "invalid"}, result["requests"]
    stats = wait_idle(timeout_s=60)
    assert set(kv_blocks_used(stats).values()) == {0}, stats
    assert stats["num_streams"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert result["rss_mb"]["growth_after_warmup"] < MAX_GROWTH_MB, result["rss_mb"]
    assert result["router_rss_mb"]["growth_after_warmup"] < MAX_ROUTER_GROWTH_MB, result["router_rss_mb"]
