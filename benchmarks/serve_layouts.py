"""Target and draft on their own GPU groups through the Ray Serve app: greedy outputs, tokens/s and router overhead
per layout.

    python benchmarks/serve_layouts.py --pair qwen3-8b-0.6b \\
        --layouts offline offline+d t1+d1 t1+d1/b4 t1+d1/plain t2 t2+d2 t2+d1 t2+d1/shared t1+d1/colocated \\
        --out layouts.json
    python benchmarks/serve_layouts.py --pair qwen3-8b-0.6b --dtype float32 --check-only --eager \\
        --layouts t1 t2 t1+d1 t2+d2 t2+d1
    python benchmarks/serve_layouts.py --pair smollm2 --layouts t1 t1+d1 t3+d1 t1+d1/nccl
    python benchmarks/serve_layouts.py --smoke      # CPU: tiny random models, gloo, checks the script end to end

A layout is `t<T>` (the target alone at tensor-parallel size T) or `t<T>+d<D>` (and the draft at size D), with
options after slashes: `plain` (plain Ray actor calls instead of a compiled graph), `shared` (the draft on the
target's GPUs: target ranks take 0.75 of a GPU each, draft ranks 0.25; otherwise every rank has a GPU of its own,
the target's first), `colocated` (the draft inside each target rank's process, on its GPU: draft_placement
"colocated", which needs D = T; no proposal or result crosses processes), `nccl` (the draft's proposal tensors go
GPU to GPU through NCCL), `ahead` / `noahead` (the target's verify forward launched before the draft's ids come,
behind the ids gate, forced on / off; by default it is on where no GPU is shared), `sync` (synchronous scheduling:
the router waits for each step's tokens before it plans the next; by default it plans step n+1 while step n runs),
`predraft` / `nopredraft` (speculation ahead: the draft drafts the next window while the target verifies, forced on
/ off; by default on where no GPU is shared), `b<N>` (speculation ahead on, drafting up to N windows a
request for the likeliest verify outcomes: speculation_ahead_branches; as many as fit in the verify where the draft has
a GPU of its own, all N each step with `fixed`), `f<N>` (speculation ahead's tree mode: one tree a request over
every outcome of its verify, up to N candidates for the target's token per outcome: speculation_ahead_tree_fanout;
turns speculation ahead on, not with b<N>; trees cut to what fits in the verify unless `fixed`), `sg<C>` (Saguaro
sampling at factor C in (0, 1) with b<N>, N >= 2, or f<N>: speculation_ahead_saguaro; probabilistic rejection only,
so the smollm2 pair), `r<N>` (N engine replicas, each a router with the layout's target and draft on GPUs of their
own: num_replicas; served only), `p<M>` (a draft pool: the engine replicas' drafts come from M draft replicas of D
GPUs each, shared between them: draft_replicas, M <= N; served only; p<M> takes none of plain, shared, colocated,
nccl, ahead / noahead, ds; a pool drafts ahead as a draft of one target does, for all of its targets at once:
`t1+d1/r3/p1/predraft`, `t1+d1/r3/p1/f4`), `i<N>` (N ingress replicas, the HTTP shims
that tokenize, template and stream back: ingress_replicas; served layouts only), `hap` / `sp` (HAProxy or Serve's
Python proxy takes the client connections: http_proxy; served layouts only; by default HAProxy on GPUs), `ds`
(direct streaming: the engine replica answers HTTP itself, no ingress replicas: direct_streaming; served only).
A layout's GPUs: N x (T + D) with r<N> (N x T where the draft is `shared` or `colocated`), N x T + M x D with
p<M>: `t1+d1/r2` is two t1+d1 pairs on 4 GPUs, `t1+d1/colocated/r4` four engines of one GPU each, `t1+d1/r3/p1`
three one-GPU targets sharing a one-GPU draft (4 GPUs), `t1+d1/f4` a tree-mode pair on 2.
`offline` and `offline+d` are the in-process engine (engine.LLM, no Ray, no HTTP) on one GPU, the reference for
serving's cost; `offline+d/predraft` drafts ahead in process (after each verify, not beside it; so do
`offline+d/b<N>` and `offline+d/f<N>`); `offline/sync` runs each step to its end before the next (in process a
target alone otherwise queues each step before it reads the last one's tokens: engine/decode_pipeline.py).
The offline engine takes none of the served app's options (i<N>, r<N>, p<M>, hap, sp, ds).

--bonus-agreement R (synthetic pairs only, a benchmark-only setting): random weights never agree on a bonus token,
so a window drafted ahead would never hit; with it, a lookup whose drafts were all accepted counts the bonus as the
draft's guess at rate R (measure R on a real pair: benchmarks/speculation_ahead.py). One rate credits an outcome's
first window whatever else was drafted for it, so tree mode's fan-out (f<N>) changes nothing it hits: for tree
layouts use --agreement-profile FILE instead (also benchmark-only, synthetic pairs), the real SmolLM2 pair's
measured P(target token in the draft's top-f | verify outcome) (benchmarks/profiles/smollm2_top_f_agreement.json,
written by benchmarks/tree_hit_rate.py --profile): a lookup with n candidates for its outcome hits at that pair's
top-n rate. The hit rates and unused draft tokens of each run come from /metrics (speculation_ahead_*).

Per layout, on a fresh Ray runtime that sees only the GPUs the layout needs:
  check  greedy completions of --check-prompts prompts, one at a time, compared with the first layout of the run
         that has the same draft (none / one) at tensor-parallel sizes 1 and no options but `shared` (the real
         SmolLM2 pair with probabilistic rejection is lossless, so there the target alone is the reference for
         every layout)
  bench  `specserve bench` at each --concurrency (random or eval prompts, fixed output length, greedy, rate inf):
         output tokens/s, TPOT, and from /metrics the mean time per step of each phase; the router's own share
         of a step is schedule + dispatch + commit (dispatch: the executor's transport, plan out and result back).
         With --repeats R each concurrency runs R times on the same engine (warmed up once) and reports the
         repeat with the median TPOT and the repeats' TPOT range: short runs at high concurrency (1-3 s for 16
         requests of 128 tokens on an H100) moved by up to 28% from one run to the next.
Random weights (the Qwen3 shapes) are drawn per checkpoint tensor and sharded like real weights, so every
tensor-parallel size holds the same model. A layout that fails is recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from agreement_profile import add_agreement_args, check_agreement_args  # noqa: E402
from common import environment  # noqa: E402
from engine_driver import offline_llm, prompt_ids, release_gpu_cache, run_in_process  # noqa: E402
from layout_report import (  # noqa: E402
    ahead_from_metrics,
    ahead_summary,
    compare,
    median_run,
    phase_means_ms,
    phase_summary,
    router_ttft_mean_ms,
    run_summary,
    table,
)
from layouts import Layout, check_layouts, serve_config  # noqa: E402
from sweep_models import Pair, bench_workloads, prepare_pair, warmup_count  # noqa: E402

from deploy.bench.datasets import build_requests, load_tokenizer  # noqa: E402
from deploy.bench.runner import run_benchmark  # noqa: E402

logger = logging.getLogger("specserve")


def check_prompts(pair: Pair, args: argparse.Namespace) -> tuple[list[Any], bool]:
    tokenizer = load_tokenizer(pair.target)
    ds = pair.dataset
    chat = ds["endpoint"].endswith("chat/completions")
    reqs = build_requests(ds["dataset_name"], args.check_prompts, args.seed + 1, tokenizer, chat,
                          path=ds.get("dataset_path"), input_len=args.input_len, output_len=args.check_tokens)
    return reqs, chat


async def http_greedy(base_url: str, pair: Pair, args: argparse.Namespace) -> list[str]:
    import httpx

    reqs, chat = check_prompts(pair, args)
    texts = []
    async with httpx.AsyncClient(timeout=600) as client:
        for r in reqs:
            body: dict[str, Any] = {"model": "bench", "max_tokens": args.check_tokens, "temperature": 0.0,
                                    "ignore_eos": True}
            if chat:
                body["messages"] = [{"role": "user", "content": r.prompt}]
            else:
                body["prompt"] = r.prompt
            resp = await client.post(base_url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body)
            resp.raise_for_status()
            choice = resp.json()["choices"][0]
            texts.append(choice["message"]["content"] if chat else choice["text"])
    return texts


async def http_layout(pair: Pair, layout: Layout, args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    out: dict[str, Any] = {"check": await http_greedy(base_url, pair, args)} if args.check_prompts else {}
    if not args.check_only:
        out["runs"] = []
        for c, requests, cfg in bench_workloads(pair, args, base_url):
            repeats = []
            for rep in range(args.repeats):
                run = await run_benchmark(requests, cfg, warmup=warmup_count(args, c) if rep == 0 else 0)
                repeats.append(run_summary(run, c, phase_means_ms(run.metrics_before, run.metrics_after),
                                           ahead_summary(ahead_from_metrics(run.metrics_before),
                                                         ahead_from_metrics(run.metrics_after)),
                                           router_ttft_mean_ms(run.metrics_before, run.metrics_after)))
            out["runs"].append(median_run(repeats))
    return out


@contextlib.contextmanager
def served_app(pair: Pair, layout: Layout, args: argparse.Namespace) -> Iterator[tuple[str, float]]:
    """The Serve app of `layout` on a fresh local Ray runtime that sees only the GPUs the layout needs:
    (base URL, start-up seconds); shut down on exit."""
    import ray
    from ray import serve

    from deploy.app import build_app

    release_gpu_cache()  # an in-process layout before this one left its memory to this process's allocator
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT)), "TOKENIZERS_PARALLELISM": "false"}
    if args.device == "cuda":
        # The raylet reads the visible GPUs when it starts: a layout sees just the ones it should use.
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(layout.num_gpus))
    from deploy.app import apply_local_cluster_env

    config = serve_config(pair, layout, args)
    apply_local_cluster_env(config)  # as `specserve serve` runs
    # Logical CPUs: each engine replica takes one for its router and one per rank, and two ingress replicas by
    # default on GPUs: past 8 a replica, four replicas on a 16-core machine would wait for CPUs that never free.
    cpus = max(os.cpu_count() or 1, 8 * layout.target_replicas)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=args.worker_logs,
             runtime_env={"env_vars": env})
    t0 = time.perf_counter()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(config), name="specserve", route_prefix="/")
        yield f"http://127.0.0.1:{args.port}", time.perf_counter() - t0
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)


def run_serve_layout(pair: Pair, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    with served_app(pair, layout, args) as (base_url, startup):
        return {"startup_s": startup, **asyncio.run(http_layout(pair, layout, args, base_url))}


def offline_greedy(llm: Any, pair: Pair, args: argparse.Namespace) -> list[str]:
    """The greedy check in process, as a served layout answers it over HTTP: the same prompts, one at a time.
    Besides comparing texts, it keeps the in-process bench comparable with the served one under synthetic
    acceptance: the check's steps draw from the target's random stream, and without them the in-process bench
    started at another point of it (acceptance length 4.16 in process against 3.99 served, every run)."""
    from engine.request import SamplingParams

    reqs, chat = check_prompts(pair, args)
    params = SamplingParams(max_tokens=args.check_tokens, temperature=0.0, ignore_eos=True)
    return [llm.generate([prompt_ids(r, llm.tokenizer, chat)], params)[0].text for r in reqs]


def run_offline_layout(pair: Pair, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    with offline_llm(serve_config(pair, layout, args)) as llm:
        out: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "runs": []}
        if args.check_prompts:
            out["check"] = offline_greedy(llm, pair, args)
        if not args.check_only:
            for c, requests, bench_cfg in bench_workloads(pair, args, "in-process"):
                repeats = []
                for rep in range(args.repeats):
                    totals: dict[str, list[float]] = {}
                    before = llm.engine.speculation_ahead_stats()
                    run = run_in_process(llm.engine, requests, bench_cfg, llm.tokenizer,
                                         warmup_count(args, c) if rep == 0 else 0, totals, tag=f"bench{rep}")
                    # (the first repeat's lookups count its warm-up's too: the engine keeps running totals only)
                    repeats.append(run_summary(run, c, phase_summary(totals),
                                               ahead_summary(before, llm.engine.speculation_ahead_stats())))
                out["runs"].append(median_run(repeats))
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen3-8b-0.6b", choices=["smollm2", "qwen3-8b-0.6b"])
    ap.add_argument("--layouts", nargs="+", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--acceptance", type=float, default=0.8, help="synthetic acceptance rate (qwen3 shapes)")
    add_agreement_args(ap)
    ap.add_argument("--dtype", default=None, help="float32 for the exactness checks; default bf16 on GPU")
    ap.add_argument("--check-only", action="store_true", help="greedy comparison only, no bench")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs: a faster start for --check-only runs")
    ap.add_argument("--check-prompts", type=int, default=4, help="0: no greedy check")
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts-per-concurrency", type=int, default=2)
    ap.add_argument("--min-prompts", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests before each concurrency (at least c)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="measured runs per concurrency on the same engine (warmed up once); the row is the repeat "
                         "with the median TPOT, and the TPOT column shows the repeats' range")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the engines' max_num_seqs (default: the largest concurrency); speculation ahead's branches "
                         "need rows beyond the requests (b4 at c=1: 4)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--worker-logs", action="store_true", help="show the workers' logs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON results (merged into an existing file)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    check_agreement_args(ap, args)
    # Checked here, before any engine starts: a bad value found by the first layout wastes its start-up.
    if args.check_prompts < 0 or (args.check_only and args.check_prompts == 0):
        ap.error(f"--check-prompts must be >= 0 (>= 1 with --check-only), got {args.check_prompts}")
    logging.basicConfig(level=logging.WARNING)

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.layouts = args.layouts or ["offline+d", "t1+d1", "t1+d1/plain", "t2+d2", "t2+d1"]
        args.concurrency, args.input_len, args.output_len = [1, 2], 16, 12
        args.check_prompts, args.check_tokens, args.max_model_len = 2, 12, 128
    layouts = [Layout.parse(x) for x in args.layouts or ["t1+d1", "t2+d2", "t2+d1"]]
    pair = prepare_pair(args, layouts)
    check_layouts(pair, layouts, args)
    lossless = pair.rejection_sampling != "synthetic"
    out_path = Path(args.out) if args.out else None
    doc: dict[str, Any] = json.loads(out_path.read_text()) if out_path and out_path.is_file() else {}
    run_key = f"{args.pair} {args.dtype or 'default'}{' check' if args.check_only else ''}"
    results: dict[str, Any] = doc.setdefault(run_key, {"pair": pair.name, "command": " ".join(sys.argv),
                                                       "env": environment(), "layouts": {}})["layouts"]
    for lay in layouts:
        print(f"[{lay.name}] starting", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            runner = run_offline_layout if lay.offline else run_serve_layout
            results[lay.name] = runner(pair, lay, args)
        except Exception as e:  # one failed layout must not cost the others their device time
            traceback.print_exc()
            results[lay.name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"[{lay.name}] done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        compare(results, layouts, lossless, args.bonus_agreement is not None or args.agreement_profile is not None)
        if out_path:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(doc, indent=1))
    print(f"\n### {pair.name}: {run_key}\n\n{environment()['device']}, k={args.k}, greedy, {args.output_len} "
          f"output tokens (EOS ignored), request rate inf\n")
    print(table(results, layouts, args))
    return 0 if all("error" not in results[lay.name] for lay in layouts) else 1


if __name__ == "__main__":
    sys.exit(main())
