"""An MoE layer's router alone on one GPU, at a model's shape: the one-kernel router (engine/kernels/moe/router.py)
at each tiling against the torch path it replaces (the router's product, torch.topk and the softmax: five launches),
both in CUDA graphs, and its expert ids against the reference's.

    python benchmarks/gpu_router.py --shapes gpt-oss-20b,qwen3-30b-a3b --tokens 1,4,16,64,256 --out router.json

Per shape and token count: `layers` routers of random weights (N(0, 0.02), enough that one layer's are out of L2
when its turn comes), each called once in a CUDA graph whose replays are timed; the default tiling
(moe_router.tiles_for) first, then each kernel tiling, then the torch path. `same_ids`: the share of tokens whose expert
ids equal the reference's (random logits rarely tie; a tie within rounding may order two experts either way).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
from common import environment, graph_us, markdown_table, save_json
from gpu_shapes import hf_config

from engine.kernels.moe import router as moe_router


def tilings() -> list[dict]:
    """Experts a program, hidden features a load, warps: few experts a program gives a token more programs (at one
    token the grid is the token's programs alone)."""
    return [{"BLOCK_E": e, "BLOCK_H": h, "num_warps": w}
            for e, h, w in itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048, 4096), (2, 4, 8))
            if e * h <= 16384]


def caller(x: torch.Tensor, ws: list, bs: list, top_k: int, softmax_first: bool, normalize: bool,
           tiles: dict | None) -> Callable[[int], object]:
    """Call i: layer i's router on x, through the kernel at `tiles`, or the torch path where tiles is None."""
    def call(i: int) -> object:
        w, b = ws[i % len(ws)], bs[i % len(ws)]
        if tiles is None:
            return moe_router.route_ref(x, w, b, top_k, softmax_first, normalize)
        return moe_router.route(x, w, b, top_k, softmax_first, normalize, tiles=tiles)
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gpt-oss-20b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,4,16,64,256")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows, table = [], []
    for shape in args.shapes.split(","):
        cfg = hf_config(shape)
        oai = cfg.model_type == "gpt_oss"
        e = cfg.num_local_experts if oai else cfg.num_experts
        top_k, h = cfg.num_experts_per_tok, cfg.hidden_size
        gen = torch.Generator(device="cuda").manual_seed(0)
        ws = [torch.empty(e, h, device="cuda").normal_(0, 0.02, generator=gen).bfloat16() for _ in range(args.layers)]
        bs = [torch.empty(e, device="cuda").normal_(0, 0.02, generator=gen).bfloat16() if oai else None
              for _ in range(args.layers)]
        softmax_first, normalize = not oai, bool(getattr(cfg, "norm_topk_prob", False))
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, h, device="cuda", generator=gen).bfloat16()
            _, ref_ids = moe_router.route_ref(x, ws[0], bs[0], top_k, softmax_first, normalize)
            best = None
            default = moe_router.tiles_for(tokens)
            variants = [("kernel", default)] + [("kernel", t) for t in tilings()] + [("torch", None)]
            for kind, tiles in variants:
                call = caller(x, ws, bs, top_k, softmax_first, normalize, tiles)
                ids = ref_ids
                if kind == "kernel":
                    try:
                        _, ids = call(0)
                    except Exception as exc:  # a tiling that does not compile here: said, and the sweep goes on
                        print(f"{shape} tiles {tiles}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                        continue
                us = graph_us(call, calls=len(ws))
                row = {"shape": shape, "tokens": tokens, "kind": kind, **(tiles or {}), "us": round(us, 2),
                       "same_ids": round((ids == ref_ids).all(dim=1).float().mean().item(), 3),
                       "default": tiles is default}
                rows.append(row)
                if kind == "kernel" and not row["default"] and (best is None or us < best["us"]):
                    best = row
            table += [r for r in rows if r["shape"] == shape and r["tokens"] == tokens
                      and (r["default"] or r["kind"] == "torch")] + ([best] if best else [])
    print(markdown_table(table, ["shape", "tokens", "kind", "BLOCK_E", "BLOCK_H", "num_warps", "us", "same_ids"]))
    save_json(args.out, {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
