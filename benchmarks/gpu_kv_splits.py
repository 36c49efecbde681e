"""How many programs share one request's keys (paged attention's flash-decoding splits) at long context: the draft
loop of a Qwen3-0.6B shape (gpu_draft.loop_ms: ms per draft token, CUDA graphs, greedy) at each context and batch,
under the engine's split rule and under alternatives, with the floor (weights and every request's KV read once).

A rule is (most splits, waves of programs per SM, fewest key tiles per split) replacing
engine/kernels/attention/launch.py's `_auto_splits`, or `wide:N`: the engine's rules with a tiny grid split up to N
ways (`WIDE_SPLITS`) instead of its own cap. Graphs choose their splits from the block table's width (the
model's longest context), so each context here runs with max_model_len just above it, as a long-context
deployment would; `--max-model-len` instead sizes every run for that longest context (short requests served by a
long-context deployment).

    python benchmarks/gpu_kv_splits.py --contexts 512,8192,32768 --batch 1,8 --rules 16:1:1,64:4:4 --out out.json
"""

from __future__ import annotations

import argparse

import torch
from common import environment, markdown_table, save_json
from gpu_draft import loop_ms
from gpu_shapes import copy_bandwidth

import engine.kernels.attention.launch as al


def split_rule(max_splits: int, waves: int, min_tiles: int):
    """A replacement for attention_launch._auto_splits: double the splits while the grid stays within `waves`
    programs per SM, each split keeps at least `min_tiles` key tiles, and at most `max_splits`."""
    def auto_splits(programs: int, max_tiles: int, device: torch.device) -> int:
        if device.type != "cuda":
            return 1
        splits = 1
        while (splits < max_splits and programs * splits * 2 <= waves * al._num_sms(device)
               and splits * 2 * min_tiles <= max_tiles):
            splits *= 2
        return splits
    return auto_splits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--contexts", default="512,8192,32768")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rules", default="engine,16:1:1,64:4:4,64:8:8",
                    help="comma-separated; 'engine' is the engine's own rule, 'wide:N' it with WIDE_SPLITS N, "
                    "else max_splits:waves:min_tiles")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="the model's longest context for every run (0: just above each run's context)")
    ap.add_argument("--out")
    args = ap.parse_args()
    engine_rule, engine_wide = al._auto_splits, al.WIDE_SPLITS
    bandwidth = copy_bandwidth()
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            row = {"context": context, "batch": batch, "max_model_len": args.max_model_len or "context"}
            for rule in args.rules.split(","):
                al._auto_splits, al.WIDE_SPLITS = engine_rule, engine_wide
                if rule.startswith("wide:"):
                    al.WIDE_SPLITS = int(rule[len("wide:"):])
                elif rule != "engine":
                    al._auto_splits = split_rule(*map(int, rule.split(":")))
                phases: dict = {}
                row[f"{rule}_ms"] = loop_ms(args.shape, batch, args.k, context, True, True, args.steps,
                                            phases=phases, bandwidth=bandwidth, max_model_len=args.max_model_len)
                row["floor_kv_ms"] = phases["floor_kv_ms"]
                torch.cuda.empty_cache()
            al._auto_splits, al.WIDE_SPLITS = engine_rule, engine_wide
            rows.append(row)
            print(row, flush=True)
    cols = ["context", "batch", "max_model_len", "floor_kv_ms"] + [f"{r}_ms" for r in args.rules.split(",")]
    print(f"{args.shape} draft loop (k={args.k}), ms per draft token; rules max_splits:waves:min_tiles or wide:N")
    print(markdown_table(rows, cols))
    save_json(args.out, {"env": environment(), "args": vars(args), "bandwidth_Bps": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
