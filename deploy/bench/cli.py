"""`specserve bench`: the command line of the serving benchmark.

    specserve bench --base-url http://127.0.0.1:8000 --dataset-name random --random-input-len 128 \
        --random-output-len 128 --num-prompts 200 --request-rate inf --max-concurrency 16 --ignore-eos \
        --save-json out/bench.json --plot out/plots
    specserve bench --sweep-concurrency 1,4,16,64 --num-prompts 128 --ignore-eos --plot out/plots
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server: throughput, TTFT/TPOT/ITL, acceptance",
                       description="Benchmark any OpenAI-compatible server (vLLM's `bench serve` figures plus "
                                   "speculative-decoding acceptance).")
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"server URL (default {DEFAULT_BASE_URL})")
    p.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer (bundled name, HF directory, .gguf) for dataset token counts (default: --model)")
    p.add_argument("--dataset-name", default="random", choices=["random", "jsonl", "sharegpt"])
    p.add_argument("--dataset-path", default=None, help="the JSONL or ShareGPT file")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths vary by +- this fraction")
    p.add_argument("--random-length-sigma", type=float, default=0.0,
                   help="long-tailed lengths: log-normal with the --random-*-len as median and this shape (e.g. 1; "
                        "clipped to 8 x the median); 0 (default): uniform")
    p.add_argument("--random-vocab-size", type=int, default=None,
                   help="without a tokenizer, draw random prompt ids from [0, N)")
    p.add_argument("--output-len", type=int, default=None, help="max_tokens of every jsonl/sharegpt request")
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests per second, Poisson arrivals; inf (default): all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--max-duration", type=float, default=None, metavar="SECONDS",
                   help="send no request later than this into the run (the rest of --num-prompts is not sent)")
    p.add_argument("--sweep-concurrency", type=_int_list, default=None, metavar="C1,C2,...",
                   help="run once per max concurrency (e.g. 1,4,16,64) and plot throughput against it")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens tokens for every request")
    p.add_argument("--seed", type=int, default=0, help="dataset, arrival times and per-request sampling seeds")
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent (and not counted) before each run")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--label", default=None, help="name of this configuration in the table, JSON and plots")
    p.add_argument("--save-json", default=None, metavar="FILE", help="write the results (every run) as JSON")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write PNG figures: latency distributions, acceptance by position, throughput vs "
                        "concurrency (with --sweep-concurrency)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench_cli)


def _rate(text: str) -> float:
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    return float(text)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"concurrencies must be integers >= 1, got {text!r}")
    return values


def run_bench_cli(args: argparse.Namespace) -> int:
    summaries = asyncio.run(run_bench(args))
    failed = sum(s["failed"] for s in summaries)
    return 1 if failed and not any(s["completed"] for s in summaries) else 0


async def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the benchmark the arguments describe; print tables; write JSON and plots; return the summaries."""
    from deploy.bench.datasets import build_requests, load_tokenizer
    from deploy.bench.plots import acceptance_by_position, latency_distributions, throughput_vs_concurrency
    from deploy.bench.report import bench_json, format_sweep_table, format_table, save_json, summarize
    from deploy.bench.runner import BenchConfig, fetch_model_name, run_benchmark

    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    model = args.model or await fetch_model_name(args.base_url)
    cfg = BenchConfig(base_url=args.base_url, model=model, endpoint=args.endpoint, request_rate=args.request_rate,
                      burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                      temperature=args.temperature, top_p=args.top_p, ignore_eos=args.ignore_eos, seed=args.seed,
                      timeout_s=args.timeout, progress=not args.disable_tqdm, max_duration_s=args.max_duration)
    cfg.validate()
    tokenizer = None
    if args.tokenizer or args.dataset_name != "random" or args.random_vocab_size is None:
        tokenizer = load_tokenizer(args.tokenizer or model)
    requests = build_requests(args.dataset_name, args.num_prompts, args.seed, tokenizer, cfg.chat,
                              path=args.dataset_path, input_len=args.random_input_len,
                              output_len=args.output_len or (args.random_output_len
                                                             if args.dataset_name == "random" else None),
                              range_ratio=args.random_range_ratio, vocab_size=args.random_vocab_size,
                              length_sigma=args.random_length_sigma)
    concurrencies: list[int | None] = list(args.sweep_concurrency or [args.max_concurrency])
    summaries = []
    for c in concurrencies:
        run_cfg = dataclasses.replace(cfg, max_concurrency=c)
        run = await run_benchmark(requests, run_cfg, warmup=args.num_warmups)
        s = summarize(run, args.label)
        summaries.append(s)
        print(format_table(s), flush=True)
        if s["failed"]:
            print(f"{s['failed']} request(s) failed; first error: {s['per_request']['errors'][0]}", file=sys.stderr)
    if len(summaries) > 1:
        print(format_sweep_table(summaries), flush=True)
    if args.save_json:
        save_json(args.save_json, bench_json(summaries, _jsonable_args(args, model)))
    if args.plot:
        out = Path(args.plot)
        for s in summaries:
            suffix = f"_c{s['max_concurrency']}" if len(summaries) > 1 else ""
            latency_distributions(s, out / f"latency{suffix}.png")
            acceptance_by_position(s, out / f"acceptance{suffix}.png")
        if args.sweep_concurrency:
            throughput_vs_concurrency({args.label or model: summaries}, out / "throughput_vs_concurrency.png")
    return summaries


def _jsonable_args(args: argparse.Namespace, model: str) -> dict[str, Any]:
    out = {k: v for k, v in vars(args).items() if k not in ("func", "command", "verbose")}
    out["model"] = model
    if isinstance(out.get("request_rate"), float) and math.isinf(out["request_rate"]):
        out["request_rate"] = "inf"
    return out
