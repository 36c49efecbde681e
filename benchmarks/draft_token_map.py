"""A draft token map (EngineConfig.draft_token_map) for the bundled pair, built from the train split, measured on the
eval split: acceptance at T=0, draft-step share, and tokens/s at batch 1, with and without the map.

    python benchmarks/draft_token_map.py [--sizes 4096 16384] [--map-prompts 120] [--map-tokens 96]
        [--num-prompts 30] [--max-tokens 96] [--timing-prompts 10] [--timing-tokens 64] [--timing-rounds 2]
        [--out FILE]

The map: the target's greedy outputs on the first --map-prompts train prompts (chat template applied), their token
ids counted with the prompts', the --sizes most frequent kept (ties by id), then the lowest ids not seen up to the
size (byte-level BPE numbers tokens by merge rank, roughly by frequency); EOS ids always in. Speed: every engine
(and the target alone) in turn, --timing-rounds rounds; the speedup is the ratio of medians. The eval prompts
never appear in train, so the map is not fitted to what it is measured on. Output is the target's in every row
(greedy equality is checked on the acceptance run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, save_json  # noqa: E402
from draft_acceptance import tokens_per_second  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.distill.data import encode_prompt, load_prompts  # noqa: E402


def count_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int) -> Counter:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return Counter(t for p, o in zip(prompts, outs) for t in p + o.token_ids)


def build_map(counts: Counter, size: int, vocab_size: int, eos_ids: list[int]) -> list[int]:
    """The `size` most frequent ids (ties by id), then the lowest ids not counted (a byte-level BPE vocabulary
    numbers its tokens by merge rank, roughly by frequency) up to `size`; EOS ids always in."""
    ids = {t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]} | set(eos_ids)
    fill = (t for t in range(vocab_size) if t not in ids)
    while len(ids) < size:
        ids.add(next(fill))
    return sorted(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--map-prompts", type=int, default=120)
    ap.add_argument("--map-tokens", type=int, default=96)
    ap.add_argument("--num-prompts", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--timing-prompts", type=int, default=10)
    ap.add_argument("--timing-tokens", type=int, default=64)
    ap.add_argument("--timing-rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    base = LLM(model=args.target, max_num_seqs=64)
    vocab = base.model_config.vocab_size
    train = [encode_prompt(p, base.tokenizer, vocab) for p in load_prompts("train", args.map_prompts)]
    evals = [encode_prompt(p, base.tokenizer, vocab) for p in load_prompts("eval", args.num_prompts)]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    reference = [o.token_ids for o in base.generate(evals, greedy)]
    tmp = Path(tempfile.mkdtemp(prefix="draft-maps-"))
    maps: dict[str, str | None] = {"all": None}
    counts = count_tokens(base, train, args.map_tokens)
    for size in args.sizes:
        ids = build_map(counts, size, vocab, base.model_config.eos_token_ids)
        path = tmp / f"map-{size}.json"
        path.write_text(json.dumps(ids))
        maps[str(size)] = str(path)
    eval_ids = [t for o in reference for t in o]
    rows, engines = [], {}
    for name, path in maps.items():
        spec = engines[name] = LLM(model=args.target, draft_model=args.draft, num_speculative_tokens=args.k,
                                   max_num_seqs=64, draft_token_map=path)
        outs = spec.generate(evals, greedy)
        stats = spec.spec_stats(outs)
        kept = set(json.loads(Path(path).read_text())) if path else None
        covered = sum(t in kept for t in eval_ids) / len(eval_ids) if kept else 1.0
        rows.append({"map": name, "eval tokens in map": covered,
                     "accept_len": stats.acceptance_length, "accept_rate": stats.acceptance_rate,
                     "greedy equal": sum(o.token_ids == r for o, r in zip(outs, reference)), "spec_tok_s": []})
    # Batch-1 speed, the engines (and the target alone) in turn, --timing-rounds times: a shared CPU drifts, and a
    # fixed order would favour whichever runs last.
    target_tps = []
    for _ in range(args.timing_rounds):
        target_tps.append(tokens_per_second(base, evals[:args.timing_prompts], 0.0, args.timing_tokens))
        for row in rows:
            row["spec_tok_s"].append(tokens_per_second(engines[row["map"]], evals[:args.timing_prompts], 0.0,
                                                       args.timing_tokens))
    base_tps = statistics.median(target_tps)
    for row in rows:
        row["speedup"] = statistics.median(row["spec_tok_s"]) / base_tps
        row["spec_tok_s"] = " / ".join(f"{x:.1f}" for x in row["spec_tok_s"])
        row["target_tok_s"] = " / ".join(f"{x:.1f}" for x in target_tps)
    env = environment()
    print(f"{args.draft} for {args.target}, k={args.k}, T=0; map from {len(train)} train prompts x {args.map_tokens}; "
          f"eval {len(evals)} prompts x {args.max_tokens}; batch-1 timing {args.timing_prompts} x "
          f"{args.timing_tokens}; {time.perf_counter() - t0:.0f} s")
    print(f"{env['date']}, {env['device']}, {env['threads']} threads, torch {env['torch']}")
    print(markdown_table(rows, ["map", "eval tokens in map", "accept_len", "accept_rate", "greedy equal",
                                "spec_tok_s", "target_tok_s", "speedup"]))
    save_json(args.out, {"environment": env, "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
