"""The persistent decoder (engine/kernels/persistent/decoder.py) against the layers' own kernels, on one GPU: a
decode forward of 1-8 rows (embeddings, every decoder layer, the final norm; no LM head) of a draft shape with
random weights in bf16 at a 512-token context, each captured as a CUDA graph and replayed; tilings and warps
swept; kernels per forward counted (torch.profiler over one eager forward); the floor is the layers' weight bytes
plus the rows' KV over the measured copy bandwidth.

Checks in the same run: the one-launch form equals the per-stage form (no barrier) bit for bit, its barrier error
flag stays 0, and its output is within bf16 noise of the ordinary forward.

    python benchmarks/gpu_persistent.py --shapes qwen3-0.6b,smollm2-135m --rows 1,4
"""

from __future__ import annotations

import argparse
import time

import torch
from common import environment, markdown_table, save_json
from gpu_decode import cuda_median_ms
from gpu_shapes import copy_bandwidth, kv_bytes_read, kv_memory_bytes, prefill, shape_dir

from engine.config import EngineConfig
from engine.kernels.persistent.plan import PersistentDecoder
from engine.model_config import ModelConfig
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk


def graph_ms(fn, steps: int) -> float:
    """ms per replay of fn captured as a CUDA graph (replayed 20 times a timing)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()

    def replays() -> None:
        for _ in range(20):
            g.replay()
    return cuda_median_ms(replays, steps) / 20


def kernels_per_forward(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


STAGES = ("qkv", "attn", "combine", "o", "gate_up", "down")


def stage_breakdown(shape, weights, rot, rows, tile_elems, warps, inner, fwd) -> dict:
    """Program 0's global-timer stamps (TIMING build): per stage, us from its start to its own arrival ("work")
    and from there to the next stage's start ("wait": the slowest program and the barrier), means over layers."""
    pd = PersistentDecoder(shape, weights, rot.cos, rot.sin, max_rows=rows, tile_elems=tile_elems, num_warps=warps,
                           timing=True)
    inner.persistent = pd
    for _ in range(3):
        fwd()
    torch.cuda.synchronize()
    t = pd.times.cpu().double().view(-1)
    n = len(weights)
    out = {}
    for i, name in enumerate(STAGES):
        starts = torch.stack([t[layer * 12 + 2 * i] for layer in range(n)])
        arrive = torch.stack([t[layer * 12 + 2 * i + 1] if (i < 5 or layer < n - 1) else t[n * 12]
                              for layer in range(n)])
        nxt = torch.stack([t[layer * 12 + 2 * i + 2] if i < 5 else t[(layer + 1) * 12] for layer in range(n)])
        out[f"{name}_work_us"] = float((arrive - starts).mean()) / 1e3
        out[f"{name}_wait_us"] = float((nxt - arrive).mean()) / 1e3
    out["timed_total_us"] = float(t[n * 12] - t[0]) / 1e3
    return out


def bench(name: str, rows: int, context: int, steps: int, bw: float, settings: list[tuple[int, int]],
          timed: bool = False) -> list[dict]:
    max_len = context + 64
    cfg = EngineConfig(device=torch.device("cuda"), dtype=torch.bfloat16, max_model_len=max_len, max_num_seqs=rows,
                       kv_cache_memory_bytes=kv_memory_bytes(name, rows, max_len, 2 << 30), enforce_eager=True,
                       load_format="dummy", cuda_graph_batch_sizes=(rows,))
    mc = ModelConfig.from_path(shape_dir(name))
    mc.max_model_len = max_len
    runner = ModelRunner(mc, cfg, "draft")
    per_req = -(-max_len // cfg.block_size)
    tables = [[list(range(1 + i * per_req, 1 + (i + 1) * per_req))] for i in range(rows)]
    prompt = torch.randint(0, runner.vocab_size, (context,)).tolist()
    for i in range(rows):
        prefill(runner, prompt, tables[i])
    step = runner.buffers.load([Chunk([7], context, 1, tables[i]) for i in range(rows)])
    model, inner = runner.model, runner.model.model
    layer_bytes = sum(p.numel() * p.element_size() for p in inner.layers.parameters())
    floor_ms = (layer_bytes + rows * kv_bytes_read(name, context)) / bw * 1e3
    fwd = lambda: model(step.input_ids, step.positions, step.attn)  # noqa: E731
    inner.persistent = None
    base_out = fwd().float()
    base = {"shape": name, "rows": rows, "form": "layers", "tile_elems": "-", "warps": "-",
            "ms": graph_ms(fwd, steps), "kernels": kernels_per_forward(fwd)}
    out = [base]
    print(base, flush=True)
    laid = model.persistent_layers()
    assert laid is not None, f"{name}: no persistent layout"
    shape, weights = laid
    rot = inner.layers[0].self_attn.rotary
    for tile_elems, warps in settings:
        pd = PersistentDecoder(shape, weights, rot.cos, rot.sin, max_rows=rows, tile_elems=tile_elems,
                               num_warps=warps)
        inner.persistent = pd
        fused = fwd().float()
        torch.cuda.synchronize()
        err = int(pd.error.item())
        inner.persistent = None
        # staged: the same kernel a (layer, stage) a launch, no barrier
        c = step.attn.common
        g = step.attn.groups[0]
        h = inner.embed_tokens(step.input_ids).contiguous()
        staged = inner.norm(pd.run_staged(h, step.positions, g.slot_mapping, c.seq_lens, g.block_table)).float()
        inner.persistent = pd
        row = {"shape": name, "rows": rows, "form": "persistent", "tile_elems": tile_elems, "warps": warps,
               "ms": graph_ms(fwd, steps), "kernels": kernels_per_forward(fwd),
               "bn": "/".join(str(pd.bn[k]) for k in ("qkv", "o", "gu", "down")), "splits": pd.splits,
               "fused_eq_staged": bool(torch.equal(fused, staged)), "barrier_error": err,
               "max_abs_vs_layers": float((fused - base_out).abs().max()),
               "max_abs_layers": float(base_out.abs().max())}
        out.append(row)
        print(row, flush=True)
        if timed:
            row.update(stage_breakdown(shape, weights, rot, rows, tile_elems, warps, inner, fwd))
            print(row, flush=True)
        inner.persistent = None
    for r in out:
        r["floor_ms"] = floor_ms
        r["vs_floor"] = r["ms"] / floor_ms
        r["vs_layers"] = r["ms"] / base["ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-0.6b,smollm2-135m")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tile-elems", default="16384,32768,65536")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--timing", action="store_true", help="also a TIMING build's per-stage breakdown")
    ap.add_argument("--out")
    args = ap.parse_args()
    bw = copy_bandwidth()
    settings = [(int(t), int(w)) for t in args.tile_elems.split(",") for w in args.warps.split(",")]
    t0 = time.perf_counter()
    rows = []
    for name in args.shapes.split(","):
        for r in (int(x) for x in args.rows.split(",")):
            rows += bench(name, r, args.context, args.steps, bw, settings, args.timing)
            torch.cuda.empty_cache()
    cols = ["shape", "rows", "form", "tile_elems", "warps", "bn", "splits", "ms", "floor_ms", "vs_floor", "vs_layers",
            "kernels", "fused_eq_staged", "barrier_error", "max_abs_vs_layers", "max_abs_layers", "timed_total_us"]
    cols += [f"{s}_{p}_us" for s in STAGES for p in ("work", "wait")]
    print(f"decode forward without the LM head, {args.context}-token context, copy bandwidth {bw / 1e12:.2f} TB/s; "
          f"{time.perf_counter() - t0:.0f} s")
    print(markdown_table(rows, [c for c in cols if any(c in r for r in rows)]))
    if args.out:
        save_json(args.out, {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
