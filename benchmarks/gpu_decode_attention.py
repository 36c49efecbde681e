"""One-token attention per layer on one GPU: the fused decode kernel (engine/kernels/decode_attention.py: prologue,
split-KV attention and combine in one launch) against the three unfused kernels (qk_norm_rope_store, then
paged_attention with its combine), in CUDA graphs of `--layers` calls, each on a KV cache of its own (so the keys
come from HBM, as in a real step), with programmatic dependent launch as the engine launches them.

    python benchmarks/gpu_decode_attention.py --shapes qwen3-0.6b,qwen3-8b --batch 1,4,8 --context 512,2048

`variants` also times the fused kernel with other key tiles / warps (TILE_Nxwarps).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import environment, graph_us, markdown_table, save_json

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from kernel_support import decode_case  # noqa: E402  (the tests' case builder: random cache, tables, slots)

from engine.kernels.decode_attention import decode_attention  # noqa: E402
from engine.kernels.paged_attention import paged_attention  # noqa: E402
from engine.kernels.qk_norm_rope_store import qk_norm_rope_store  # noqa: E402

# name: (heads, KV heads, head_dim, norm)
SHAPES = {"qwen3-0.6b": (16, 8, 128, "llama"), "qwen3-8b": (32, 8, 128, "llama"), "gemma3-270m": (4, 1, 256, "gemma")}


def bench(shape: str, batch: int, context: int, layers: int, variants: list[tuple[int, int]]) -> dict:
    heads, kv_heads, head_dim, norm = SHAPES[shape]
    cases = [decode_case(heads, kv_heads, head_dim, 16, [1] * batch, [context - 1] * batch, None, torch.bfloat16,
                         norm, device="cuda", seed=i) for i in range(layers)]
    outs = [torch.empty(c.qkv.shape[0], heads, head_dim, dtype=torch.bfloat16, device="cuda") for c in cases]
    counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device="cuda")

    def fused(i: int, **kw: int) -> None:
        c = cases[i % layers]
        decode_attention(*c.args(outs[i % layers], c.attention.kv_cache, counters), **kw)

    def unfused(i: int) -> None:
        c, a = cases[i % layers], cases[i % layers].attention
        kv = a.kv_cache
        q = qk_norm_rope_store(c.qkv, heads, kv_heads, c.positions, c.cos, c.sin, kv[0], kv[1], c.slot_mapping,
                               c.q_norm_weight, c.k_norm_weight, 1e-6, c.norm_offset)
        paged_attention(q, kv[0], kv[1], outs[i % layers], a.query_start_loc, a.seq_lens, a.block_table, a.scale,
                        None, 1)

    row = {"shape": shape, "batch": batch, "context": context, "unfused_us": graph_us(unfused, layers),
           "fused_us": graph_us(fused, layers), "tickets_us": graph_us(lambda i: fused(i, tickets=True), layers)}
    for tile_n, warps in variants:
        row[f"fused_{tile_n}x{warps}_us"] = graph_us(lambda i, t=tile_n, w=warps: fused(i, tile_n=t, num_warps=w),
                                                     layers)
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--batch", default="1,4,8")
    ap.add_argument("--context", default="512,2048")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--variants", default="", help="comma-separated TILE_NxWARPS, e.g. 32x2,64x2,16x1")
    ap.add_argument("--out")
    args = ap.parse_args()
    variants = [tuple(int(x) for x in v.split("x")) for v in args.variants.split(",") if v]
    rows = [bench(s, b, c, args.layers, variants) for s in args.shapes.split(",")
            for b in (int(x) for x in args.batch.split(",")) for c in (int(x) for x in args.context.split(","))]
    cols = ["shape", "batch", "context", "unfused_us", "fused_us", "tickets_us"]
    cols += [f"fused_{t}x{w}_us" for t, w in variants]
    print(markdown_table(rows, cols))
    if args.out:
        save_json(args.out, {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
