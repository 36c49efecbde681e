"""A distilled draft on the eval split (engine/distill/prompts/eval.jsonl, never trained on): acceptance length,
rate and per-position acceptance at T=0 and T=0.7, and tokens/s at batch 1 with and without speculation.

    python benchmarks/draft_acceptance.py [--target smollm2-135m-instruct] [--draft smollm2-135m-draft] [--k 4]
        [--num-prompts 60] [--max-tokens 128] [--timing-prompts 8] [--timing-tokens 64] [--json FILE]

Acceptance: every eval prompt (chat template applied), batched, probabilistic rejection sampling (the serving
default; at T=0 it keeps exactly the target's greedy tokens). Speed: the first --timing-prompts prompts one at a
time (batch 1), after one warm-up request, target alone vs target + draft; tokens/s = generated tokens / wall time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, save_json  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.distill.data import encode_prompt, load_prompts  # noqa: E402
from engine.distill.evaluate import measure_acceptance  # noqa: E402

TEMPERATURES = (0.0, 0.7)


def tokens_per_second(llm: LLM, prompts: list[list[int]], temperature: float, max_tokens: int) -> float:
    """Batch 1: one request at a time, each with its own seed so the sampled runs are comparable run to run."""
    llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=temperature, seed=0))  # warm-up
    n = 0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        out = llm.generate([p], SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i))[0]
        n += len(out.token_ids)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--num-prompts", type=int, default=None, help="eval prompts for acceptance (default: all 60)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request for acceptance")
    ap.add_argument("--timing-prompts", type=int, default=8, help="eval prompts timed at batch 1")
    ap.add_argument("--timing-tokens", type=int, default=64, help="tokens per timed request")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    spec = LLM(model=args.target, draft_model=args.draft, num_speculative_tokens=args.k, device=args.device)
    base = LLM(model=args.target, device=args.device)
    vocab = spec.model_config.vocab_size
    prompts = [encode_prompt(p, spec.tokenizer, vocab) for p in load_prompts("eval", args.num_prompts)]
    timed = prompts[:args.timing_prompts]

    rows = []
    for t in TEMPERATURES:
        acc = measure_acceptance(spec, prompts, t, args.max_tokens)
        base_tps = tokens_per_second(base, timed, t, args.timing_tokens)
        spec_tps = tokens_per_second(spec, timed, t, args.timing_tokens)
        rows.append({"T": t, "accept_len": acc.stats.acceptance_length, "accept_rate": acc.stats.acceptance_rate,
                     "per_position": [round(x, 3) for x in acc.per_position], "drafts": acc.stats.num_drafts,
                     "target_tok_s": base_tps, "spec_tok_s": spec_tps, "speedup": spec_tps / base_tps})
        print(f"T={t}: done", file=sys.stderr, flush=True)

    env = environment()
    print(f"draft {args.draft} for {args.target}, k={args.k}, eval split: {len(prompts)} prompts x {args.max_tokens} "
          f"tokens for acceptance, {len(timed)} x {args.timing_tokens} at batch 1 for speed")
    print(f"{env['date']}, {env['device']}, {env['threads']} threads, torch {env['torch']}")
    print(markdown_table(rows, ["T", "accept_len", "accept_rate", "per_position", "drafts", "target_tok_s",
                                "spec_tok_s", "speedup"]))
    save_json(args.json, {"environment": env, "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
