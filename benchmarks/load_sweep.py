"""Speculation under sustained load: served layouts and the in-process engine at fixed concurrencies and Poisson
request rates, long-tailed prompt and output lengths, each load point long enough to rank layouts.

    python benchmarks/load_sweep.py --pair qwen3-8b-0.6b --bonus-agreement 0.7 \\
        --layouts offline t1 offline+d t1+d1/colocated --concurrency 1 4 16 64 --rates 4 16 \\
        --out out/load_sweep.json
    python benchmarks/load_sweep.py --pair qwen3-8b-0.6b --per-target --concurrency 1 16 64 \\
        --layouts t1+d1/r3/p1 t1+d1/colocated/r4 t1+d1/r2 --out out/replicas.json   # 4 GPUs
    python benchmarks/load_sweep.py --smoke --out /tmp/sweep/load_sweep.json   # CPU, tiny random models
    python benchmarks/load_sweep.py --replot out/load_sweep.json   # PNGs and table again from the JSON
    python benchmarks/load_sweep.py --replot a.json b.json --out all.json   # a sweep run in two calls, merged

Layouts are benchmarks/serve_layouts.py's (its docstring has the grammar): `offline` / `offline+d` are the engine
in this process (engine.LLM, no Ray, no HTTP), every other layout the Serve app on a fresh local Ray runtime,
driven by `specserve bench`'s client (deploy/bench/runner.py) over HTTP.

Load points: one per --concurrency C (requests sent as fast as C slots allow: the closed loop of
`specserve bench --max-concurrency C`) and one per --rates R (Poisson arrivals at R requests/s, no cap at the
client: an open loop, whose queue the engine holds). A point sends requests until it has run --min-seconds or sent
--min-requests, whichever comes first, then waits for those in flight: so each point is at least that long or that
many requests (a shortened --min-seconds says so in the JSON's settings). Before it, warm-up requests at the same
concurrency (at least C, or --warmup at a rate point) that are not counted.

Requests: random token ids, prompt and output lengths log-normal (medians --input-len / --output-len, shape
--length-sigma, clipped to half of --max-model-len), EOS ignored, greedy; the point's index seeds them, so every
layout gets the same requests. The in-process engine gets the same arrival schedule (deploy/bench/runner.
arrival_times, same seed): a request is added to the engine when it arrives (between steps, as the router takes
it), and its clock starts at its arrival, not when it was added. Statistics are `specserve bench`'s
(deploy/bench/report.py) for both paths.

Engine replicas (`r<N>`, with or without a draft pool `p<M>`) share each point's load; with --per-target the given
concurrencies, rates and --min-requests are per target replica and each layout gets them times its replicas
(`--per-target --concurrency 1 16 64` sends 3, 48 and 192 client slots to `t1+d1/r3/p1`); the JSON keeps the
total (concurrency, request_rate) and the per-target values (concurrency_per_target, request_rate_per_target).

Output, per layout and load point: output tokens/s (all targets) and per GPU of the layout (`gpus`: its num_gpus),
requests/s, TTFT p50/p99, TPOT p50/p99, ITL p99, acceptance
length, and the share of engine steps that speculated (load-adaptive speculation turns it off at large batches:
specserve_spec_decode_steps_total served, the engine's own count in process); served layouts also the router's own
mean TTFT (arrival at the router to first token, from /metrics), whose gap to the client's is the serving path's.
Written: the JSON (--out, rewritten after every layout), beside it `<stem>.md` (the table, also printed last),
`<stem>_throughput_vs_tpot.png` and `<stem>_ttft_vs_load.png` (one line per layout; needs matplotlib, else
--replot on a machine that has it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from agreement_profile import add_agreement_args, check_agreement_args  # noqa: E402
from common import environment, markdown_table  # noqa: E402
from engine_driver import offline_llm, run_in_process  # noqa: E402
from layout_report import ahead_from_metrics, ahead_summary, router_ttft_mean_ms  # noqa: E402
from layouts import Layout, check_layouts, serve_config  # noqa: E402
from sweep_models import Pair, prepare_pair, warmup_count  # noqa: E402

from deploy.bench.datasets import BenchRequest, build_requests, load_tokenizer  # noqa: E402
from deploy.bench.report import load_point, summarize  # noqa: E402
from deploy.bench.runner import BenchConfig, RunResult, run_benchmark  # noqa: E402

logger = logging.getLogger("specserve")

COLUMNS = ["layout", "load", "targets", "gpus", "requests", "req_s", "output_tok_s", "output_tok_s_per_gpu",
           "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "acceptance_length",
           "spec_step_share", "ahead_hit_rate", "ahead_tokens_per_lookup", "router_ttft_mean_ms"]


@dataclasses.dataclass(frozen=True)
class LoadPoint:
    concurrency: int | None  # the client's cap, all targets together; None: none (a rate point)
    rate: float  # Poisson requests/s, all targets together; inf: as fast as the cap allows
    seed: int  # the requests' and arrivals' seed: the same point of every layout gets the same ones
    targets: int = 1  # the layout's target engine replicas (r<N>), which share the load
    scale: int = 1  # --per-target: the given concurrency, rate and request count times `targets`; else 1


def load_points(args: argparse.Namespace, targets: int = 1) -> list[LoadPoint]:
    """The sweep's points for a layout of `targets` engine replicas: with --per-target, each given concurrency
    and rate is per target replica (c = 16 with r3: 48 client slots), and so is --min-requests."""
    n = targets if args.per_target else 1
    points = [LoadPoint(c * n, float("inf"), args.seed + i, targets, n) for i, c in enumerate(args.concurrency)]
    return points + [LoadPoint(None, r * n, args.seed + len(points) + i, targets, n) for i, r in enumerate(args.rates)]


def point_workload(point: LoadPoint, args: argparse.Namespace, tokenizer: Any, base_url: str
                   ) -> tuple[list[BenchRequest], BenchConfig, int]:
    """The point's requests, the bench config that sends them, and its warm-up count."""
    requests = build_requests("random", args.min_requests * point.scale, point.seed, tokenizer, chat=False,
                              input_len=args.input_len, output_len=args.output_len, length_sigma=args.length_sigma,
                              max_len=args.max_model_len // 2 - args.k - 2)
    cfg = BenchConfig(base_url=base_url, model="bench", request_rate=point.rate, max_concurrency=point.concurrency,
                      temperature=0.0, ignore_eos=True, seed=point.seed, progress=False,
                      max_duration_s=args.min_seconds)
    warmup = warmup_count(args, point.concurrency) if point.concurrency else args.warmup
    return requests, cfg, warmup


def ahead_columns(ahead: dict[str, float] | None) -> dict[str, float]:
    """Speculation ahead over a point (layout_report.ahead_summary; in process the warm-up's lookups count too):
    its hit rate and the tokens it drafted a lookup, the price of that rate. Empty where nothing was drafted."""
    if ahead is None:
        return {}
    return {"ahead_hit_rate": ahead["hit_rate"], "ahead_tokens_per_lookup": ahead["drafted_per_lookup"]}


def point_row(run: RunResult, point: LoadPoint, layout: Layout, extra: dict[str, Any]) -> dict[str, Any]:
    """The point's row: `specserve bench`'s statistics of the whole load (all target replicas together), with the
    layout's GPUs and targets, the throughput per GPU, and the offered load per target replica."""
    s = summarize(run)
    row = {**load_point(s), **extra}
    per_c = None if point.concurrency is None else point.concurrency / point.targets
    per_rate = None if row["request_rate"] is None else row["request_rate"] / point.targets
    if point.scale > 1:  # the load as given: per target
        given = ([] if per_c is None else [f"c={per_c:g}"]) + ([] if per_rate is None else [f"rate={per_rate:g}"])
        row["load"] = " ".join(given) + f" per target (x{point.targets})"
    row.update(targets=point.targets, gpus=layout.num_gpus, output_tok_s_per_gpu=row["output_tok_s"] / layout.num_gpus,
               concurrency_per_target=per_c, request_rate_per_target=per_rate)
    if s["failed"]:
        row["first_error"] = s["per_request"]["errors"][0]
    return row


def run_offline(pair: Pair, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    with offline_llm(serve_config(pair, layout, args)) as llm:
        out: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "points": []}
        for n, point in enumerate(load_points(args, layout.target_replicas)):
            requests, cfg, warmup = point_workload(point, args, llm.tokenizer, "in-process")
            before = llm.engine.speculation_ahead_stats()
            run = run_in_process(llm.engine, requests, cfg, llm.tokenizer, warmup, tag=f"p{n}")
            out["points"].append(point_row(run, point, layout, ahead_columns(
                ahead_summary(before, llm.engine.speculation_ahead_stats()))))
            _progress(layout, out["points"][-1])
        return out


def run_served(pair: Pair, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    from serve_layouts import served_app

    tokenizer = load_tokenizer(pair.target)
    with served_app(pair, layout, args) as (base_url, startup):
        out: dict[str, Any] = {"startup_s": startup, "points": []}
        for point in load_points(args, layout.target_replicas):
            requests, cfg, warmup = point_workload(point, args, tokenizer, base_url)
            run = asyncio.run(run_benchmark(requests, cfg, warmup=warmup))
            ahead = ahead_summary(ahead_from_metrics(run.metrics_before), ahead_from_metrics(run.metrics_after))
            out["points"].append(point_row(run, point, layout, {"router_ttft_mean_ms": router_ttft_mean_ms(
                run.metrics_before, run.metrics_after), **ahead_columns(ahead)}))
            _progress(layout, out["points"][-1])
        return out


def _progress(layout: Layout, row: dict[str, Any]) -> None:
    print(f"[{layout.name}] {row['load']}: {row['requests']} requests in {row['duration_s']:.1f} s, "
          f"{row['output_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)


def table(doc: dict[str, Any]) -> str:
    rows = []
    for name, res in doc["layouts"].items():
        if "error" in res:
            rows.append({"layout": name, "load": f"failed: {res['error']}"})
        for p in res.get("points", []):
            rows.append({"layout": name, **p})
    s = doc["settings"]
    head = (f"### Load sweep: {doc['pair']}\n\n{doc['env']['device']}, {doc['env']['date']}, k={s['k']}, greedy, "
            f"EOS ignored; lengths log-normal (median {s['input_len']} in / {s['output_len']} out, sigma "
            f"{s['length_sigma']}); each point {s['min_seconds']:g} s or {s['min_requests']} requests, whichever "
            f"first{' (shortened)' if s['min_seconds'] < 60 else ''}"
            f"{'; loads and requests per target replica (x targets in all)' if s.get('per_target') else ''}. "
            f"Throughput of all targets together, and per GPU of the layout. Latencies in ms; spec share: engine "
            f"steps that speculated.\n`{doc['command']}`\n\n")
    return head + markdown_table(rows, COLUMNS)


def write_outputs(doc: dict[str, Any], out: Path) -> list[Path]:
    """The table beside the JSON, and the PNGs where matplotlib is installed; the files written."""
    from deploy.bench.plots import throughput_vs_tpot, ttft_vs_load

    md = out.with_suffix(".md")
    md.write_text(table(doc) + "\n")
    series = {name: res["points"] for name, res in doc["layouts"].items() if res.get("points")}
    try:
        pngs = [throughput_vs_tpot(series, out.with_name(out.stem + "_throughput_vs_tpot.png")),
                ttft_vs_load(series, out.with_name(out.stem + "_ttft_vs_load.png"))]
    except ValueError as e:  # no matplotlib (the GPU image): the JSON has every value, --replot draws them
        print(f"no PNGs: {e}; run `python benchmarks/load_sweep.py --replot {out}` where it is installed",
              file=sys.stderr)
        pngs = []
    return [md, *pngs]


def merged(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document of sweeps of the same pair and settings run apart (their layouts, in order; a layout run
    twice keeps its last run)."""
    first = docs[0]
    for d in docs[1:]:
        if (d["pair"], d["settings"]) != (first["pair"], first["settings"]):
            raise SystemExit(f"cannot merge: {d['pair']} {d['settings']} against {first['pair']} {first['settings']}")
    return {**first, "command": " ; ".join(d["command"] for d in docs),
            "layouts": {name: res for d in docs for name, res in d["layouts"].items()}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen3-8b-0.6b", choices=["smollm2", "qwen3-8b-0.6b"])
    ap.add_argument("--layouts", nargs="+", default=None, help="default: offline t1 offline+d t1+d1/colocated")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--rates", type=float, nargs="*", default=[], help="Poisson request rates (req/s)")
    ap.add_argument("--per-target", action="store_true",
                    help="--concurrency, --rates and --min-requests are per target engine replica: a layout with "
                         "r<N> gets N times each (c = 16 with r3: 48 client slots); the JSON keeps both")
    ap.add_argument("--min-seconds", type=float, default=60.0)
    ap.add_argument("--min-requests", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests before each point (at least C)")
    ap.add_argument("--input-len", type=int, default=128, help="median prompt length")
    ap.add_argument("--output-len", type=int, default=128, help="median output length")
    ap.add_argument("--length-sigma", type=float, default=0.8, help="log-normal shape of both lengths")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--acceptance", type=float, default=0.8, help="synthetic acceptance rate (qwen3 shapes)")
    add_agreement_args(ap)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest concurrency (64 without)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--stream-interval-ms", type=float, default=None,
                    help="served layouts' stream_interval_ms (0: a delta every step); unset: the served default")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny random models, two short points")
    ap.add_argument("--worker-logs", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="load_sweep.json", help="the JSON; the table and PNGs go beside it")
    ap.add_argument("--append", action="store_true",
                    help="add this run's layouts to an existing --out of the same pair and settings (a sweep split "
                         "over several calls), instead of replacing it")
    ap.add_argument("--replot", nargs="+", default=None, metavar="JSON",
                    help="only write the table and PNGs of this JSON; of several (one sweep run in several calls: "
                         "same pair and settings), merge their layouts into --out first")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layouts = args.layouts or ["offline+d", "t1+d1/colocated"]
        args.concurrency, args.rates, args.min_seconds, args.min_requests = [2], [8.0], 3.0, 6
        args.input_len, args.output_len, args.length_sigma, args.max_model_len = 12, 8, 0.5, 128
    if not args.concurrency and not args.rates:
        ap.error("no load points: give --concurrency and/or --rates")
    if any(c < 1 for c in args.concurrency) or any(not r > 0 for r in args.rates):
        ap.error("concurrencies must be >= 1 and rates > 0")
    check_agreement_args(ap, args)
    if args.min_seconds <= 0 or args.min_requests < 1:
        ap.error("--min-seconds must be > 0 and --min-requests >= 1")
    # serve_config sizes max_num_seqs from the concurrencies; a rate-only sweep gets 64. With --per-target these
    # are per engine replica, which is what each replica's max_num_seqs is.
    args.concurrency_for_seqs = args.concurrency or [64]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        docs = [json.loads(Path(p).read_text()) for p in args.replot]
        out = Path(args.replot[0] if len(docs) == 1 else args.out)
        doc = merged(docs) if len(docs) > 1 else docs[0]
        if len(docs) > 1:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=1))
        write_outputs(doc, out)
        print(table(doc))
        return 0
    out = Path(args.out)
    logging.basicConfig(level=logging.WARNING)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    layouts = [Layout.parse(x) for x in args.layouts or ["offline", "t1", "offline+d", "t1+d1/colocated"]]
    pair = prepare_pair(args, layouts)
    # The serve config's fields that read the sweep's arguments under serve_layouts.py's names.
    cfg_args = argparse.Namespace(**{**vars(args), "max_num_seqs": args.max_num_seqs or max(
        args.concurrency_for_seqs)})
    check_layouts(pair, layouts, cfg_args)
    settings = {k: getattr(args, k) for k in ("concurrency", "rates", "min_seconds", "min_requests", "warmup",
                                              "input_len", "output_len", "length_sigma", "k", "acceptance",
                                              "bonus_agreement", "agreement_profile", "max_model_len", "seed",
                                              "per_target", "stream_interval_ms")}
    doc: dict[str, Any] = {"benchmark": "load_sweep", "pair": pair.name, "command": " ".join(sys.argv),
                           "env": environment(), "settings": settings, "layouts": {}}
    if args.append and out.is_file():
        doc = merged([json.loads(out.read_text()), json.loads(json.dumps(doc))])
    out.parent.mkdir(parents=True, exist_ok=True)
    for lay in layouts:
        print(f"[{lay.name}] starting", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            doc["layouts"][lay.name] = (run_offline if lay.offline else run_served)(pair, lay, cfg_args)
        except Exception as e:  # one failed layout must not cost the others their device time
            traceback.print_exc()
            doc["layouts"][lay.name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"[{lay.name}] done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        out.write_text(json.dumps(doc, indent=1))
    write_outputs(doc, out)
    print(table(doc))
    failed = [n for n, r in doc["layouts"].items() if "error" in r or any(p["failed"] for p in r["points"])]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
