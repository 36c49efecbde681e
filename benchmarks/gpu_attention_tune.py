"""Paged attention's launch parameters: key tile width, warps, software-pipeline stages and key splits of
engine/kernels/attention/paged.py, swept one launch at a time against the KV-read floor.

The engine picks its tile width, warps and splits from the grid (engine/kernels/attention/launch.py) and leaves the
stages to Triton (3); this sweep overrides each of them, so that a rule change is chosen from measurements. One
launch is one layer's attention of a decode step (--query-len 1) or a verify: every request has --query-len query
tokens at --contexts keys, in blocks scattered over the cache as in serving. Times are GPU times of a CUDA graph of
at least --launches launches over copies of the cache larger than the L2 cache together (median of --repeats
replays); the floor is the K and V bytes over the device-to-device copy bandwidth.

    python benchmarks/gpu_attention_tune.py --contexts 8192,32768 --batch 1,8 --tiles engine,64,128 \
        --warps engine,2,4,8 --stages engine,2,4 --splits engine,16,32,64 --out out.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, save_json  # noqa: E402
from gpu_kernels import gpu_ms, graph_of  # noqa: E402
from gpu_shapes import copy_bandwidth  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import engine.kernels.attention.launch as al  # noqa: E402
import engine.kernels.attention.paged as pa  # noqa: E402

BLOCK_SIZE = 16


def attention_case(batch: int, context: int, query_len: int, heads: int, kv_heads: int, head_dim: int) -> tuple:
    """Every request has `query_len` query tokens and `context` keys (those tokens included)."""
    blocks_per_req = -(-context // BLOCK_SIZE)
    num_blocks = 1 + batch * blocks_per_req
    kv = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    table = (torch.randperm(num_blocks - 1, device="cuda") + 1).view(batch, blocks_per_req).to(torch.int32)
    q = torch.randn(batch * query_len, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * query_len
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, kv, qsl, seq_lens, table


def _choices(text: str) -> list[int | None]:
    """'engine,64,128' -> [None, 64, 128]: None keeps the engine's own choice."""
    return [None if x == "engine" else int(x) for x in text.split(",")]


def with_launch_params(tile: int | None, warps: int | None, stages: int):
    """Patch the modules so that the attention kernel launches with these parameters (None: the engine's choice);
    returns the undo."""
    saved = al._tile_and_warps, pa.launch

    def tile_and_warps(*args):
        engine_tile, engine_warps = saved[0](*args)
        return tile or engine_tile, warps or engine_warps

    def launch(kernel, grid, device, *args, **kwargs):
        if kernel is pa._paged_attention_kernel:
            kwargs = {**kwargs, "num_stages": stages}
        return saved[1](kernel, grid, device, *args, **kwargs)

    al._tile_and_warps = tile_and_warps
    pa.launch = launch

    def undo() -> None:
        al._tile_and_warps, pa.launch = saved
    return undo


def sweep_shape(args: argparse.Namespace, context: int, batch: int, bandwidth: float) -> list[dict]:
    heads, kv_heads, head_dim = map(int, args.heads.split(":"))
    q, kv, qsl, seq_lens, table = attention_case(batch, context, args.query_len, heads, kv_heads, head_dim)
    out, ref = torch.empty_like(q), torch.empty_like(q)
    call = (q, kv[0], kv[1], out, qsl, seq_lens, table, head_dim ** -0.5, None, args.query_len)
    pa.paged_attention_ref(*call[:3], ref, *call[4:])
    # A decode step reads each layer's KV once, far more than the L2 cache holds over a step's layers: the graph's
    # launches cycle over copies of the cache that together span several times the L2 cache, so no launch finds
    # the keys the previous one left there (a lone 33 MB layer replayed in place mostly hits an H200's L2).
    layer_bytes = kv.numel() * kv.element_size()
    copies = max(1, min(256, -(-4 * torch.cuda.get_device_properties(0).L2_cache_size // layer_bytes)))
    caches = [kv] + [kv.clone() for _ in range(copies - 1)]
    launches = max(args.launches, copies)
    floor_us = 2 * batch * context * kv_heads * head_dim * kv.element_size() / bandwidth * 1e6

    def launch_all(splits: int | None) -> None:
        for i in range(launches):
            c = caches[i % copies]
            pa.paged_attention(q, c[0], c[1], out, *call[4:], num_kv_splits=splits)
    results = []
    for tile, warps, stages, splits in itertools.product(_choices(args.tiles), _choices(args.warps),
                                                        _choices(args.stages), _choices(args.splits)):
        undo = with_launch_params(tile, warps, stages or 3)
        try:
            chosen = al.kernel_variant(batch, args.query_len, heads // kv_heads, kv_heads, head_dim,
                                       table.shape[1] * BLOCK_SIZE, q.device, splits, kv_bytes=kv.element_size())
            graph = graph_of(lambda s=splits: launch_all(s), 1)
            us = gpu_ms(graph.replay, args.repeats) / launches * 1e3
            torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
        except Exception as e:  # a configuration the compiler refuses (e.g. out of shared memory) is reported
            print(f"context {context} batch {batch} tile {tile} warps {warps} stages {stages} splits {splits}: "
                  f"{type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        finally:
            undo()
        engine = tile is None and warps is None and stages is None and splits is None
        results.append({"context": context, "batch": batch, "query_len": args.query_len, "engine": engine,
                        "tile": chosen.tile_n, "warps": chosen.num_warps, "stages": stages or 3,
                        "splits": chosen.splits, "us": us, "floor_us": floor_us, "vs_floor": us / floor_us})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--query-len", type=int, default=1, help="query tokens a request (k + 1 for a verify)")
    ap.add_argument("--heads", default="16:8:128", help="query heads:KV heads:head dim (Qwen3-0.6B's by default)")
    # Each list may hold 'engine': the engine's own choice (stages: Triton's default, 3).
    ap.add_argument("--tiles", default="engine,64,128")
    ap.add_argument("--warps", default="engine,2,4,8")
    ap.add_argument("--stages", default="engine")
    ap.add_argument("--splits", default="engine")
    ap.add_argument("--launches", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_attention_tune.py needs CUDA")
    bandwidth = copy_bandwidth()
    rows, summary = [], []
    for context, batch in itertools.product(map(int, args.contexts.split(",")), map(int, args.batch.split(","))):
        results = sweep_shape(args, context, batch, bandwidth)
        rows.extend(results)
        engine = next((r for r in results if r["engine"]), None)
        best = min(results, key=lambda r: r["us"])
        summary.append({"context": context, "batch": batch, "floor_us": best["floor_us"],
                        "engine_us": engine and engine["us"], "engine": engine and f"{engine['tile']}/{engine['warps']}"
                        f"/{engine['splits']}", "best_us": best["us"],
                        "best": f"{best['tile']}/{best['warps']}/{best['stages']}/{best['splits']}",
                        "engine_vs_best": engine and engine["us"] / best["us"]})
        print(summary[-1], flush=True)
        torch.cuda.empty_cache()
    print(f"paged attention, {args.heads} (q heads:kv heads:head dim), {args.query_len} query tokens a request, "
          f"bf16, block {BLOCK_SIZE}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; tile/warps/stages/splits:")
    print(markdown_table(summary, ["context", "batch", "floor_us", "engine", "engine_us", "best", "best_us",
                                   "engine_vs_best"]))
    save_json(args.out, {"env": environment(), "args": vars(args), "bandwidth_Bps": bandwidth, "rows": rows,
                         "summary": summary})


if __name__ == "__main__":
    main()
