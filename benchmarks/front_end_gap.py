"""Where a served request's time to first token goes before and after the router: the client's TTFT against the
router's own, hop by hop, on tiny random models (an engine step of a few ms), at fixed concurrencies.

    python benchmarks/front_end_gap.py --layouts t1 t1/ds --concurrency 16 64 --seconds 20 --out gap.json
    python benchmarks/front_end_gap.py --layouts t1 --concurrency 64 --profile /tmp/prof   # py-spy of the replicas

Layouts are benchmarks/serve_layouts.py's served ones (`t1`: Serve's proxy or HAProxy, an ingress replica, the
engine replica behind a handle; `t1/ds`: direct streaming, the engine replica answers HTTP itself; `t1/sp`,
`t1/hap`: the proxy named). Each concurrency C is a closed loop of C streamed completions (fixed prompt and
output lengths, greedy, EOS ignored) run for --seconds after a warm-up, measured by up to three clients, one after
the other on the same app:

  handle  this process streams from the engine deployment through a Serve DeploymentHandle (no proxy, no
          ingress): the router plus the handle hop and the stream back
  aiohttp streamed HTTP through the app's front end, read by a lean client (aiohttp, one event per read)
  httpx   the same through `specserve bench`'s own client (httpx), the one load_sweep.py measures with

Per client: TTFT p50 and mean; the router's own mean TTFT over the same requests (arrival at the router to its
first token, from /metrics: specserve_time_to_first_token_seconds); the gap (client mean less router mean, the
same statistic on both sides); and the client's own event-loop lag (how late a 1 ms sleep wakes: p50 / p99), the
share of the gap that is the measuring process, not the server. With --profile DIR, py-spy samples the ingress
and engine replica processes during each httpx point (DIR/<layout>_c<C>_<role>.txt: the top functions by own and
cumulative time).

CPU figures on a small shared machine: compare hops and clients within one run, not absolutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table  # noqa: E402
from layout_report import router_ttft_mean_ms  # noqa: E402
from layouts import Layout  # noqa: E402
from sweep_models import prepare_pair  # noqa: E402

from deploy.bench.client import request_body, send_request  # noqa: E402

COLUMNS = ["layout", "c", "client", "requests", "ttft_p50_ms", "ttft_mean_ms", "router_ttft_mean_ms", "gap_mean_ms",
           "loop_lag_p99_ms", "tpot_p50_ms", "chunks_s", "cpu_proxy_ms_per_req", "cpu_ingress_ms_per_req",
           "cpu_engine_ms_per_req", "cpu_client_ms_per_req"]


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


class LoopLag:
    """How late a 1 ms sleep of this event loop wakes: the time the loop is busy elsewhere (the client's own)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            self.samples.append(time.perf_counter() - t0 - 0.001)

    def __enter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._task is not None
        self._task.cancel()


async def _closed_loop(concurrency: int, seconds: float, warmup: int, one: Any) -> tuple[list[dict[str, Any]], float]:
    """`concurrency` workers each sending requests (`one(i)`, a dict with ttft/latency/chunks) back to back: first
    `warmup` requests each, not counted, then requests until `seconds` have passed (the results, the seconds)."""
    results: list[dict[str, Any]] = []

    async def worker(w: int, deadline: float | None) -> None:
        n = 0
        while (n < warmup) if deadline is None else (time.perf_counter() < deadline):
            r = await one(w * 100_000 + n + (0 if deadline is None else 50_000))
            if deadline is not None:
                results.append(r)
            n += 1

    await asyncio.gather(*(worker(w, None) for w in range(concurrency)))
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w, t0 + seconds) for w in range(concurrency)))
    return results, time.perf_counter() - t0


async def _scrape(base_url: str) -> dict[str, float]:
    import httpx

    from deploy.bench.runner import fetch_metrics

    async with httpx.AsyncClient(timeout=30.0) as c:
        return await fetch_metrics(c, base_url) or {}


def _http_one(kind: str, session: Any, url: str, body: dict[str, Any]) -> Any:
    async def via_httpx(i: int) -> dict[str, Any]:
        r = await send_request(session, url, body, chat=False)
        if not r.success:
            raise RuntimeError(r.error)
        return {"ttft": r.ttft, "latency": r.latency, "chunks": len(r.itl) + 1, "tokens": r.output_len}

    async def via_aiohttp(i: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        ttft, chunks, buf = None, 0, b""
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for data in resp.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if event.startswith(b"data: {") and b'"choices":[{' in event:
                        chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
        return {"ttft": ttft, "latency": time.perf_counter() - t0, "chunks": chunks, "tokens": body["max_tokens"]}

    return via_httpx if kind == "httpx" else via_aiohttp


def _handle_one(handle: Any, prompt: list[int], max_tokens: int) -> Any:
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}

    async def one(i: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        ttft, chunks = None, 0
        async for delta in handle.generate.remote(f"h{i}-{time.monotonic_ns()}", prompt, params):
            if "error" in delta:
                raise RuntimeError(delta["error"])
            if delta["token_ids"]:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
        return {"ttft": ttft, "latency": time.perf_counter() - t0, "chunks": chunks, "tokens": max_tokens}

    return one


def _role(title: str) -> str | None:
    """The part of the app a Ray worker process is, from its title (Ray names each after its actor:
    `ray::ServeReplica:<app>:<deployment>`, `ray::ProxyActor`); None for a process that is not Ray's."""
    from serving.app import DEPLOYMENT_NAME
    from serving.engine_deployment import ENGINE_DEPLOYMENT

    if title.startswith(f"ray::ServeReplica:specserve:{ENGINE_DEPLOYMENT}"):
        return "engine"
    if title.startswith(f"ray::ServeReplica:specserve:{DEPLOYMENT_NAME}"):
        return "ingress"
    if title.startswith("ray::ProxyActor"):
        return "proxy"
    if title.startswith("ray::"):
        return "other_ray"  # the model workers, Serve's controller, idle workers
    return None


def _processes() -> dict[int, str]:
    """pid -> role of every Ray worker process of this machine, and this process as the client."""
    import psutil

    out = {os.getpid(): "client"}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        role = _role(" ".join(proc.info["cmdline"] or []))
        if role is not None:
            out[proc.info["pid"]] = role
    return out


def _cpu_seconds(pids: dict[int, str]) -> dict[int, float]:
    """CPU seconds (user + system) each process has used so far; a process gone meanwhile is left out."""
    import psutil

    out: dict[int, float] = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        out[pid] = t.user + t.system
    return out


def _cpu_by_role(pids: dict[int, str], before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds each role's processes used between two `_cpu_seconds`, over the processes alive at both."""
    out: dict[str, float] = {}
    for pid in before.keys() & after.keys():
        out[pids[pid]] = out.get(pids[pid], 0.0) + after[pid] - before[pid]
    return out


def _replica_pids() -> dict[str, int]:
    """The ingress, engine replica and HTTP proxy process ids by role."""
    return {role: pid for pid, role in _processes().items() if role in ("ingress", "engine", "proxy")}


def _start_profiles(out_dir: Path, tag: str, seconds: float) -> list[tuple[subprocess.Popen, Path, str]]:
    procs = []
    for role, pid in _replica_pids().items():
        raw = out_dir / f"{tag}_{role}.collapsed"
        cmd = ["py-spy", "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200", "-f", "raw", "-o", str(raw),
               "--nonblocking"]
        procs.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), raw, role))
    return procs


def _summarize_profile(raw: Path, top: int = 25) -> str:
    """Top functions of a py-spy raw (collapsed) profile by own samples and by samples that include them."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        count = int(n)
        total += count
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + count
    lines = [f"{raw.name}: {total} samples", "own:"]
    lines += [f"  {100 * v / total:5.1f}%  {k}" for k, v in sorted(own.items(), key=lambda x: -x[1])[:top]]
    lines.append("inclusive:")
    lines += [f"  {100 * v / total:5.1f}%  {k}" for k, v in sorted(inclusive.items(), key=lambda x: -x[1])[:top]]
    return "\n".join(lines)


async def _point(layout: Layout, c: int, client: str, args: argparse.Namespace, base_url: str,
                 prompt: list[int]) -> dict[str, Any]:
    body = request_body("bench", prompt, args.output_len, False, 0.0, 1.0, True, None)
    before = await _scrape(base_url)
    profiles = []
    if args.profile and client == "httpx":
        out_dir = Path(args.profile)
        out_dir.mkdir(parents=True, exist_ok=True)
        profiles = _start_profiles(out_dir, f"{layout.name.replace('/', '-')}_c{c}", args.seconds)
    pids = _processes()
    cpu_before = _cpu_seconds(pids)
    with LoopLag() as lag:
        if client == "handle":
            from ray import serve

            from serving.engine_deployment import ENGINE_DEPLOYMENT

            handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, "specserve").options(stream=True)
            results, wall = await _closed_loop(c, args.seconds, args.warmup,
                                               _handle_one(handle, prompt, args.output_len))
        elif client == "httpx":
            import httpx

            limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
            async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=30.0), limits=limits) as session:
                results, wall = await _closed_loop(c, args.seconds, args.warmup,
                                                   _http_one("httpx", session, base_url + "/v1/completions", body))
        else:
            import aiohttp

            conn = aiohttp.TCPConnector(limit=c)
            async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
                results, wall = await _closed_loop(c, args.seconds, args.warmup,
                                                   _http_one("aiohttp", session, base_url + "/v1/completions", body))
    cpu = _cpu_by_role(pids, cpu_before, _cpu_seconds(pids))
    after = await _scrape(base_url)
    for proc, raw, _ in profiles:
        proc.wait(timeout=args.seconds + 60)
        if raw.is_file():
            (raw.with_suffix(".txt")).write_text(_summarize_profile(raw))
    # The router's TTFT over the warm-up too (its histogram cannot tell them apart): warm-up is a small share.
    ttfts = [r["ttft"] * 1e3 for r in results]
    router = router_ttft_mean_ms(before, after)
    tpots = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) * 1e3 for r in results if r["tokens"] > 1]
    row = {"layout": layout.name, "c": c, "client": client, "requests": len(results),
           "ttft_p50_ms": statistics.median(ttfts), "ttft_mean_ms": statistics.fmean(ttfts),
           "router_ttft_mean_ms": router,
           "gap_mean_ms": statistics.fmean(ttfts) - router if router is not None else None,
           "loop_lag_p50_ms": _pct(lag.samples, 0.5) * 1e3, "loop_lag_p99_ms": _pct(lag.samples, 0.99) * 1e3,
           "tpot_p50_ms": statistics.median(tpots) if tpots else None,
           "chunks_s": sum(r["chunks"] for r in results) / wall}
    # CPU time per request of each process, warm-up included (the profile's own share too, with --profile): on a
    # busy machine the latencies wait for CPUs, this does not.
    n = len(results) + c * args.warmup
    row.update({f"cpu_{role}_ms_per_req": 1e3 * t / n for role, t in sorted(cpu.items())})
    print(row, file=sys.stderr, flush=True)
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", nargs="+", default=["t1", "t1/ds"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--clients", nargs="+", default=["handle", "aiohttp", "httpx"],
                    choices=["handle", "aiohttp", "httpx"])
    ap.add_argument("--seconds", type=float, default=20.0, help="each point, after its warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="requests per client slot before a point is timed")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--stream-interval-ms", type=float, default=None,
                    help="the app's stream_interval_ms (0: a delta every step); unset: the served default")
    ap.add_argument("--port", type=int, default=8125)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--worker-logs", action="store_true")
    ap.add_argument("--profile", default=None, metavar="DIR", help="py-spy the replicas during each httpx point")
    ap.add_argument("--out", default="front_end_gap.json")
    args = ap.parse_args(argv)
    # What serve_layouts.served_app and layouts.serve_config read: tiny random models on CPU (load_sweep --smoke's).
    args.smoke, args.pair, args.device, args.dtype, args.eager, args.k = True, "qwen3-8b-0.6b", "cpu", None, False, 4
    args.acceptance, args.bonus_agreement, args.agreement_profile = 0.8, None, None
    args.max_model_len, args.max_num_seqs = 256, max(args.concurrency)
    return args


def main(argv: list[str] | None = None) -> int:
    from serve_layouts import served_app

    args = parse_args(argv)
    layouts = [Layout.parse(x) for x in args.layouts]
    if any(lay.offline for lay in layouts):
        raise SystemExit("served layouts only")
    pair = prepare_pair(args, layouts)
    prompt = [3 + (7 * i) % 200 for i in range(args.input_len)]
    settings = {k: getattr(args, k) for k in ("concurrency", "seconds", "warmup", "input_len", "output_len", "clients",
                                              "stream_interval_ms")}
    doc: dict[str, Any] = {"benchmark": "front_end_gap", "command": " ".join(sys.argv), "env": environment(),
                           "settings": settings, "rows": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for lay in layouts:
        with served_app(pair, lay, args) as (base_url, _):
            for c in args.concurrency:
                for client in args.clients:
                    if client == "handle" and lay.direct:
                        continue  # the engine replica is the ingress: the HTTP clients measure it
                    doc["rows"].append(asyncio.run(_point(lay, c, client, args, base_url, prompt)))
                    out.write_text(json.dumps(doc, indent=1))
    print(markdown_table(doc["rows"], COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
