"""Engine replicas: serving throughput with 1 and with N engine replicas, at the same total model threads, and how
evenly the ingress spread the requests over the replicas.

    python benchmarks/serve_replicas.py --replicas 1 2 --concurrency 16 --out benchmarks/out/serve_replicas.json
    python benchmarks/serve_replicas.py --smoke      # tiny random models: checks the script end to end
    python benchmarks/serve_replicas.py --device cuda --concurrency 16,64   # 4 GPUs: a target + a draft each
    python benchmarks/serve_replicas.py --device cuda --replicas 3 --draft-replicas 1 --concurrency 16,48
        # 4 GPUs: three targets sharing one draft replica (a draft pool)

Each setting starts the `specserve serve` app (Ray Serve on 127.0.0.1) with `num_replicas` engine replicas of the
pair (default: the bundled SmolLM2-135M-Instruct with its distilled draft, probabilistic rejection, the eval prompts
through the chat endpoint) and runs the `specserve bench` client at the concurrency (greedy, fixed output lengths,
all requests sent at once). On CPU the model workers share --total-threads torch threads per model: with R
replicas each replica's target and draft workers get --total-threads / R threads each (their bundle's CPUs), so
1 and 2 replicas use the same cores and differ in how they split them (one batch of 16 vs two batches of ~8).
Routing balance: each replica's finished requests and generated tokens, read from /metrics (label `replica`).
With --draft-replicas the engine replicas share that many draft replicas (a draft pool); each run then also reports
how many targets each draft forward served (`specserve_draft_pool_batch_tenants`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment  # noqa: E402
from sweep_models import bench_workloads, materialize, model_pairs, warmup_count  # noqa: E402

from deploy.bench.report import format_table, summarize  # noqa: E402
from deploy.bench.runner import run_benchmark  # noqa: E402


def per_replica(metrics_text: str) -> dict[str, dict[str, float]]:
    """replica label -> finished requests and generated tokens, from a /metrics exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    wanted = {"specserve_request_success_total": "requests", "specserve_generation_tokens_total": "tokens"}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            key = wanted.get(s.name)
            if key is not None:
                row = out.setdefault(s.labels["replica"], {"requests": 0.0, "tokens": 0.0})
                row[key] += s.value
    return out


def draft_batches(metrics_text: str) -> dict[str, float]:
    """A draft pool's forwards, the targets they served and the forwards that served more than one, summed over
    its draft replicas, from a /metrics exposition (empty without a pool)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"forwards": 0.0, "tenants": 0.0, "batched": 0.0}
    name = "specserve_draft_pool_batch_tenants"
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == name + "_count":
                out["forwards"] += s.value
                out["batched"] += s.value
            elif s.name == name + "_sum":
                out["tenants"] += s.value
            elif s.name == name + "_bucket" and float(s.labels["le"]) == 1.0:
                out["batched"] -= s.value
    return out


def run_setting(pair: Any, replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import ray
    from ray import serve

    from deploy.app import build_app

    threads = args.total_threads // replicas
    if args.device == "cpu" and (threads < 1 or threads * replicas != args.total_threads):
        raise ValueError(f"--total-threads {args.total_threads} does not split evenly over {replicas} replicas")
    cfg: dict[str, Any] = {
        "model": pair.target, "draft_model": pair.draft, "num_speculative_tokens": args.k,
        "rejection_sampling": pair.rejection_sampling, "max_model_len": args.max_model_len,
        "served_model_name": "bench", "num_replicas": replicas, "request_router": args.request_router,
        "max_queued_requests": None, "draft_replicas": args.draft_replicas,
        "engine_kwargs": {"max_num_seqs": max(args.concurrency), **pair.engine_kwargs},
    }
    if args.device == "cpu":
        # A CPU worker runs as many torch threads as its bundle has CPUs.
        cfg["device"] = "cpu"
        cfg["engine_kwargs"].update(target_resources={"CPU": threads}, draft_resources={"CPU": threads})
    else:
        cfg["device"] = "cuda"  # one GPU per rank of each model: 2 GPUs per replica (a pool: 1, and 1 per draft)
    from deploy.app import apply_local_cluster_env

    apply_local_cluster_env(cfg)  # as `specserve serve` runs
    # Logical CPUs: every replica's router and its workers' bundles, the ingress, and room for Serve's actors.
    # A draft pool's ranks have bundles of their own too.
    pool_cpus = max(threads, 1) * (args.draft_replicas or 0)
    ray.init(num_cpus=replicas * (1 + 2 * max(threads, 1)) + pool_cpus + 2, include_dashboard=False,
             log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
                                       "OMP_NUM_THREADS": "1"}})
    t0 = time.perf_counter()
    base = f"http://127.0.0.1:{args.port}"
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(cfg), name="specserve", route_prefix="/")
        print(f"[{replicas} replica(s)] server up in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        runs = []
        for c, requests, bench_cfg in bench_workloads(pair, args, base, not args.disable_tqdm):
            text = httpx.get(base + "/metrics", timeout=60).text
            before, pool_before = per_replica(text), draft_batches(text)
            run = asyncio.run(run_benchmark(requests, bench_cfg, warmup=warmup_count(args, c)))
            text = httpx.get(base + "/metrics", timeout=60).text
            after, pool_after = per_replica(text), draft_batches(text)
            s = summarize(run, f"{replicas} replica(s), c={c}")
            print(format_table(s), file=sys.stderr, flush=True)
            if s["failed"]:
                raise RuntimeError(f"{s['failed']} requests failed: {s['per_request']['errors'][0]}")
            s.pop("per_request")
            # The warm-up requests are counted too (they ran between the two scrapes): balance over all of them.
            s["replicas"] = {r: {k: after[r][k] - before.get(r, {}).get(k, 0.0) for k in ("requests", "tokens")}
                             for r in after}
            if args.draft_replicas:
                pool = {k: pool_after[k] - pool_before[k] for k in pool_after}
                s["draft_pool"] = {**pool, "tenants_per_forward": pool["tenants"] / max(pool["forwards"], 1.0)}
                print(f"draft pool: {s['draft_pool']}", file=sys.stderr, flush=True)
            runs.append(s)
        return {"replicas": replicas, "draft_replicas": args.draft_replicas, "threads_per_worker": threads,
                "runs": runs}
    finally:
        serve.shutdown()
        ray.shutdown()


def results_table(results: list[dict[str, Any]]) -> str:
    lines = ["| engine replicas | threads per model worker | concurrency | output tok/s | vs 1 replica | TPOT p50 ms "
             "| requests per replica | tokens per replica | balance (min/max tokens) | targets per draft forward |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = {r["max_concurrency"]: r["output_throughput"] for res in results if res["replicas"] == 1
            for r in res["runs"]}
    for res in results:
        for r in res["runs"]:
            c = r["max_concurrency"]
            per = sorted(r["replicas"].values(), key=lambda v: -v["tokens"])
            tokens = [v["tokens"] for v in per]
            requests = " / ".join(f"{v['requests']:.0f}" for v in per)
            ratio = f"{r['output_throughput'] / base[c]:.2f}x" if c in base else "-"
            pooled = f"{r['draft_pool']['tenants_per_forward']:.2f}" if "draft_pool" in r else "-"
            lines.append(
                f"| {res['replicas']} | {res['threads_per_worker']} | {c} | {r['output_throughput']:.1f} | {ratio} "
                f"| {r['median_tpot_ms']:.1f} | {requests} "
                f"| {' / '.join(f'{t:.0f}' for t in tokens)} | {min(tokens) / max(tokens):.2f} | {pooled} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[16])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--total-threads", type=int, default=2,
                    help="CPU: torch threads per model, over all replicas (each replica's workers get an equal share)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--draft-replicas", type=int, default=None,
                    help="a draft pool: the engine replicas share this many draft replicas (default: a draft each)")
    ap.add_argument("--request-router", default="power_of_two", choices=["power_of_two", "prefix_aware"])
    ap.add_argument("--input-len", type=int, default=128, help="random prompts' length (smoke)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-concurrency", type=int, default=4)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests (at least the concurrency)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--port", type=int, default=8125)
    ap.add_argument("--work-dir", default=None, help="where the smoke run's random checkpoints go")
    ap.add_argument("--smoke", action="store_true", help="tiny random models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--disable-tqdm", action="store_true")
    args = ap.parse_args()
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="serve_replicas_"))
    pair = model_pairs(work_dir, args.smoke, args.device, 0.8)["smollm2"]
    materialize("smollm2", pair, work_dir, args.smoke, args.device)
    results = [run_setting(pair, n, args) for n in args.replicas]
    table = results_table(results)
    print(table)
    if args.out:
        out = {"pair": pair.name, "environment": environment(), "args": vars(args), "results": results,
               "table": table, "cpu_count": os.cpu_count()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
