"""Time of each projection of a model shape at small batch, per BLAS library, against its weight-read floor.

At batch 1 a decode step is a chain of matrix-vector products, so which kernel the BLAS library picks for each
weight decides how close the step comes to the bandwidth floor. This times every projection of a shape (bf16,
random weights) through `F.linear` with cuBLASLt and with cuBLAS, 20 calls inside a CUDA graph (as the engine's
step runs them), medians of 30 replays after warm-up.

    python benchmarks/gpu_linear.py --shape qwen3-8b --batch 1,8 --out results/gpu_linear.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import environment, graph_us, markdown_table, save_json
from gpu_shapes import SHAPES, copy_bandwidth

CALLS = 20


def projections(name: str) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of each weight of one layer, and the LM head."""
    c = SHAPES[name]()
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, nq, nk = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    return {"qkv_proj": (h, (nq + 2 * nk) * d), "o_proj": (nq * d, h), "gate_up_proj": (h, 2 * c.intermediate_size),
            "down_proj": (c.intermediate_size, h), "lm_head": (h, c.vocab_size)}


def time_linear_us(x: torch.Tensor, w: torch.Tensor, replays: int = 30) -> float:
    return graph_us(lambda _: F.linear(x, w), CALLS, replays)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--libraries", default="cublaslt,cublas")
    ap.add_argument("--out")
    args = ap.parse_args()
    bw = copy_bandwidth()
    rows = []
    for proj, (k, n) in projections(args.shape).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        floor_us = w.numel() * w.element_size() / bw * 1e6
        for m in (int(b) for b in args.batch.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"projection": proj, "shape": f"{k}x{n}", "batch": m, "floor_us": round(floor_us, 1)}
            for lib in args.libraries.split(","):
                torch.backends.cuda.preferred_blas_library(lib)
                us = time_linear_us(x, w)
                row[f"{lib}_us"] = round(us, 1)
                row[f"{lib}_vs_floor"] = round(us / floor_us, 2)
            rows.append(row)
        del w
    torch.backends.cuda.preferred_blas_library("cublaslt")
    print(f"{args.shape}: copy bandwidth {bw / 1e12:.2f} TB/s; {CALLS} calls per graph replay")
    print(markdown_table(rows, list(rows[0])))
    if args.out:
        save_json(args.out, {"environment": environment(), "shape": args.shape, "rows": rows})


if __name__ == "__main__":
    main()
