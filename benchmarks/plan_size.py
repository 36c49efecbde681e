"""What one engine step's plan costs on the wire: pickled bytes, and pickle.dumps + pickle.loads time.

Plans come from the real path (EngineCore, Scheduler, KVCacheManagers, build_plan); only the models are replaced
by a stub executor that pickles each plan as a transport would, unpickles it, resolves it through a RequestTable
(as every side does) and answers with random tokens and acceptances. No model runs, so this is CPU-only and fast.

The shapes: a Gemma 3-like target (KV-cache groups: full attention and a 1024-token sliding window) and a Gemma 3
1B-like draft (full attention and a 512-token window), vocabulary 262144, k = 4, the default block size (16),
prompts of ~2000 tokens, sampled requests (temperature, top_p, top_k, seed). Figures are medians over the decode
steps after a warm-up (the prefill steps and the first few decodes). "loads" is what every receiving rank pays;
"resolve" is one side's RequestTable.resolve of the received plan (where a delta plan is made whole again);
"plan build" is EngineCore.make_plan on the scheduler's side.

    python benchmarks/plan_size.py [--steps 60] [--warmup 8] [--concurrency 1 16]
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig, SpeculativeConfig  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from engine.kv_cache.spec import AttentionSpec, KVCacheGroupSpec  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.step.plan import StepPlan, StepResult  # noqa: E402
from engine.step.request_table import RequestTable  # noqa: E402

VOCAB = 262144
PROMPT_TOKENS = 2000
K = 4
MAX_MODEL_LEN = 4096
NUM_BLOCKS = 4096  # per group: room for 16 requests' full contexts, so nothing is preempted


def gemma3_groups(window: int, num_layers: int, block_size: int) -> list[KVCacheGroupSpec]:
    """Gemma 3's layout: five sliding-window layers to one full-attention layer, as two KV-cache groups."""
    full = AttentionSpec(1, 256, torch.bfloat16, block_size, None)
    sliding = AttentionSpec(1, 256, torch.bfloat16, block_size, window)
    sliding_ids = tuple(i for i in range(num_layers) if i % 6 != 5)
    full_ids = tuple(i for i in range(num_layers) if i % 6 == 5)
    return [KVCacheGroupSpec(0, sliding, sliding_ids), KVCacheGroupSpec(1, full, full_ids)]


class PicklingExecutor:
    """The Executor protocol without models: each plan crosses a pickle boundary and a side's RequestTable."""

    def __init__(self, block_size: int, seed: int) -> None:
        self.target_kv_groups = gemma3_groups(1024, 34, block_size)
        self.target_num_blocks = NUM_BLOCKS
        self.draft_kv_groups = gemma3_groups(512, 26, block_size)
        self.draft_num_blocks = NUM_BLOCKS
        self.vocab_size = VOCAB
        self.async_scheduling = False
        self.speculation_ahead = False
        self.ahead_overlaps_verify = False
        self.table = RequestTable()
        self.rng = random.Random(seed)
        # Per executed step: (plan entries, all decodes, pickled bytes, dumps + loads seconds, loads seconds,
        # resolve seconds).
        self.records: list[tuple[int, bool, int, float, float, float]] = []

    def execute(self, plan: StepPlan, on_dispatched: object = None) -> StepResult:
        t0 = time.perf_counter()
        blob = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        t_dumped = time.perf_counter()
        received = pickle.loads(blob)
        t1 = time.perf_counter()
        resolved = self.table.resolve(received)
        t2 = time.perf_counter()
        decodes = all(p.token_ids is not None and len(p.token_ids) == 1 for p in resolved.requests)
        self.records.append((len(plan.requests), decodes, len(blob), t1 - t0, t1 - t_dumped, t2 - t1))
        sampled: list[list[int] | None] = []
        accepted: list[int] = []
        for p in resolved.requests:
            if not p.sample:
                sampled.append(None)
                accepted.append(0)
                continue
            n = self.rng.randint(0, p.num_draft_tokens)  # drafts accepted, then one token of the target's
            sampled.append([self.rng.randrange(3, VOCAB) for _ in range(n + 1)])
            accepted.append(n)
        result = StepResult(sampled, accepted, step_id=plan.step_id,
                            num_draft_tokens=[p.num_draft_tokens for p in resolved.requests])
        self.table.record(result)
        return result


def measure(concurrency: int, steps: int, warmup: int, seed: int = 0) -> dict[str, float]:
    config = EngineConfig(device=torch.device("cpu"), dtype=torch.float32, max_model_len=MAX_MODEL_LEN,
                          num_kv_blocks=NUM_BLOCKS, max_num_seqs=max(16, concurrency))
    executor = PicklingExecutor(config.block_size, seed)
    spec = SpeculativeConfig(draft_model="stub", num_speculative_tokens=K)
    engine = EngineCore(executor, config, None, [2], spec)  # type: ignore[arg-type]
    build_seconds: list[float] = []  # per step: EngineCore.make_plan (build_plan), aligned with executor.records
    make_plan = engine.make_plan

    def timed_make_plan(scheduled: list) -> StepPlan:
        t0 = time.perf_counter()
        plan = make_plan(scheduled)
        build_seconds.append(time.perf_counter() - t0)
        return plan

    engine.make_plan = timed_make_plan  # type: ignore[method-assign]
    rng = random.Random(seed)
    for i in range(concurrency):
        prompt = [rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS + i)]
        params = SamplingParams(max_tokens=(warmup + steps) * (K + 1) + 8, temperature=0.8, top_p=0.95, top_k=64,
                                seed=1000 + i, ignore_eos=True, detokenize=False)
        engine.add_request(Request(f"req-{i:04d}", prompt, params))
    decoding = 0
    while decoding < warmup + steps:
        engine.step()
        n, decodes, *_ = executor.records[-1]
        if decodes and n == concurrency:
            decoding += 1
    rows = [r + (b,) for r, b in zip(executor.records, build_seconds, strict=True)
            if r[1] and r[0] == concurrency][warmup:warmup + steps]
    return {"concurrency": concurrency, "steps": len(rows),
            "bytes_median": statistics.median(r[2] for r in rows),
            "bytes_mean": statistics.fmean(r[2] for r in rows),
            "pickle_us_median": statistics.median(r[3] for r in rows) * 1e6,
            "loads_us_median": statistics.median(r[4] for r in rows) * 1e6,
            "resolve_us_median": statistics.median(r[5] for r in rows) * 1e6,
            "build_us_median": statistics.median(r[6] for r in rows) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    print("| concurrent requests | plan bytes (median) | plan bytes (mean) | dumps + loads us (median) "
          "| of which loads us | side's resolve us (median) | plan build us (median) |")
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        m = measure(c, args.steps, args.warmup)
        print(f"| {c} | {m['bytes_median']:.0f} | {m['bytes_mean']:.0f} | {m['pickle_us_median']:.0f} "
              f"| {m['loads_us_median']:.0f} | {m['resolve_us_median']:.0f} | {m['build_us_median']:.0f} |")


if __name__ == "__main__":
    main()
