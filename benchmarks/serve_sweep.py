"""Serving throughput against concurrency, with and without speculation, and with load-adaptive draft length.

    python benchmarks/serve_sweep.py --pairs smollm2 qwen3-8b-0.6b --out benchmarks/out/serve_sweep.json
    python benchmarks/serve_sweep.py --smoke            # CPU, tiny random models: checks the script end to end

For each model pair it starts `specserve serve`'s app (Ray Serve on 127.0.0.1) three times and runs the
`specserve bench` client at each concurrency (default 1, 4, 16, 64; request rate inf, fixed output lengths):
  no-spec    the target alone
  spec       the draft at a fixed k (num_speculative_tokens at every batch size)
  adaptive   the same draft with a draft-length schedule: given by --schedule, or derived from the first two
             variants (at each measured concurrency, k where speculation was faster, else 0), which is what
             a deployment would put in its config
Pairs: `smollm2` (the bundled SmolLM2-135M-Instruct and its distilled draft, probabilistic rejection, the eval
prompts through the chat endpoint) and `qwen3-8b-0.6b` (random weights with the Qwen3-8B / Qwen3-0.6B shapes,
synthetic acceptance --acceptance, random token prompts). Results merge into --out, keyed by pair and variant,
so a long sweep can run in pieces (--variants); the table prints at the end, in Markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
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
from engine_driver import offline_llm, run_in_process  # noqa: E402
from sweep_models import Pair, bench_workloads, materialize, model_pairs, warmup_count  # noqa: E402

from deploy.bench.report import format_table, summarize  # noqa: E402
from deploy.bench.runner import run_benchmark  # noqa: E402
from engine.draft_schedule import format_schedule, parse_schedule  # noqa: E402

logger = logging.getLogger("specserve")
VARIANTS = ("no-spec", "spec", "adaptive")
# Speculation must beat plain decoding by this much at a concurrency for the derived schedule to keep it on:
# a tie is noise, and off is the safe side of it.
WIN_MARGIN = 1.02


def derive_schedule(no_spec: list[dict], spec: list[dict], k: int) -> list[tuple[int, int]]:
    """(max_batch_size, k) pairs: at each measured concurrency, k if speculation's output tokens/s beat plain
    decoding's by WIN_MARGIN, else 0. A batch between two measured concurrencies takes the larger one's k, so a
    crossover between them falls on the side of no speculation. Neighbours with the same k merge."""
    base = {r["max_concurrency"]: r["output_throughput"] for r in no_spec}
    pairs: list[tuple[int, int]] = []
    for r in sorted(spec, key=lambda r: r["max_concurrency"]):
        c = r["max_concurrency"]
        if c not in base:
            continue
        kc = k if r["output_throughput"] > WIN_MARGIN * base[c] else 0
        if pairs and pairs[-1][1] == kc:
            pairs[-1] = (c, kc)
        else:
            pairs.append((c, kc))
    if not pairs:
        raise ValueError("no concurrency has both a no-spec and a spec result to derive a schedule from")
    return pairs


def serve_config(pair: Pair, variant: str, args: argparse.Namespace, schedule: list[tuple[int, int]] | None
                 ) -> dict[str, Any]:
    engine_kwargs: dict[str, Any] = {"max_num_seqs": max(args.concurrency), **pair.engine_kwargs}
    if args.smoke:
        engine_kwargs.update(num_kv_blocks=1024, max_num_batched_tokens=1024)
    cfg: dict[str, Any] = {
        "model": pair.target, "draft_model": None if variant == "no-spec" else pair.draft,
        "num_speculative_tokens": args.k, "rejection_sampling": pair.rejection_sampling,
        "synthetic_acceptance_rate": pair.synthetic_acceptance_rate if variant != "no-spec" else None,
        "max_model_len": args.max_model_len, "device": args.device, "served_model_name": "bench",
        "engine_kwargs": engine_kwargs, "spec_disable_above_batch_size": None,
        "draft_length_schedule": format_schedule(schedule) if variant == "adaptive" else None,
        "max_queued_requests": None,
    }
    if variant == "no-spec":
        cfg["rejection_sampling"] = "probabilistic"
    if variant == "spec":
        cfg["adaptive_draft_length"] = False  # a fixed k, not the engine's default draft length rule
    if args.engine == "local":
        cfg["engine_builder"] = "serving.engine_builders:build_local_engine"
    return cfg


def run_variant(pair: Pair, variant: str, args: argparse.Namespace, schedule: list[tuple[int, int]] | None
                ) -> list[dict[str, Any]]:
    """Start the server (or the in-process engine) for one variant, sweep the concurrencies, stop it; the
    summaries without per-request arrays."""
    if args.engine == "inproc":
        return run_variant_in_process(pair, variant, args, schedule)
    import ray
    from ray import serve

    from deploy.app import build_app
    from deploy.config import ServeConfig

    known = set(ServeConfig.field_names())
    cfg = {k: v for k, v in serve_config(pair, variant, args, schedule).items() if k in known}
    port = args.port
    from deploy.app import apply_local_cluster_env

    apply_local_cluster_env(cfg)  # as `specserve serve` runs
    ray.init(num_cpus=max(os.cpu_count() or 1, 4), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}})
    t0 = time.perf_counter()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(cfg), name="specserve", route_prefix="/")
        print(f"[{variant}] server up in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        return asyncio.run(_sweep(pair, variant, args, f"http://127.0.0.1:{port}"))
    finally:
        serve.shutdown()
        ray.shutdown()


def run_variant_in_process(pair: Pair, variant: str, args: argparse.Namespace,
                           schedule: list[tuple[int, int]] | None) -> list[dict[str, Any]]:
    """The same sweep against an EngineCore in this process (engine_driver.py): no Ray, no HTTP."""

    t0 = time.perf_counter()
    with offline_llm(serve_config(pair, variant, args, schedule)) as llm:
        print(f"[{variant}] engine up in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        out = []
        for c, requests, bench_cfg in bench_workloads(pair, args, "in-process", not args.disable_tqdm):
            run = run_in_process(llm.engine, requests, bench_cfg, llm.tokenizer, warmup=warmup_count(args, c))
            out.append(_summary(run, pair, variant, c))
        return out


def _summary(run: Any, pair: Pair, variant: str, c: int) -> dict[str, Any]:
    s = summarize(run, f"{pair.name} / {variant}")
    print(format_table(s), file=sys.stderr, flush=True)
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed at concurrency {c}: {s['per_request']['errors'][0]}")
    s.pop("per_request")
    return s


async def _sweep(pair: Pair, variant: str, args: argparse.Namespace, base_url: str) -> list[dict[str, Any]]:
    out = []
    for c, requests, cfg in bench_workloads(pair, args, base_url, not args.disable_tqdm):
        run = await run_benchmark(requests, cfg, warmup=warmup_count(args, c))
        out.append(_summary(run, pair, variant, c))
    return out


def results_table(pair_results: dict[str, Any]) -> str:
    """Markdown: per concurrency, output tokens/s of each variant and the ratios to no speculation."""
    by = {v: {r["max_concurrency"]: r for r in pair_results.get(v, {}).get("runs", [])} for v in VARIANTS}
    concurrencies = sorted(set().union(*[set(d) for d in by.values()]))
    lines = ["| concurrency | no spec tok/s | spec tok/s | spec / no spec | adaptive tok/s | adaptive / no spec "
             "| acceptance length (spec) | TPOT p50 ms (no spec / spec / adaptive) |",
             "|---|---|---|---|---|---|---|---|"]
    for c in concurrencies:
        base = by["no-spec"].get(c)
        cells = [str(c)]
        for v in ("no-spec", "spec", "adaptive"):
            r = by[v].get(c)
            cells.append(f"{r['output_throughput']:.1f}" if r else "-")
            if v != "no-spec":
                cells.append(f"{r['output_throughput'] / base['output_throughput']:.2f}x" if r and base else "-")
        spec = (by["spec"].get(c) or {}).get("spec_decode") or {}
        cells.append(f"{spec['acceptance_length']:.2f}" if spec else "-")
        cells.append(" / ".join(f"{by[v][c]['median_tpot_ms']:.1f}" if c in by[v] and by[v][c]['median_tpot_ms']
                                else "-" for v in VARIANTS))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", nargs="+", default=["smollm2", "qwen3-8b-0.6b"], choices=["smollm2", "qwen3-8b-0.6b"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma-separated (default 1,4,16,64; smoke 1,2,4)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens of spec and adaptive")
    ap.add_argument("--acceptance", type=float, default=0.8, help="synthetic acceptance rate (qwen3 shapes)")
    ap.add_argument("--schedule", default=None, help="adaptive's schedule, e.g. 4:4,16:2,64:0 (default: derived)")
    ap.add_argument("--input-len", type=int, default=128, help="random prompts' length")
    ap.add_argument("--output-len", type=int, default=None, help="tokens per request (default 128; smoke 16)")
    ap.add_argument("--prompts-per-concurrency", type=int, default=4)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests per concurrency (at least c)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--engine", default="auto", choices=["auto", "inproc", "local", "ray"],
                    help="local: Ray Serve, both models in the router's process (one GPU); ray: Ray Serve with "
                         "worker actors; inproc: the engine in this process, no Ray or HTTP; auto: local where "
                         "Ray Serve is installed, else inproc")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the in-process engine on CPU")
    ap.add_argument("--work-dir", default=None, help="where random checkpoints are written (reused across runs)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random models, small sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON results (merged into an existing file)")
    ap.add_argument("--disable-tqdm", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cpu":
        # As the router does on CPU (SPECSERVE_TORCH_THREADS): on a shared machine more intra-op threads than
        # free cores make every step many times slower, not faster.
        torch.set_num_threads(args.threads)
    if args.engine == "auto":
        try:
            import ray.serve  # noqa: F401
            args.engine = "local"
        except ImportError:
            args.engine = "inproc"
    args.concurrency = args.concurrency or ([1, 2, 4] if args.smoke else [1, 4, 16, 64])
    args.output_len = args.output_len or (16 if args.smoke else 128)
    if args.smoke:
        args.input_len = min(args.input_len, 32)
        args.min_prompts = min(args.min_prompts, 4)
        args.prompts_per_concurrency = min(args.prompts_per_concurrency, 2)
    work = Path(args.work_dir or Path(tempfile.gettempdir()) / "specserve-sweep")
    work.mkdir(parents=True, exist_ok=True)
    out_path = Path(args.out) if args.out else None
    doc: dict[str, Any] = json.loads(out_path.read_text()) if out_path and out_path.is_file() else {}
    doc.setdefault("pairs", {})
    doc["env"] = environment()
    pairs = model_pairs(work, args.smoke, args.device, args.acceptance)
    for key in args.pairs:
        pair = pairs[key]
        materialize(key, pair, work, args.smoke, args.device)
        res = doc["pairs"].setdefault(key, {"name": pair.name})
        for variant in args.variants:
            schedule = None
            if variant == "adaptive":
                schedule = parse_schedule(args.schedule) if args.schedule else derive_schedule(
                    res["no-spec"]["runs"], res["spec"]["runs"], args.k) if "no-spec" in res and "spec" in res \
                    else None
                if schedule is None:
                    raise SystemExit("adaptive needs --schedule, or the no-spec and spec variants first")
                print(f"[{key}] adaptive schedule: {format_schedule(schedule)}", file=sys.stderr, flush=True)
            runs = run_variant(pair, variant, args, schedule)
            res[variant] = {"runs": runs, "k": 0 if variant == "no-spec" else args.k,
                            "schedule": format_schedule(schedule) if schedule else None,
                            "command": " ".join(sys.argv), "env": environment()}
            if out_path:
                out_path.parent.mkdir(parents=True, exist_ok=True)
                out_path.write_text(json.dumps(doc, indent=1, default=_inf))
    for key in args.pairs:
        res = doc["pairs"][key]
        sched = (res.get("adaptive") or {}).get("schedule")
        ds = pairs[key].dataset
        prompts = (f"random prompts of {args.input_len} tokens" if ds["dataset_name"] == "random" else
                   f"prompts of {Path(ds['dataset_path']).name} via {ds['endpoint']}")
        print(f"\n### {res['name']}\n\n{doc['env']['device']}, engine {args.engine}, k={args.k}, {prompts}, "
              f"{args.output_len} output tokens (EOS ignored), greedy, request rate inf, adaptive schedule {sched}\n")
        print(results_table(res))
    return 0


def _inf(o: Any) -> Any:
    return "inf" if isinstance(o, float) and math.isinf(o) else str(o)


if __name__ == "__main__":
    sys.exit(main())
