"""Predict tokens/s of the draft on a GPU of its own (t1+d1, t2+d1) from phase times measured on one GPU.

    python benchmarks/overlap_model.py layouts.json                  # the serve_layouts.py JSON of a one-GPU run
    python benchmarks/overlap_model.py layouts.json --hit-rate 0.3 --target-tp-speedup 1.8
    python benchmarks/overlap_model.py layouts.json --hit-rate 0.16 0.35 --branches 1 4 --window-growth 0.1

The one-GPU run (`serve_layouts.py --layouts offline offline+d t1 t1/sync t1+d1/shared t1+d1/shared/sync`) gives
each phase's mean milliseconds per step: propose (the draft's k steps), verify and sample (the target), prepare,
handoff (the proposal's trip to the target's worker), and the router's schedule, dispatch and commit. On two GPUs
the draft and the target stop sharing one, so the model composes a step from those phases per schedule:

  in process, serial        propose + prepare + verify + sample + schedule + commit   (measured: offline+d)
  served, synchronous       propose + handoff + verify + sample + dispatch + schedule + commit
  served, asynchronous      propose + handoff + verify + sample + absorb        (the router's work overlaps; absorb,
                                                                                  the result's trip to the draft,
                                                                                  costs what the handoff costs)
  + speculation ahead       2 x handoff + max(verify + sample, ahead) + (1 - hit rate) x propose
                            (the draft drafts the next window, k + 1 forwards: `ahead`, while the target verifies;
                            a hit proposes it at once, a miss drafts the real window after it)

and decode tokens/s = concurrency x acceptance length / step, to be compared with the measured
concurrency x 1000 / median TPOT (the measured output tokens/s also holds prefill and the gaps between requests).
The hit rate of speculation ahead (the next window pre-drafted
for the outcome that happens) is at most P(all k drafts accepted) x P(the bonus token among the pre-drafted guesses)
with one window per request: with synthetic acceptance a per draft that is a^k x b. With a branch budget B
(`speculation_ahead_branches`) windows for rejection points add their hits: give one hit rate per budget
(`--hit-rate h1 h2 --branches 1 4`, e.g. as benchmarks/speculation_ahead.py measures them). The B windows of a step
are one draft-loop run of rows x B (the same k + 1 forwards, B times the rows), so its cost grows with B by however
much a forward's time grows with its rows: on a GPU at small batch, little. `--window-growth g` models it as
ahead x (1 + g x (B - 1)); g is an assumption of the model until a run measures speculation_ahead at B > 1 (0: a
latency-bound draft whose forwards cost the same at B x the rows). `--target-tp-speedup` divides verify and sample
(a target at TP 2). A model, not a measurement: it assumes the phases keep their one-GPU times when the GPU is no
longer shared (they get faster, so the predictions are conservative there) and ignores contention between the two
processes' host threads, and the copy of a scratch window's blocks on a hit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def phases_of(layouts: dict[str, Any], name: str, c: int) -> tuple[dict[str, float], float] | None:
    """(phases ms per step, acceptance length) of one layout at concurrency c, from serve_layouts.py's JSON."""
    r = layouts.get(name) or {}
    for run in r.get("runs", []):
        if run["concurrency"] == c:
            return run.get("phases_ms", {}), float(run.get("acceptance_length") or 1.0)
    return None


def predict(ph: dict[str, float], accept_len: float, c: int, hit_rate: float, tp_speedup: float,
            k: int = 4, branches: int = 1, window_growth: float = 0.0) -> dict[str, float]:
    """Tokens/s per schedule from one-GPU phase means (ms). The window ahead costs the measured `speculation_ahead`
    phase where the run has one (offline+d/predraft, one window per request), else (k + 1) / k of a proposal;
    with a branch budget, that times 1 + window_growth x (branches - 1) (see the module docstring)."""
    g = ph.get
    target = (g("verify", 0.0) + g("sample", 0.0)) / tp_speedup
    propose, handoff = g("propose", 0.0), g("handoff", 0.0)
    ahead = (g("speculation_ahead") or propose * (k + 1) / k) * (1 + window_growth * (branches - 1))
    router = g("schedule", 0.0) + g("dispatch", 0.0) + g("commit", 0.0)
    steps = {
        "serial": propose + g("prepare", 0.0) + target + g("schedule", 0.0) + g("commit", 0.0),
        "sync": propose + handoff + target + router,
        "async": propose + 2 * handoff + target,
    }
    steps["async+ahead"] = 2 * handoff + max(target, ahead) + (1 - hit_rate) * propose
    return {k: c * accept_len / (v / 1e3) for k, v in steps.items() if v > 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="serve_layouts.py --out JSON of a one-GPU run")
    ap.add_argument("--run", default=None, help="the run key inside the JSON (default: the first)")
    ap.add_argument("--from-layout", default="t1+d1/shared/sync",
                    help="layout whose phases feed the model (a synchronous served run has every phase)")
    ap.add_argument("--hit-rate", type=float, nargs="+", default=None,
                    help="speculation-ahead hit rates; default: 0.8^4 x {0.5, 0.9}, i.e. 0.20 and 0.37")
    ap.add_argument("--branches", type=int, nargs="+", default=None,
                    help="the branch budget of each --hit-rate (default: 1 for every one)")
    ap.add_argument("--window-growth", type=float, default=0.0,
                    help="the window's cost growth per extra branch, a fraction of its one-branch cost (a model "
                         "assumption; 0: forwards of B x the rows cost what one row's does)")
    ap.add_argument("--target-tp-speedup", type=float, default=1.0)
    ap.add_argument("--ahead-layout", default="offline+d/predraft",
                    help="layout whose measured speculation_ahead phase is the window ahead's cost, where the run "
                         "has it")
    ap.add_argument("--k", type=int, default=4, help="draft length (the window ahead's cost without a measurement)")
    args = ap.parse_args()
    doc = json.loads(Path(args.results).read_text())
    run = doc[args.run] if args.run else next(iter(doc.values()))
    layouts = run["layouts"]
    hits = args.hit_rate or [round(0.8 ** 4 * b, 2) for b in (0.5, 0.9)]
    budgets = args.branches or [1] * len(hits)
    if len(budgets) != len(hits):
        ap.error("--branches needs one budget per --hit-rate")
    print(f"### Predicted tokens/s, draft on a GPU of its own (phases of {args.from_layout}; "
          f"target TP speed-up {args.target_tp_speedup}; window growth {args.window_growth} per extra branch)\n")
    print("| c | measured offline+d (c x 1000/TPOT) | measured offline, no draft | serial | served sync | "
          "served async | " + " | ".join(f"async + ahead, B={b} hit {h}" for b, h in zip(budgets, hits)) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(hits))
    for c in sorted({x["concurrency"] for r in layouts.values() for x in r.get("runs", [])}):
        got = phases_of(layouts, args.from_layout, c)
        if got is None:
            continue
        ph, acc = got
        measured_ahead = phases_of(layouts, args.ahead_layout, c)
        if measured_ahead is not None and measured_ahead[0].get("speculation_ahead"):
            ph = {**ph, "speculation_ahead": measured_ahead[0]["speculation_ahead"]}
        measured = {n: next((c * 1e3 / x["median_tpot_ms"] for x in (layouts.get(n) or {}).get("runs", [])
                             if x["concurrency"] == c and x.get("median_tpot_ms")), None)
                    for n in ("offline+d", "offline")}
        base = predict(ph, acc, c, 0.0, args.target_tp_speedup, args.k)
        ahead = [predict(ph, acc, c, h, args.target_tp_speedup, args.k, b, args.window_growth)["async+ahead"]
                 for b, h in zip(budgets, hits)]
        fmt = [f"{v:.1f}" if v else "-" for v in (measured["offline+d"], measured["offline"])]
        print(f"| {c} | " + " | ".join(fmt + [f"{base[k]:.1f}" for k in ("serial", "sync", "async")]
                                       + [f"{v:.1f}" for v in ahead]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
