"""The FP8 few-row kernel alone on one GPU (engine/quantization/fp8_linear.py), at a model's four products (qkv,
o_proj, gate_up, down): each tiling's time against the floor of the bytes it reads (FP8 weights and their scales,
over the copy bandwidth measured in the same run), for block scales (128 x 128, the Qwen3-*-FP8 format) and a scale a
row (compressed-tensors FP8).

    python benchmarks/gpu_fp8.py --shape qwen3-8b --rows 1,8 --out fp8.json

--kernel folded times the folded few-row products (engine/kernels/small_m/linear.py, the tl.dot form) on the same FP8
weights instead: linear_add (the product and a residual add, K split in one launch) at fp8_tiles' tiling first, then
a sweep of tilings. --no-sweep times the default tiling alone.

Per product and row count: enough copies of the weight that one is out of L2 when its turn comes (as in a real
step), each called once in a CUDA graph whose replays are timed; the default tiling (fp8_linear.TILES) first, then
the fastest of the sweep. The summary line adds the four products' times a layer, default against the sweep's best,
and what that is a step.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
from common import environment, graph_us, markdown_table, save_json
from gpu_shapes import copy_bandwidth, hf_config

from engine.kernels.small_m import linear as sml
from engine.kernels.small_m.tiles import fp8_tiles
from engine.quantization import fp8_linear
from engine.quantization.fp8 import quantize_fp8


def tilings() -> list[dict]:
    return [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s, "programs": p}
            for n, k, w, s, p in itertools.product((16, 32, 64), (128, 256), (2, 4), (3, 4), (264, 528, 1056))]


def products(cfg) -> dict[str, tuple[int, int]]:  # noqa: ANN001 - a transformers config
    h, d = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv, i = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    return {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


def folded_tilings(m: int, block: bool) -> list[dict]:
    """tl.dot-form tilings of the folded products at m rows (fp8_tiles' form): K tiles within the 128-column scale
    groups for block scales, K split or not."""
    widths = (64, 128) if block else (128, 256)
    return [dict(USE_DOT=True, BLOCK_M=max(16, 1 << (m - 1).bit_length()), BLOCK_N=n, BLOCK_K=k, num_warps=w,
                 num_stages=st, SPLIT_K=sp)
            for n, k, w, st, sp in itertools.product((32, 64), widths, (4,), (2, 3, 4), (1, 2, 4, 8))]


def caller(x: torch.Tensor, weights: list, group_k: int, tiles: dict | None, folded: bool = False
           ) -> Callable[[int], torch.Tensor]:
    """Call i: x through copy i of the weight (of `weights`) at `tiles` (folded: linear_add's, None its default)."""
    add = torch.zeros(x.shape[0], weights[0][0].shape[0], dtype=x.dtype, device=x.device)

    def call(i: int) -> torch.Tensor:
        wq, ws = weights[i % len(weights)]
        if folded:
            return sml.linear_add(x, wq, None, add, config=tiles, scale=ws, group_k=group_k)
        return fp8_linear.fp8_linear_kernel(x, wq, ws, group_k, tiles=tiles)
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--scales", default="block,row", help="block: 128 x 128 scale blocks; row: a scale a row")
    ap.add_argument("--kernel", default="standalone", choices=("standalone", "folded"))
    ap.add_argument("--no-sweep", action="store_true", help="the default tiling only")
    ap.add_argument("--out")
    args = ap.parse_args()
    folded = args.kernel == "folded"
    cfg = hf_config(args.shape)
    bandwidth = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    grid = tilings()
    rows, table, layer = [], [], {}
    for scheme in args.scales.split(","):
        block = (128, 128) if scheme == "block" else None
        for name, (n, k) in products(cfg).items():
            w = torch.empty(n, k, device="cuda").normal_(0, 0.02, generator=gen)
            q, s = quantize_fp8(w, block)
            del w
            if block:  # the scales as the layers hold them: a row's [N, K / 128]
                s = s.repeat_interleave(128, 0)[:n].contiguous()
            copies = max(2, -(-200_000_000 // (n * k)))  # 200 MB of weights: out of L2 between calls
            weights = [(q.clone(), s.clone()) for _ in range(copies)]
            group = 128 if block else k
            nbytes = q.numel() + s.numel() * 4
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
                ref = fp8_linear.fp8_linear_ref(x.float(), q, s, group)
                best = None
                default_tiles = None if folded else fp8_linear.TILES
                sweep = [] if args.no_sweep else folded_tilings(m, bool(block)) if folded else grid
                for tiles in [default_tiles] + sweep:
                    call = caller(x, weights, group, tiles, folded)
                    try:
                        out = call(0)
                    except Exception as exc:  # a tiling that does not compile here: said, and the sweep goes on
                        print(f"{name} {tiles}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                        continue
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    us = graph_us(call, calls=copies)
                    floor = nbytes / bandwidth * 1e6
                    shown = tiles or fp8_tiles(m, n, k, 128 if block else 0, x.device)
                    row = {"scales": scheme, "product": name, "N": n, "K": k, "rows": m, **shown, "us": round(us, 2),
                           "floor_us": round(floor, 2), "x_floor": round(us / floor, 3), "rel_err": f"{err:.1e}",
                           "default": tiles is default_tiles}
                    rows.append(row)
                    if not row["default"] and (best is None or us < best["us"]):
                        best = row
                    if row["default"]:
                        default = row
                table += [default] + ([best] if best else [])
                per = layer.setdefault((scheme, m), [0.0, 0.0, 0.0])
                per[0] += default["us"]
                per[1] += (best or default)["us"]
                per[2] += default["floor_us"]
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    extra = ["SPLIT_K"] if folded else ["num_stages", "programs"]
    print(markdown_table(table, ["scales", "product", "N", "K", "rows", "BLOCK_N", "BLOCK_K", "num_warps", *extra,
                                 "us", "floor_us", "x_floor", "rel_err"]))
    for (scheme, m), (d, b, f) in layer.items():
        print(f"{scheme} scales, {m} rows: a layer's four products {d:.1f} us with the default tiling, "
              f"{b:.1f} us with each product's best, floor {f:.1f} us ({d / f:.2f}x -> {b / f:.2f}x); "
              f"x {cfg.num_hidden_layers} layers: {d * cfg.num_hidden_layers / 1e3:.2f} -> "
              f"{b * cfg.num_hidden_layers / 1e3:.2f} ms")
    save_json(args.out, {"env": environment(), "bandwidth": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
