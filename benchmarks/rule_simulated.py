"""The draft length rule on a simulated clock over many seeds: what it commits against the best fixed k.

A step at batch 1 and draft length k costs 1 + k x `draft` (a target step bound by its weights, a draft forward
costing `draft` of it); each draft is accepted with probability `accept` while the ones before it were. For each seed
the rule (engine/speculation/draft_length_rule.py) runs `steps` steps from nothing, and its k's expected tokens a
second (warm-up and probes included) are divided by the best fixed k's. The acceptance draws follow the seed, so
one seed is one benchmark run's luck.

--host instead times the rule's own host work a step (choose, planned, each request's k, observe: what the engine
calls), median over 2000 steps after 1000, at batch 1 (acceptance 0.8), 32 (0.8) and 64 (a draft that accepts
nothing: the rule sits at k = 0, where its time is all the speculating engine adds to the target alone's step).

    python benchmarks/rule_simulated.py --draft 0.05,0.1 --steps 100,300,1000 --seeds 40
    python benchmarks/rule_simulated.py --host
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.speculation.draft_cost_model import expected_tokens
from engine.speculation.draft_length_rule import DraftLengthRule


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(seed: int, steps: int, draft: float, accept: float, max_k: int) -> float:
    """The rule's expected tokens a second over `steps` steps, over the best fixed k's."""
    clock, rng = Clock(), random.Random(seed)
    rule = DraftLengthRule(max_k, clock=clock)
    tokens = 0.0
    for i in range(steps):
        k = rule.choose(1)
        rule.planned(i, k, timed=True)
        n = 0
        while n < k and rng.random() < accept:
            n += 1
        tokens += expected_tokens([accept] * max_k, k)
        clock.t += 1.0 + k * draft
        rule.observe(i, [("r", k, n)] if k else [], k * draft if k else None)
    best = max(expected_tokens([accept] * max_k, k) / (1.0 + k * draft) for k in range(max_k + 1))
    return tokens / clock.t / best


def host_us(batch: int, accept: float, draft: float, max_k: int, steps: int = 3000) -> float:
    """Median microseconds of the rule's host work a step, over the steps after the first third."""
    clock, rng = Clock(), random.Random(0)
    rule = DraftLengthRule(max_k, clock=clock)
    spent = []
    for i in range(steps):
        t0 = time.perf_counter()
        k = rule.choose(batch, lambda: batch * 10)
        rule.planned(i, k, timed=True)
        ks = [rule.request_k(f"r{r}", k) for r in range(batch)]
        t1 = time.perf_counter()
        verifies = []
        for r, kr in enumerate(ks):
            n = 0
            while n < kr and rng.random() < accept:
                n += 1
            if kr:
                verifies.append((f"r{r}", kr, n))
        clock.t += 1.0 + k * draft + 0.05 * max(0, batch * (k + 1) - 16)
        t2 = time.perf_counter()
        rule.observe(i, verifies, k * draft if k else None)
        if i >= steps // 3:
            spent.append(t1 - t0 + time.perf_counter() - t2)
    return statistics.median(spent) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="0.05,0.1", help="a draft forward's cost, in target steps")
    ap.add_argument("--steps", default="100,300,1000")
    ap.add_argument("--accept", type=float, default=0.8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--host", action="store_true", help="time the rule's host work a step instead")
    args = ap.parse_args()
    if args.host:
        print("| batch | acceptance | rule's host work a step, us |")
        print("|---|---|---|")
        for batch, accept, draft in ((1, 0.8, 0.1), (32, 0.8, 0.2), (64, 0.0, 0.75)):
            print(f"| {batch} | {accept} | {host_us(batch, accept, draft, args.k):.1f} |")
        return
    print("| draft | steps | mean | lowest | 10th percentile |")
    print("|---|---|---|---|---|")
    for draft in (float(d) for d in args.draft.split(",")):
        for steps in (int(s) for s in args.steps.split(",")):
            got = sorted(run(seed, steps, draft, args.accept, args.k) for seed in range(args.seeds))
            print(f"| {draft} | {steps} | {statistics.mean(got):.3f} | {got[0]:.3f} | {got[args.seeds // 10]:.3f} |")


if __name__ == "__main__":
    main()
