"""The MoE experts kernels alone on one GPU, at a model's expert shape: the few-row kernels
(engine/kernels/moe/small_m.py) and the kernels over rows grouped by expert (engine/kernels/moe/grouped.py), each
tiling's time per layer against the floor (the bytes of the experts the step routes to, over the copy bandwidth
measured in the same run), and its result against the float32 reference.

    python benchmarks/gpu_moe.py --shape gpt-oss-20b --tokens 1,5,16,64 --out moe.json

Per token count: `layers` MoE layers of random weights at the shape (MXFP4-packed where the shape's config says so;
enough of them that one layer's weights are out of L2 when its turn comes, as in a real step), each called once in a
CUDA graph whose replays are timed; every token routes to `top_k` distinct random experts. `bytes`: the experts'
weights the calls read (each distinct expert of a call counted once, with its scales and biases). Per token count
the table shows each kernel's default tiling (moe_small_m.TILES, moe_grouped.TILES), then each kernel's fastest."""

from __future__ import annotations

import argparse
import itertools

import torch
from common import environment, graph_us, markdown_table, save_json
from gpu_shapes import copy_bandwidth, hf_config

from engine.kernels.moe import grouped as moe_grouped
from engine.kernels.moe import small_m as moe_small_m
from engine.kernels.moe.router import route_topk_then_softmax
from engine.models.moe import FusedExperts, moe_experts_ref
from engine.quantization import mxfp4


def make_layer(cfg, packed: bool, gen: torch.Generator) -> FusedExperts:
    """Random experts of the shape, weights ~ N(0, 0.02) quantized to MXFP4 per expert where packed."""
    oai = cfg.model_type == "gpt_oss"  # otherwise Qwen3-MoE's config names
    e = cfg.num_local_experts if oai else cfg.num_experts
    h, i = cfg.hidden_size, cfg.intermediate_size if oai else cfg.moe_intermediate_size
    ex = FusedExperts(e, h, i, bias=oai, activation="swiglu_oai" if oai else "silu", packed=packed).cuda()
    with torch.no_grad():
        for name, (rows, cols) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            if packed:
                blocks, scales = getattr(ex, name + "_blocks"), getattr(ex, name + "_scales")
                for x in range(e):
                    w = torch.empty(rows, cols, device="cuda").normal_(0.0, 0.02, generator=gen)
                    blocks[x], scales[x] = mxfp4.quantize(w)
            else:
                getattr(ex, name).data = torch.empty(e, rows, cols, device="cuda", dtype=torch.bfloat16).normal_(
                    0.0, 0.02, generator=gen)
        if oai:
            ex.gate_up_proj_bias.data = ex.gate_up_proj_bias.data.cuda().normal_(0.0, 0.02, generator=gen)
            ex.down_proj_bias.data = ex.down_proj_bias.data.cuda().normal_(0.0, 0.02, generator=gen)
    return ex


def expert_bytes(ex: FusedExperts) -> int:
    """One expert's bytes: its weights (or blocks and scales) and biases."""
    return sum(t[0].numel() * t.element_size() for t in ex.parameters())


def tilings(quick: bool) -> list[dict]:
    """Each tiling with the PTX decode (Triton's own decode lost at every tiling on an H100, as did BLOCK_K 64, 2
    warps and fewer than 1056 programs after the block-wise loads on an H200): output features a program x inputs a
    step x warps x programs a launch aims for x the K walk's pipeline stages."""
    grid = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "programs": p, "ptx": True, "stages": st}
            for n, k, w, p, st in itertools.product((16, 32), (256, 512), (4, 8), (2112, 4224), (1, 3))]
    return grid[:6] if quick else grid


def grouped_tilings() -> list[dict]:
    """The grouped kernel's tilings: output features and inputs a tile, warps (few enough to sweep in full; --quick
    cuts the few-row kernel's sweep only)."""
    return [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w}
            for n, k, w in itertools.product((32, 64, 128), (64, 128), (4, 8))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gpt-oss-20b")
    ap.add_argument("--tokens", default="1,2,8", help="tokens a call (routed rows: tokens x top_k)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--bf16", action="store_true", help="bf16 experts even where the shape is MXFP4")
    ap.add_argument("--quick", action="store_true", help="the first few tilings only")
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = hf_config(args.shape)
    packed = not args.bf16 and bool(getattr(cfg, "quantization_config", None))
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [make_layer(cfg, packed, gen) for _ in range(args.layers)]
    top_k = cfg.num_experts_per_tok
    bandwidth = copy_bandwidth()
    rows, table = [], []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
        logits = torch.randn(tokens, layers[0].num_experts, device="cuda", generator=gen)
        weights, ids = route_topk_then_softmax(logits, top_k)
        touched = ids.unique().numel()
        nbytes = touched * expert_bytes(layers[0])
        ref = moe_experts_ref(x.float(), weights, ids, layers[0])
        best: dict[str, dict] = {}
        variants = [("small_m", moe_small_m.TILES)] + [("small_m", t) for t in tilings(args.quick)]
        variants += [("grouped", moe_grouped.TILES)] + [("grouped", t) for t in grouped_tilings()]
        for kernel, tiles in variants:
            fn = moe_small_m.moe_experts if kernel == "small_m" else moe_grouped.moe_experts_grouped
            try:
                out = fn(x, weights, ids, layers[0], tiles=tiles)
            except Exception as e:  # a variant that does not compile here: said, and the sweep goes on
                print(f"{kernel} tiles {tiles}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()

            def call(i: int, x=x, weights=weights, ids=ids, tiles=tiles, fn=fn) -> torch.Tensor:
                return fn(x, weights, ids, layers[i % len(layers)], tiles=tiles)

            us = graph_us(call, calls=len(layers))
            row = {"shape": args.shape, "packed": packed, "tokens": tokens, "rows": tokens * top_k,
                   "experts": touched, "kernel": kernel,
                   **{k: tiles.get(k, "") for k in ("BLOCK_N", "BLOCK_K", "num_warps", "programs", "ptx", "stages")},
                   "us": round(us, 2), "floor_us": round(nbytes / bandwidth * 1e6, 2),
                   "x_floor": round(us / (nbytes / bandwidth * 1e6), 2), "GBps": round(nbytes / us / 1e3, 1),
                   "rel_err": f"{err:.1e}", "default": tiles is moe_small_m.TILES or tiles is moe_grouped.TILES}
            rows.append(row)
            if kernel not in best or row["us"] < best[kernel]["us"]:
                best[kernel] = row
        table += [r for r in rows if r["tokens"] == tokens and r["default"]] + list(best.values())
    cols = ["shape", "packed", "tokens", "rows", "experts", "kernel", "ptx", "BLOCK_N", "BLOCK_K", "num_warps",
            "programs", "stages", "us", "floor_us", "x_floor", "GBps", "rel_err"]
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(markdown_table(table, cols))
    save_json(args.out, {"env": environment(), "bandwidth": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
