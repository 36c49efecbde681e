"""The draft length rule on a simulated clock over many seeds: what it commits against the best fixed k.

A step at batch 1 and draft length k costs 1 + k x `draft` (a target step bound by its weights, a draft forward
costing `draft` of it); each draft is accepted with probability `accept` while the ones before it were. For each seed
the rule (engine/speculation/draft_length_rule.py) runs `steps` steps from nothing, and its k's expected tokens a
second (warm-up and probes included) are divided by the best fixed k's. The acceptance draws follow the seed, so
one seed is one benchmark run's luck.

    python benchmarks/rule_simulated.py --draft 0.05,0.1 --steps 100,300,1000 --seeds 40
"""

from __future__ import annotations

import argparse
import random
import statistics

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="0.05,0.1", help="a draft forward's cost, in target steps")
    ap.add_argument("--steps", default="100,300,1000")
    ap.add_argument("--accept", type=float, default=0.8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=40)
    args = ap.parse_args()
    print("| draft | steps | mean | lowest | 10th percentile |")
    print("|---|---|---|---|---|")
    for draft in (float(d) for d in args.draft.split(",")):
        for steps in (int(s) for s in args.steps.split(",")):
            got = sorted(run(seed, steps, draft, args.accept, args.k) for seed in range(args.seeds))
            print(f"| {draft} | {steps} | {statistics.mean(got):.3f} | {got[0]:.3f} | {got[args.seeds // 10]:.3f} |")


if __name__ == "__main__":
    main()
