"""Speculation ahead on a real pair: how often a window drafted ahead is the next proposal (its hit rate), how
many of the tokens drafted ahead go unused, and why windows miss, on the eval split at T=0 and T=0.7, for each
branch budget B (EngineConfig.speculation_ahead_branches: windows drafted ahead per request).

    python benchmarks/speculation_ahead.py [--target smollm2-135m-instruct] [--draft smollm2-135m-draft] [--k 4]
        [--num-prompts 60] [--max-tokens 128] [--branches 1 2 4 6] [--json FILE]

In process (engine.LLM with speculation_ahead=True; the hit rate does not depend on where the draft runs), every
eval prompt with the chat template, batched, probabilistic rejection. A window drafted ahead hits when every draft
of the step before was accepted AND the target's bonus token equals the draft's guess (its argmax there), so
hit rate = P(all accepted) x P(bonus agrees | all accepted); both factors are printed. The second one is the rate
to give `serve_layouts.py --bonus-agreement` for a synthetic pair of random weights. With B > 1 the hits split into
all-accepted windows and rejection windows (the target's token at a rejection guessed as the draft's runner-up);
`drafted/lookup` is the tokens drafted ahead per lookup (the window's cost grows with it: one draft-loop run of
rows x B), `skipped` the windows chosen but not drafted (scratch reserve or row cap full).

Tree mode (`--tree-fanout F ...`, EngineConfig.speculation_ahead_tree_fanout: one tree per request over every
outcome of its verify, up to F candidates an outcome) runs an engine per F beside the window runs, and reports the
engine's own counters: the hit rate, hits by outcome a (drafts accepted before the target's token; a = k is the
bonus), the tree's width (nodes fed per tree), tokens drafted ahead per lookup and their unused share. Tree mode
drafts seeded sampled requests just in time (never ahead), so a seeded T > 0 run would never hit: `--unseeded` runs
the sampled requests without a seed (their outputs then differ run to run; the counters are what is measured).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, save_json  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.distill.data import encode_prompt, load_prompts  # noqa: E402
from engine.speculation.ahead.totals import COUNTERS  # noqa: E402

TEMPERATURES = (0.0, 0.7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--num-prompts", type=int, default=None, help="eval prompts (default: all 60)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--branches", type=int, nargs="*", default=[1],
                    help="speculation_ahead_branches values to measure, an engine each (none: tree mode only)")
    ap.add_argument("--tree-fanout", default=[], nargs="+",
                    help="speculation_ahead_tree_fanout values to measure too (tree mode), e.g. 1,2,4,8 or 1 2 4 8")
    ap.add_argument("--unseeded", action="store_true",
                    help="sampled requests without a seed (tree mode drafts seeded ones just in time)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=list(TEMPERATURES))
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    fanouts = [int(f) for spec in args.tree_fanout for f in str(spec).split(",") if f]
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = []
    for branches in args.branches:
        rows += measure(args, branches)
    for fanout in fanouts:
        rows += measure(args, 1, fanout)
    env = environment()
    print(f"speculation ahead, draft {args.draft} for {args.target}, k={args.k}, eval split: {args.prompts_used} "
          f"prompts x {args.max_tokens} tokens, in process, sampled requests {'un' if args.unseeded else ''}seeded")
    print(f"{env['date']}, {env['device']}, {env['threads']} threads, torch {env['torch']}")
    print(markdown_table(rows, ["mode", "T", "accept_len", "lookups", "hit_rate", "hit_rate_accept",
                                "hit_rate_reject", "hits_by_outcome", "tree_width", "p_all_accepted",
                                "bonus_agreement", "drafted_ahead", "drafted_per_lookup", "unused_share", "skipped"]))
    save_json(args.json, {"environment": env, "args": vars(args), "results": rows})


def measure(args: argparse.Namespace, branches: int, fanout: int = 0) -> list[dict]:
    """One engine with this branch budget (or, fanout > 0, tree mode of this fan-out); a row per temperature."""
    llm = LLM(model=args.target, draft_model=args.draft, num_speculative_tokens=args.k, device=args.device,
              speculation_ahead=True, speculation_ahead_branches=branches, speculation_ahead_tree_fanout=fanout)
    mode = f"tree F={fanout}" if fanout else f"window B={branches}"
    prompts = [encode_prompt(p, llm.tokenizer, llm.model_config.vocab_size)
               for p in load_prompts("eval", args.num_prompts)]
    args.prompts_used = len(prompts)
    steps: list[tuple[int, int]] = []  # (k, accepted) of every verify that drafted
    execute = llm.engine.executor.execute
    ahead = llm.engine.executor.ahead

    def recording_execute(plan, on_dispatched=None):  # noqa: ANN001, ANN202 - wraps Executor.execute
        result = execute(plan, on_dispatched)
        k = result.num_draft_tokens or [p.num_draft_tokens for p in plan.requests]
        steps.extend((n, a) for n, a, s in zip(k, result.num_accepted, result.sampled) if n and s is not None)
        return result

    llm.engine.executor.execute = recording_execute
    rows = []
    for t in args.temperatures:
        steps.clear()
        before = llm.engine.speculation_ahead_stats()
        kinds = (ahead.stats.hits_accept, ahead.stats.hits_reject)
        seed = (lambda i: None) if args.unseeded and t > 0 else (lambda i: i)
        outs = llm.generate(prompts, [SamplingParams(max_tokens=args.max_tokens, temperature=t, seed=seed(i))
                                      for i in range(len(prompts))])
        totals = [a - b for a, b in zip(llm.engine.speculation_ahead_stats(), before, strict=True)]
        lookups, hits, drafted, unused, skipped, trees, nodes = totals[:len(COUNTERS)]
        by_outcome = totals[len(COUNTERS):len(COUNTERS) + args.k + 1]  # a = 0..k
        h_acc, h_rej = (a - b for a, b in zip((ahead.stats.hits_accept, ahead.stats.hits_reject), kinds))
        all_accepted = sum(a == n for n, a in steps)
        spec = llm.spec_stats(outs)
        rows.append({"mode": mode, "T": t, "accept_len": spec.acceptance_length, "lookups": lookups,
                     "hit_rate": hits / lookups, "hit_rate_accept": h_acc / lookups, "hit_rate_reject": h_rej / lookups,
                     "p_all_accepted": all_accepted / len(steps),
                     "bonus_agreement": h_acc / max(all_accepted, 1),
                     "drafted_ahead": drafted, "drafted_per_lookup": drafted / lookups,
                     "unused_share": unused / max(drafted, 1), "skipped": skipped,
                     # Tree mode: hits of outcome a per lookup, a = 0..k; nodes fed per tree.
                     "hits_by_outcome": [round(h / lookups, 3) for h in by_outcome] if fanout else None,
                     "tree_width": nodes / trees if trees else None})
        print(f"{mode} T={t}: done", file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    main()
