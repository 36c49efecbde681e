"""Speculation ahead on a real pair: how often the window drafted ahead is the next proposal (its hit rate), how
many of the tokens drafted ahead go unused, and why windows miss, on the eval split at T=0 and T=0.7.

    python benchmarks/speculation_ahead.py [--target smollm2-135m-instruct] [--draft smollm2-135m-draft] [--k 4]
        [--num-prompts 60] [--max-tokens 128] [--json FILE]

In process (engine.LLM with speculation_ahead=True; the hit rate does not depend on where the draft runs), every
eval prompt with the chat template, batched, probabilistic rejection. A window drafted ahead hits when every draft
of the step before was accepted AND the target's bonus token equals the draft's guess (its argmax there), so
hit rate = P(all accepted) x P(bonus agrees | all accepted); both factors are printed. The second one is the rate
to give `serve_layouts.py --bonus-agreement` for a synthetic pair of random weights.
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
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(model=args.target, draft_model=args.draft, num_speculative_tokens=args.k, device=args.device,
              speculation_ahead=True)
    prompts = [encode_prompt(p, llm.tokenizer, llm.model_config.vocab_size)
               for p in load_prompts("eval", args.num_prompts)]
    steps: list[tuple[int, int]] = []  # (k, accepted) of every verify that drafted
    execute = llm.engine.executor.execute

    def recording_execute(plan, on_dispatched=None):  # noqa: ANN001, ANN202 - wraps Executor.execute
        result = execute(plan, on_dispatched)
        k = result.num_draft_tokens or [p.num_draft_tokens for p in plan.requests]
        steps.extend((n, a) for n, a, s in zip(k, result.num_accepted, result.sampled) if n and s is not None)
        return result

    llm.engine.executor.execute = recording_execute
    rows = []
    for t in TEMPERATURES:
        steps.clear()
        before = llm.engine.speculation_ahead_stats()
        outs = llm.generate(prompts, [SamplingParams(max_tokens=args.max_tokens, temperature=t, seed=i)
                                      for i in range(len(prompts))])
        lookups, hits, drafted, unused = (a - b for a, b in zip(llm.engine.speculation_ahead_stats(), before))
        all_accepted = sum(a == n for n, a in steps)
        spec = llm.spec_stats(outs)
        rows.append({"T": t, "accept_len": spec.acceptance_length, "lookups": lookups, "hit_rate": hits / lookups,
                     "p_all_accepted": all_accepted / len(steps),
                     "bonus_agreement": hits / max(all_accepted, 1),
                     "drafted_ahead": drafted, "unused_share": unused / max(drafted, 1)})
        print(f"T={t}: done", file=sys.stderr, flush=True)

    env = environment()
    print(f"speculation ahead, draft {args.draft} for {args.target}, k={args.k}, eval split: {len(prompts)} prompts x "
          f"{args.max_tokens} tokens, in process")
    print(f"{env['date']}, {env['device']}, {env['threads']} threads, torch {env['torch']}")
    print(markdown_table(rows, ["T", "accept_len", "lookups", "hit_rate", "p_all_accepted", "bonus_agreement",
                                "drafted_ahead", "unused_share"]))
    save_json(args.json, {"environment": env, "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
