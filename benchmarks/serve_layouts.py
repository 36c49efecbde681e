"""Target and draft on their own GPU groups through the Ray Serve app: greedy outputs, tokens/s and router overhead
per layout.

    python benchmarks/serve_layouts.py --pair qwen3-8b-0.6b \\
        --layouts offline offline+d t1+d1 t1+d1/plain t2 t2+d2 t2+d1 t2+d1/shared t1+d1/colocated --out layouts.json
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
/ off; by default on where no GPU is shared).
`offline` and `offline+d` are the in-process engine (engine.LLM, no Ray, no HTTP) on one GPU, the reference for
serving's cost; `offline+d/predraft` drafts ahead in process (after each verify, not beside it); `offline/sync` runs
each step to its end before the next (in process a target alone otherwise queues each step before it reads the
last one's tokens: engine/decode_pipeline.py).

--bonus-agreement R (synthetic pairs only, a benchmark-only setting): random weights never agree on a bonus token,
so a window drafted ahead would never hit; with it, a lookup whose drafts were all accepted counts the bonus as the
draft's guess at rate R (measure R on a real pair: benchmarks/speculation_ahead.py). The hit rates and unused
draft tokens of each run come from /metrics (spec_ahead_*).

Per layout, on a fresh Ray runtime that sees only the GPUs the layout needs:
  check  greedy completions of --check-prompts prompts, one at a time, compared with the first layout of the run
         that has the same draft (none / one) at tensor-parallel sizes 1 and no options but `shared` (the real
         SmolLM2 pair with probabilistic rejection is lossless, so there the target alone is the reference for
         every layout)
  bench  `specserve bench` at each --concurrency (random or eval prompts, fixed output length, greedy, rate inf):
         output tokens/s, TPOT, and from /metrics the mean time per step of each phase; the router's own share
         of a step is schedule + dispatch + commit (dispatch: the executor's transport, plan out and result back).
Random weights (the Qwen3 shapes) are drawn per checkpoint tensor and sharded like real weights, so every
tensor-parallel size holds the same model. A layout that fails is recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment  # noqa: E402
from engine_driver import offline_llm, prompt_ids, run_in_process  # noqa: E402
from sweep_models import Pair, bench_workloads, materialize, model_pairs, warmup_count  # noqa: E402

from deploy.bench.datasets import build_requests, load_tokenizer  # noqa: E402
from deploy.bench.report import summarize  # noqa: E402
from deploy.bench.runner import run_benchmark  # noqa: E402

logger = logging.getLogger("specserve")
PHASES = ("schedule", "propose", "handoff", "prepare", "verify", "sample", "propose_ahead", "between", "dispatch",
          "commit")
# The router's share of a step: its bookkeeping and the transport (handoff: the draft's proposal to the target).
ROUTER_PHASES = ("schedule", "dispatch", "handoff", "commit")


@dataclass(frozen=True)
class Layout:
    name: str
    offline: bool
    target_tp: int
    draft_tp: int  # 0: no draft
    plain: bool = False
    shared: bool = False
    colocated: bool = False  # the draft in the target's worker processes (draft_placement "colocated")
    nccl: bool = False
    ahead: bool | None = None  # launch_verify_ahead forced on / off; None: the executor's default
    sync: bool = False  # async_scheduling off
    predraft: bool | None = None  # speculation_ahead forced on / off; None: the executor's default

    @staticmethod
    def parse(text: str) -> Layout:
        head, *opts = text.split("/")
        unknown = set(opts) - {"plain", "shared", "colocated", "nccl", "ahead", "noahead", "sync", "predraft",
                               "nopredraft"}
        if unknown:
            raise ValueError(f"layout {text!r}: unknown options {sorted(unknown)}")
        if "predraft" in opts and "nopredraft" in opts:
            raise ValueError(f"layout {text!r}: predraft or nopredraft, not both")
        predraft = True if "predraft" in opts else False if "nopredraft" in opts else None
        if head in ("offline", "offline+d"):
            if set(opts) - ({"predraft", "sync"} if head == "offline+d" else {"sync"}):
                raise ValueError(f"layout {text!r}: the offline engine takes no options but sync and predraft "
                                 "(with a draft)")
            return Layout(text, True, 1, int(head.endswith("+d")), sync="sync" in opts, predraft=predraft)
        parts = head.split("+")
        try:
            if not parts[0].startswith("t") or (len(parts) == 2 and not parts[1].startswith("d")) or len(parts) > 2:
                raise ValueError
            t, d = int(parts[0][1:]), int(parts[1][1:]) if len(parts) == 2 else 0
        except ValueError:
            raise ValueError(f"layout {text!r} is not t<T>[+d<D>][/plain][/shared|/colocated][/nccl]"
                             "[/ahead|/noahead][/sync]") from None
        if t < 1 or (len(parts) == 2 and d < 1):
            raise ValueError(f"layout {text!r}: sizes must be >= 1")
        if set(opts) & {"shared", "colocated", "nccl", "ahead", "noahead", "predraft", "nopredraft"} and not d:
            raise ValueError(f"layout {text!r}: shared, colocated, nccl, ahead, noahead, predraft and nopredraft "
                             "need a draft")
        if "colocated" in opts and (d != t or set(opts) & {"shared", "nccl", "ahead", "noahead"}):
            raise ValueError(f"layout {text!r}: colocated needs the target's size for the draft, and takes neither "
                             "shared, nccl, ahead nor noahead (no proposal leaves the target's process)")
        if "ahead" in opts and "noahead" in opts:
            raise ValueError(f"layout {text!r}: ahead or noahead, not both")
        ahead = True if "ahead" in opts else False if "noahead" in opts else None
        return Layout(text, False, t, d, "plain" in opts, "shared" in opts, "colocated" in opts, "nccl" in opts,
                      ahead, "sync" in opts, predraft)

    @property
    def num_gpus(self) -> int:
        return self.target_tp if (self.offline or self.shared or self.colocated) else self.target_tp + self.draft_tp

    def reference_key(self, lossless: bool) -> bool:
        """Layouts with equal keys must give equal greedy outputs: all of them when rejection is lossless, else
        those with a draft apart from those without (synthetic acceptance changes the tokens)."""
        return not lossless and self.draft_tp > 0

    @property
    def is_reference(self) -> bool:
        # `shared` and `colocated` only place the draft, so a one-GPU run can take either as its reference.
        return not self.offline and self.target_tp == 1 and self.draft_tp <= 1 and self.ahead is None and not (
            self.plain or self.nccl) and not self.predraft


def serve_config(pair: Pair, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    engine_kwargs: dict[str, Any] = {"max_num_seqs": max(args.concurrency), **pair.engine_kwargs}
    if args.smoke:
        engine_kwargs.update(num_kv_blocks=512, max_num_batched_tokens=512)
    if args.device == "cuda" and layout.shared:
        engine_kwargs.update(target_resources={"GPU": 0.75}, draft_resources={"GPU": 0.25})
    if layout.colocated:
        engine_kwargs["draft_placement"] = "colocated"
    if layout.plain:
        engine_kwargs["use_compiled_graph"] = False
    if args.eager:
        engine_kwargs["enforce_eager"] = True
    if layout.nccl:
        engine_kwargs["draft_tensor_transport"] = "nccl"
    if layout.ahead is not None:
        engine_kwargs["launch_verify_ahead"] = layout.ahead
    if layout.sync:
        engine_kwargs["async_scheduling"] = False
    if layout.predraft is not None:
        engine_kwargs["speculation_ahead"] = layout.predraft
    if args.bonus_agreement is not None and layout.draft_tp and pair.synthetic_acceptance_rate is not None:
        engine_kwargs["synthetic_bonus_agreement"] = args.bonus_agreement
    return {"model": pair.target, "draft_model": pair.draft if layout.draft_tp else None,
            "num_speculative_tokens": args.k, "rejection_sampling": pair.rejection_sampling,
            "synthetic_acceptance_rate": pair.synthetic_acceptance_rate if layout.draft_tp else None,
            "tensor_parallel_size": layout.target_tp, "draft_tensor_parallel_size": max(1, layout.draft_tp),
            "max_model_len": args.max_model_len, "device": args.device, "dtype": args.dtype,
            "served_model_name": "bench", "engine_kwargs": engine_kwargs, "spec_disable_above_batch_size": None,
            "max_queued_requests": None}


def phase_means_ms(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """`phase_summary` of the steps between two /metrics scrapes."""
    if not before or not after:
        return {}
    totals: dict[str, list[float]] = {}
    for phase in PHASES:
        # The bench client's parser sums each series over the engine replicas under its unlabelled name.
        count, total = (f'specserve_step_duration_seconds_{s}{{phase="{phase}"}}' for s in ("count", "sum"))
        totals[phase] = [after.get(total, 0.0) - before.get(total, 0.0), after.get(count, 0.0) - before.get(count, 0.0)]
    return phase_summary(totals)


def phase_summary(totals: dict[str, list[float]]) -> dict[str, float]:
    """Mean milliseconds per step of each phase from [seconds, steps] totals (steps: those that had the phase),
    the router's share of a step and the step count."""
    out = {p: 1e3 * totals[p][0] / totals[p][1] for p in PHASES if p in totals and totals[p][1] > 0}
    if out:
        out["router"] = sum(out.get(p, 0.0) for p in ROUTER_PHASES)
        out["steps"] = max(totals[p][1] for p in PHASES if p in totals)
    return out


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
    out: dict[str, Any] = {"check": await http_greedy(base_url, pair, args)}
    if not args.check_only:
        out["runs"] = []
        for c, requests, cfg in bench_workloads(pair, args, base_url):
            run = await run_benchmark(requests, cfg, warmup=warmup_count(args, c))
            out["runs"].append(run_summary(run, c, phase_means_ms(run.metrics_before, run.metrics_after),
                                           ahead_summary(ahead_from_metrics(run.metrics_before),
                                                         ahead_from_metrics(run.metrics_after))))
    return out


AHEAD_COUNTERS = ("lookups", "hits", "drafted_tokens", "unused_tokens")


def ahead_from_metrics(metrics: dict[str, float] | None) -> tuple[float, ...] | None:
    """The spec_ahead_* counters of a /metrics scrape, in StepResult.ahead's order."""
    if not metrics:
        return None
    return tuple(metrics.get(f"specserve_spec_ahead_{name}_total", 0.0) for name in AHEAD_COUNTERS)


def ahead_summary(before: tuple[float, ...] | None, after: tuple[float, ...] | None) -> dict[str, float] | None:
    """Speculation ahead over a run: hit rate (hits / lookups) and the share of tokens drafted ahead that were
    never proposed; None where nothing was drafted ahead."""
    if before is None or after is None:
        return None
    lookups, hits, drafted, unused = (a - b for a, b in zip(after, before))
    if not drafted:
        return None
    return {"hit_rate": hits / max(lookups, 1), "unused_share": unused / drafted, "lookups": lookups}


def run_summary(run: Any, c: int, phases: dict[str, float],
                ahead: dict[str, float] | None = None) -> dict[str, Any]:
    s = summarize(run, f"c={c}")
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed at concurrency {c}: {s['per_request']['errors'][0]}")
    spec = s.get("spec_decode") or {}
    return {"concurrency": c, "output_tok_s": s["output_throughput"], "median_tpot_ms": s["median_tpot_ms"],
            "median_ttft_ms": s["median_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"], "median_itl_ms": s["median_itl_ms"],
            "duration_s": s["duration_s"], "completed": s["completed"],
            "acceptance_length": spec.get("acceptance_length"), "phases_ms": phases, "ahead": ahead}


def run_serve_layout(pair: Pair, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from deploy.app import build_app

    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT)), "TOKENIZERS_PARALLELISM": "false"}
    if args.device == "cuda":
        # The raylet reads the visible GPUs when it starts: a layout sees just the ones it should use.
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(layout.num_gpus))
    ray.init(num_cpus=max(os.cpu_count() or 1, 8), include_dashboard=False, log_to_driver=args.worker_logs,
             runtime_env={"env_vars": env})
    t0 = time.perf_counter()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(serve_config(pair, layout, args)), name="specserve", route_prefix="/")
        startup = time.perf_counter() - t0
        out = asyncio.run(http_layout(pair, layout, args, f"http://127.0.0.1:{args.port}"))
        return {"startup_s": startup, **out}
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)


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
        out: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "runs": [],
                               "check": offline_greedy(llm, pair, args)}
        if not args.check_only:
            for c, requests, bench_cfg in bench_workloads(pair, args, "in-process"):
                totals: dict[str, list[float]] = {}
                before = llm.engine.speculation_ahead_stats()
                run = run_in_process(llm.engine, requests, bench_cfg, llm.tokenizer, warmup_count(args, c), totals)
                # (the warm-up's lookups are counted too: the engine keeps running totals only)
                out["runs"].append(run_summary(run, c, phase_summary(totals),
                                               ahead_summary(before, llm.engine.speculation_ahead_stats())))
        return out


def compare(results: dict[str, Any], layouts: list[Layout], lossless: bool, bonus_agreement: bool = False) -> None:
    """Mark each layout's greedy texts against its reference: `matches`, and the share of equal texts.
    bonus_agreement: a synthetic pair's layouts that may draft ahead are not compared (the setting feeds the draft
    its guess where the target had another bonus token, which changes which drafts synthetic acceptance keeps)."""
    if bonus_agreement and not lossless:
        layouts = [lay for lay in layouts if not (lay.draft_tp and lay.predraft is not False)]
    refs: dict[bool, str] = {}
    for lay in layouts:
        r = results.get(lay.name) or {}
        if lay.is_reference and "check" in r and lay.reference_key(lossless) not in refs:
            refs[lay.reference_key(lossless)] = lay.name
    for lay in layouts:
        r = results.get(lay.name) or {}
        ref = refs.get(lay.reference_key(lossless))
        if "check" not in r or ref is None:
            continue
        mine, theirs = r["check"], results[ref]["check"]
        r["check_reference"] = ref
        r["check_equal"] = sum(a == b for a, b in zip(mine, theirs))
        r["check_total"] = len(theirs)
        r["matches"] = mine == theirs


def table(results: dict[str, Any], layouts: list[Layout], args: argparse.Namespace) -> str:
    per_c = " | ".join(f"c={c} tok/s | c={c} TPOT ms | c={c} router ms/step | c={c} ahead hit rate"
                       for c in args.concurrency)
    lines = [f"| layout | GPUs | greedy equal to | {per_c} | phases at c={args.concurrency[0]} (ms/step) |",
             "|---|---|---|" + "---|---|---|---|" * len(args.concurrency) + "---|"]
    for lay in layouts:
        r = results.get(lay.name) or {}
        if "error" in r:
            lines.append(f"| {lay.name} | {lay.num_gpus} | failed: {r['error'][:80]} |")
            continue
        eq = (f"{r['check_reference']}: {r['check_equal']}/{r['check_total']}" if "check_reference" in r else "-")
        cells = [lay.name, str(lay.num_gpus), eq]
        runs = {x["concurrency"]: x for x in r.get("runs", [])}
        for c in args.concurrency:
            x = runs.get(c)
            router = (x or {}).get("phases_ms", {}).get("router")
            ahead = (x or {}).get("ahead")
            cells += [f"{x['output_tok_s']:.1f}" if x else "-",
                      f"{x['median_tpot_ms']:.2f}" if x and x["median_tpot_ms"] else "-",
                      f"{router:.2f}" if router is not None else "-",
                      f"{ahead['hit_rate']:.2f} ({ahead['unused_share']:.0%} unused)" if ahead else "-"]
        ph = (runs.get(args.concurrency[0]) or {}).get("phases_ms", {})
        cells.append(", ".join(f"{p} {ph[p]:.2f}" for p in PHASES if p in ph) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    # Where tokens/s and TPOT disagree, the time to first token (which tokens/s includes) says why.
    lines += ["", "| layout | " + " | ".join(f"c={c} TTFT median / p99 ms | c={c} ITL median ms | c={c} duration s"
                                             for c in args.concurrency) + " |",
              "|---|" + "---|---|---|" * len(args.concurrency)]
    for lay in layouts:
        runs = {x["concurrency"]: x for x in (results.get(lay.name) or {}).get("runs", [])}
        cells = [lay.name]
        for c in args.concurrency:
            x = runs.get(c) or {}
            cells += [f"{x['median_ttft_ms']:.1f} / {x['p99_ttft_ms']:.1f}" if x.get("median_ttft_ms") else "-",
                      f"{x['median_itl_ms']:.2f}" if x.get("median_itl_ms") else "-",
                      f"{x['duration_s']:.2f}" if x.get("duration_s") else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen3-8b-0.6b", choices=["smollm2", "qwen3-8b-0.6b"])
    ap.add_argument("--layouts", nargs="+", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--acceptance", type=float, default=0.8, help="synthetic acceptance rate (qwen3 shapes)")
    ap.add_argument("--bonus-agreement", type=float, default=None,
                    help="benchmark-only: rate at which a synthetic pair's bonus token counts as the draft's guess")
    ap.add_argument("--dtype", default=None, help="float32 for the exactness checks; default bf16 on GPU")
    ap.add_argument("--check-only", action="store_true", help="greedy comparison only, no bench")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs: a faster start for --check-only runs")
    ap.add_argument("--check-prompts", type=int, default=4)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts-per-concurrency", type=int, default=2)
    ap.add_argument("--min-prompts", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests before each concurrency (at least c)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--device", default=None)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--worker-logs", action="store_true", help="show the workers' logs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON results (merged into an existing file)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.layouts = args.layouts or ["offline+d", "t1+d1", "t1+d1/plain", "t2+d2", "t2+d1"]
        args.concurrency, args.input_len, args.output_len = [1, 2], 16, 12
        args.check_prompts, args.check_tokens, args.max_model_len = 2, 12, 128
    layouts = [Layout.parse(x) for x in args.layouts or ["t1+d1", "t2+d2", "t2+d1"]]
    if args.device == "cuda":
        have = torch.cuda.device_count()
        too_big = [lay.name for lay in layouts if lay.num_gpus > have]
        if too_big:
            raise SystemExit(f"layouts {too_big} need more than the {have} GPUs here")
    work = Path(args.work_dir or Path(tempfile.gettempdir()) / "specserve-sweep")
    work.mkdir(parents=True, exist_ok=True)
    pair = model_pairs(work, args.smoke, args.device, args.acceptance)[args.pair]
    materialize(args.pair, pair, work, args.smoke, args.device)
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
        compare(results, layouts, lossless, args.bonus_agreement is not None)
        if out_path:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(doc, indent=1))
    print(f"\n### {pair.name}: {run_key}\n\n{environment()['device']}, k={args.k}, greedy, {args.output_len} "
          f"output tokens (EOS ignored), request rate inf\n")
    print(table(results, layouts, args))
    return 0 if all("error" not in results[lay.name] for lay in layouts) else 1


if __name__ == "__main__":
    sys.exit(main())
