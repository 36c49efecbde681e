"""A decoder layer's products at 1-64 rows on one GPU: the few-row kernels with norms, activation and residual adds
folded in (engine/kernels/small_m/linear.py) against cuBLAS with the separate elementwise kernels, plus the number
of kernels one step launches either way.

    python benchmarks/gpu_small_m.py --shapes qwen3-0.6b,qwen3-8b --rows 1,2,5,8,16,32,64 [--sweep] --out small_m.json
    python benchmarks/gpu_small_m.py --shapes qwen3-0.6b,qwen3-8b --rows 1,5,8,16,32,64 --rows-for qwen3-8b=1,5 \
        --skip-count --sweep splitk --out small_m_splitk.json

Per shape and row count, `layer`: one layer's product work in a CUDA graph, old chain (add+norm, qkv, o_proj,
add+norm, gate_up, act*mul, down: 7 kernels) against the new one (norm+qkv, o_proj+add, norm+gate_up, act+down: 4
kernels); per projection the new kernel alone and cuBLAS alone. `new_no_pdl`: the new chain launched without
programmatic dependent launch. Weights rotate over enough copies that they do not sit in L2 (50 MB on an H100)
between calls, as in a real step. Floor: the weight bytes over the copy bandwidth measured in the same run. --sweep
also times other tile sizes at each row count and prints the fastest per projection. `--sweep splitk`: at 5 rows and
more the split-K DOT tilings (rows padded to 16, 32 or 64; BLOCK_N, BLOCK_K and the split), each projection's best
against its time at one row (the tuned one-row rule; 1 is added to the rows) and against cuBLAS with the separate
elementwise kernel it replaces (`unfused`), and per layer the sum of the four: the goal is a 16-row layer within
1.2x and a 64-row layer within 1.6x of a one-row one. At 1-4 rows (`--sweep fma,row,dot --rows 1,2,4`) the sweep
also times each projection's cuBLAS form with its separate kernel and prints this GPU model's FEW_ROWS_MEASURED
entry (the sweeps and the tables they print: benchmarks/small_m_sweep.py); `--in-chain` times each tiling inside
the layer's chain of four products instead of alone (on the small models its spread was the measurement's own).
`--compile-workers N` compiles the tilings in N processes first: a sweep is bound by Triton's compiles. `kernels`:
CUDA kernels of one eager forward under torch.profiler (a draft step for the draft shape: forward, argmax and the
draft loop's input rebuild).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import environment, graph_us, markdown_table, save_json
from gpu_linear import projections
from gpu_shapes import copy_bandwidth, shape_dir
from small_m_sweep import (
    few_rows_table,
    layer_summary,
    measured_table,
    splitk_grid,
    sweep_grid,
    sweep_one,
    sweep_splitk,
)
from torch.profiler import ProfilerActivity, profile

from engine.kernels.activation import act_and_mul
from engine.kernels.rms_norm import add_rms_norm, rms_norm
from engine.kernels.small_m import linear as sml
from engine.kernels.small_m import tiles as small_m_tiles
from engine.kernels.small_m.tiles import tiles_for
from engine.kernels.triton_compat import set_pdl

L2_BYTES = 200 << 20  # rotate weights over at least this much memory
# The four products this benchmark times, by its names for them, and gpu_linear.projections' names
PROJECTIONS = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}


def layer_weights(shape: str, copies: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Copies of one layer's weights, by default enough that together they exceed L2_BYTES."""
    p = projections(shape)
    h = p["qkv_proj"][0]
    one = sum(n * k for k, n in (p[x] for x in PROJECTIONS.values())) * 2
    copies = copies or max(2, -(-L2_BYTES // one))

    def w(name: str) -> torch.Tensor:
        k, n = p[name]
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5

    return [dict(**{name: w(key) for name, key in PROJECTIONS.items()},
                 n1=torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5,
                 n2=torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5) for _ in range(copies)]


def bench_shape(shape: str, rows: list[int], bw: float, sweep: str | None, workers: int = 0,
                in_chain: bool = False) -> tuple[list[dict], list[dict]]:
    ws = layer_weights(shape)
    out, best = [], []
    if sweep and "splitk" in sweep:
        rows = sorted(set(rows) | {1})  # one row first: the split-K sweep's reference
    if sweep and workers:
        precompile(shape, sweep_tasks(shape, rows, sweep), workers)
    one_row: dict[str, float] = {}
    for m in rows:
        row, b = bench_rows(shape, m, ws, bw, sweep, one_row, in_chain)
        out.append(row)
        best += b
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    ws.clear()
    torch.cuda.empty_cache()
    return out, best


def projection_calls(shape: str, m: int, ws: list[dict[str, torch.Tensor]]) -> tuple[dict, dict, tuple]:
    """One layer's four products at m rows on random inputs: per projection (the fused kernel as fn(i, config),
    its input), the same through cuBLAS with the separate elementwise kernel it replaces, and the inputs (x, res, a,
    gu). Call i reads the weights of copy i of ws (rotated, so they come from HBM)."""
    p = projections(shape)
    h, attn_width, inter = p["qkv_proj"][0], p["o_proj"][0], p["down_proj"][0]
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(m, attn_width, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)

    def w(i: int, name: str) -> torch.Tensor:
        return ws[i % len(ws)][name]

    if m > sml.FMA_MAX_ROWS:  # the wide path (engine/models/llama.py _forward_wide)
        return _wide_calls(m, w, x, res, a, gu)
    kernels = {
        "qkv": (lambda i, cfg=None: sml.norm_linear(x, None, w(i, "n1"), 1e-6, 0.0, w(i, "qkv"), config=cfg), x),
        "o": (lambda i, cfg=None: sml.linear_add(a, w(i, "o"), None, res, config=cfg), a),
        "gate_up": (lambda i, cfg=None: sml.norm_linear(x, None, w(i, "n2"), 1e-6, 0.0, w(i, "gate_up"),
                                                       config=cfg), x),
        "down": (lambda i, cfg=None: sml.act_linear(gu, "silu", w(i, "down"), config=cfg), act_and_mul(gu, "silu")),
    }
    unfused = {
        "qkv": lambda i: F.linear(rms_norm(x, w(i, "n1"), 1e-6), w(i, "qkv")),
        "o": lambda i: F.linear(a, w(i, "o")) + res,
        "gate_up": lambda i: F.linear(rms_norm(x, w(i, "n2"), 1e-6), w(i, "gate_up")),
        "down": lambda i: F.linear(act_and_mul(gu, "silu"), w(i, "down")),
    }
    return kernels, unfused, (x, res, a, gu)


def _wide_calls(m: int, w, x: torch.Tensor, res: torch.Tensor, a: torch.Tensor, gu: torch.Tensor
                ) -> tuple[dict, dict, tuple]:
    """projection_calls at 5-64 rows, the products as the wide path runs them: the norms read their rows' sums of
    squares (16 column tiles' worth, as a 1024-wide product of 64-feature tiles writes them), the activation is
    gate_up's epilogue, the residual adds are o_proj's and down's epilogues; cuBLAS with the same elementwise work
    as separate kernels."""
    ss = x.float().square().view(m, 16, -1).sum(-1).T.contiguous()  # [16, m] float32
    act = act_and_mul(gu, "silu")
    kernels = {
        "qkv": (lambda i, cfg=None: sml.norm_linear(x, None, w(i, "n1"), 1e-6, 0.0, w(i, "qkv"), config=cfg,
                                                   row_ss=ss), x),
        "o": (lambda i, cfg=None: sml.linear_add_ss(a, w(i, "o"), None, res, config=cfg), a),
        "gate_up": (lambda i, cfg=None: sml.norm_linear(x, None, w(i, "n2"), 1e-6, 0.0, w(i, "gate_up"), config=cfg,
                                                       row_ss=ss, glu="silu"), x),
        "down": (lambda i, cfg=None: sml.linear_add_ss(act, w(i, "down"), None, res, config=cfg), act),
    }
    unfused = {
        "qkv": lambda i: F.linear(rms_norm(x, w(i, "n1"), 1e-6), w(i, "qkv")),
        "o": lambda i: F.linear(a, w(i, "o")) + res,
        "gate_up": lambda i: act_and_mul(F.linear(rms_norm(x, w(i, "n2"), 1e-6), w(i, "gate_up")), "silu"),
        "down": lambda i: F.linear(act, w(i, "down")) + res,
    }
    return kernels, unfused, (x, res, a, gu)


_WORKER: dict = {}


def _compile_init(shape: str) -> None:
    _WORKER.update(shape=shape, ws=layer_weights(shape, copies=1))


def _compile_one(m: int, name: str, cfg: dict) -> None:
    """Run one tiling once in a worker process: Triton compiles it into its on-disk cache, where the timing process
    finds it. (The same code path and inputs of the same shapes give the same specialization, so the same entry.)"""
    kernels, _, _ = projection_calls(_WORKER["shape"], m, _WORKER["ws"])
    try:
        kernels[name][0](0, cfg)
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - the timing process reports what does not compile
        pass


def precompile(shape: str, tasks: list[tuple[int, str, dict]], workers: int) -> None:
    """Compile the sweep's tilings in `workers` processes before they are timed: the sweep is bound by Triton's
    compiles (several seconds a tiling), the timing by the GPU."""
    import time
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    t0 = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_compile_init,
                             initargs=(shape,)) as pool:
        list(pool.map(_compile_one, *zip(*tasks)))
    print(f"precompiled {len(tasks)} tilings of {shape} in {time.perf_counter() - t0:.0f} s", flush=True)


def sweep_tasks(shape: str, rows: list[int], sweep: str) -> list[tuple[int, str, dict]]:
    """(rows, projection, tiling) of every tiling the sweep will time for this shape."""
    p = projections(shape)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    forms = ",".join(f for f in sweep.split(",") if f != "splitk")
    tasks = []
    for m in rows:
        for name, key in PROJECTIONS.items():
            k, n = p[key]
            if "splitk" in sweep and m > sml.FMA_MAX_ROWS:
                tasks += [(m, name, cfg) for cfg in splitk_grid(m, n, k, sms, allow_split=name != "gate_up")]
            elif forms:
                tasks += [(m, name, cfg) for cfg in sweep_grid(m, forms)]
    return tasks


def bench_rows(shape: str, m: int, ws: list[dict[str, torch.Tensor]], bw: float, sweep: str | None,
               one_row: dict[str, float], in_chain: bool = False) -> tuple[dict, list[dict]]:
    """One row count: the layer chains, each projection alone; with sweep also other tilings. one_row: each
    projection's time at one row, filled at m = 1 (the split-K sweep's reference). in_chain: a 1-4-row sweep times
    each tiling in the layer's chain of four products, the other three as the engine runs them."""
    layer_bytes = sum(t.numel() * 2 for name, t in ws[0].items() if name not in ("n1", "n2"))
    kernels, unfused, (x, res, a, gu) = projection_calls(shape, m, ws)

    def old(i: int) -> None:
        w = ws[i % len(ws)]
        hh, s = add_rms_norm(x, res, w["n1"], 1e-6)
        F.linear(hh, w["qkv"])
        o = F.linear(a, w["o"])
        hh, s = add_rms_norm(o, s, w["n2"], 1e-6)
        F.linear(hh, w["gate_up"])
        F.linear(act_and_mul(gu, "silu"), w["down"])

    def new(i: int, cfg: dict | None = None, only: str | None = None) -> None:
        """The four fused products; cfg for every product, or with `only` for that one alone."""
        w = ws[i % len(ws)]
        c = {p: cfg if only in (None, p) else None for p in ("qkv", "o", "gate_up", "down")}
        if m > sml.FMA_MAX_ROWS:  # the wide path's four products
            for p, (fn, _) in kernels.items():
                fn(i, c[p])
            return
        _, s = sml.norm_linear(x, res, w["n1"], 1e-6, 0.0, w["qkv"], config=c["qkv"])
        s = sml.linear_add(a, w["o"], None, s, config=c["o"])
        sml.norm_linear(s, None, w["n2"], 1e-6, 0.0, w["gate_up"], config=c["gate_up"])
        sml.act_linear(gu, "silu", w["down"], config=c["down"])

    calls = 4 * len(ws)
    row = {"shape": shape, "rows": m, "floor_us": layer_bytes / bw * 1e6,
           "old_layer_us": graph_us(old, calls), "new_layer_us": graph_us(new, calls),
           "new_no_pdl_layer_us": no_pdl_us(new, calls)}
    row["old_vs_floor"] = row["old_layer_us"] / row["floor_us"]
    row["new_vs_floor"] = row["new_layer_us"] / row["floor_us"]

    def w(i: int, name: str) -> torch.Tensor:
        return ws[i % len(ws)][name]

    row["max_rel_err"] = max_rel_err(x, res, a, gu, ws[0])
    best = []
    for name, (fn, inp) in kernels.items():
        floor = ws[0][name].numel() * 2 / bw * 1e6
        row[f"{name}_new_us"] = graph_us(fn, calls)
        row[f"{name}_cublas_us"] = graph_us(lambda i, inp=inp, name=name: F.linear(inp, w(i, name)), calls)
        row[f"{name}_floor_us"] = floor
        if m == 1:
            one_row[name] = row[f"{name}_new_us"]
        n, k = ws[0][name].shape
        rule = tiles_for(m, n, k, ws[0][name].device, measured=False)  # the rule, not this GPU's exceptions
        if sweep and "splitk" in sweep and m > sml.FMA_MAX_ROWS:
            b = sweep_splitk(shape, m, name, fn, calls, n, k, rule)
            b.update(default_us=row[f"{name}_new_us"], floor_us=floor, one_row_us=one_row.get(name),
                     unfused_us=graph_us(unfused[name], calls))
            best.append(b)
        elif sweep and set(sweep.split(",")) - {"splitk"}:
            forms = ",".join(f for f in sweep.split(",") if f != "splitk")
            if in_chain:  # each tiling, and cuBLAS with its separate kernel, between the engine's other products
                b = sweep_one(shape, m, name, lambda i, cfg, name=name: new(i, cfg, name), calls, floor,
                              row["new_layer_us"], rule, forms)
                b.update(n=n, k=k, in_chain=True,
                         unfused_us=graph_us(lambda i, name=name: new(i, small_m_tiles.CUBLAS, name), calls))
            else:
                b = sweep_one(shape, m, name, fn, calls, floor, row[f"{name}_new_us"], rule, forms)
                # what FEW_ROWS_MEASURED weighs the best tiling against
                b.update(n=n, k=k, unfused_us=graph_us(unfused[name], calls))
            best.append(b)
    if any(b["rows"] == m and "one_row_us" in b for b in best):
        layer_summary(shape, m, [b for b in best if b["rows"] == m])
    return row, best


def no_pdl_us(fn, calls: int) -> float:
    """graph_us with every kernel launched the ordinary way."""
    set_pdl(False)
    try:
        return graph_us(fn, calls)
    finally:
        set_pdl(True)


def max_rel_err(x: torch.Tensor, res: torch.Tensor, a: torch.Tensor, gu: torch.Tensor,
                w: dict[str, torch.Tensor]) -> float:
    """The largest relative error (norm of the difference over the norm of the reference) of the four kernels
    against their torch references on these inputs: bf16 outputs land near 1e-3."""
    pairs = [(sml.norm_linear(x, res, w["n1"], 1e-6, 0.0, w["qkv"])[0],
              sml.norm_linear_ref(x, res, w["n1"], 1e-6, 0.0, w["qkv"])[0]),
             (sml.linear_add(a, w["o"], None, res), sml.linear_add_ref(a, w["o"], None, res)),
             (sml.norm_linear(x, None, w["n2"], 1e-6, 1.0, w["gate_up"])[0],
              sml.norm_linear_ref(x, None, w["n2"], 1e-6, 1.0, w["gate_up"])[0]),
             (sml.act_linear(gu, "gelu_pytorch_tanh", w["down"]),
              sml.act_linear_ref(gu, "gelu_pytorch_tanh", w["down"]))]
    return max(float((got.float() - ref.float()).norm() / ref.float().norm()) for got, ref in pairs)


def count_kernels(shape: str, rows_setting: int, batch: int, draft: bool) -> dict:
    """CUDA kernels of one eager forward at `batch` decode rows (a draft step with draft=True)."""
    from engine.config import EngineConfig
    from engine.model_config import ModelConfig
    from engine.runner.model_runner import ModelRunner
    from engine.runner.step_input import Chunk
    from engine.speculation.draft_loop import DraftLoop

    cfg = EngineConfig(device=torch.device("cuda"), dtype=torch.bfloat16, max_model_len=640, max_num_seqs=batch,
                       kv_cache_memory_bytes=1 << 30, enforce_eager=True, num_speculative_tokens=4,
                       load_format="dummy", small_m_rows=rows_setting)
    mc = ModelConfig.from_path(shape_dir(shape))
    mc.max_model_len = 640
    runner = ModelRunner(mc, cfg, "draft" if draft else "target")
    chunks = [Chunk([7], 100, 1, [list(range(1 + 40 * i, 41 + 40 * i)) for _ in runner.kv_groups])
              for i in range(batch)]
    if draft:
        loop = DraftLoop(runner, 4, keep_probs=False)
        runner.buffers.load(chunks, num_reqs=batch, num_logits_padded=batch)

        def step() -> None:
            loop._next_step(batch, True)
    else:
        def step() -> None:
            runner.execute(runner.buffers.load(chunks))
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in names if not n.startswith(("Memcpy", "Memset"))]
    layers = mc.num_layers
    return {"shape": shape, "step": "draft step" if draft else "decode", "batch": batch, "small_m_rows": rows_setting,
            "kernels": len(kernels), "per_layer": len(kernels) / layers, "copies": len(names) - len(kernels)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--rows", default="1,2,5,8,16,32,64")
    ap.add_argument("--rows-for", action="append", default=[], metavar="SHAPE=ROWS",
                    help="other rows for one shape (e.g. qwen3-8b=1,5: the target's verify at 5 rows); repeatable")
    ap.add_argument("--sweep", nargs="?", const="fma,dot,row", default=None,
                    help="also time other tilings; optionally only some forms (comma-separated: fma, dot, row, "
                         "splitk: the split-K tilings at 5 rows and more, against one row and cuBLAS)")
    ap.add_argument("--skip-count", action="store_true")
    ap.add_argument("--in-chain", action="store_true",
                    help="at 1-4 rows time each tiling in the layer's chain of four products (the others as the engine "
                         "runs them) rather than alone; the table's 5% margin is then of the chain")
    ap.add_argument("--compile-workers", type=int, default=0,
                    help="compile the sweep's tilings in this many processes first (Triton's compiles bound it)")
    ap.add_argument("--out")
    args = ap.parse_args()
    counts = [] if args.skip_count else [
        count_kernels(s, setting, 1, draft) for s, draft in (("qwen3-0.6b", True), ("qwen3-8b", False))
        for setting in (0, 1)]
    for c in counts:
        print(c, flush=True)
    bw = copy_bandwidth()
    rows, best = [], []
    rows_for = dict(item.split("=", 1) for item in args.rows_for)
    for shape in args.shapes.split(","):
        r, b = bench_shape(shape, [int(x) for x in rows_for.get(shape, args.rows).split(",")], bw, args.sweep,
                           args.compile_workers, args.in_chain)
        rows += r
        best += b
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(markdown_table(rows, ["shape", "rows", "floor_us", "old_layer_us", "new_layer_us", "new_no_pdl_layer_us",
                                "old_vs_floor", "new_vs_floor", "max_rel_err"]))
    print(markdown_table(rows, ["shape", "rows"] + [f"{p}_{w}_us" for p in ("qkv", "o", "gate_up", "down")
                                                     for w in ("new", "cublas", "floor")]))
    split = [b for b in best if "one_row_us" in b]
    if len(split) < len(best):
        print(markdown_table([b for b in best if "one_row_us" not in b],
                             ["shape", "rows", "proj", "default_us", "best_us", "floor_us", "best", "rule_rank",
                              "rule_vs_best"]))
    if split:
        print(markdown_table(split, ["shape", "rows", "proj", "one_row_us", "default_us", "best_us", "unfused_us",
                                     "floor_us", "best_vs_one_row", "best_vs_unfused", "rule_vs_best", "best"]))
        print(f"DOT_MEASURED[{torch.cuda.get_device_name()!r}] =", measured_table(split))  # small_m/tiles.py
    few = [b for b in best if "one_row_us" not in b and b["rows"] <= sml.FMA_MAX_ROWS]
    if few:  # for engine/kernels/small_m/tiles.py ("CUBLAS" stands for small_m_tiles.CUBLAS)
        print(f"FEW_ROWS_MEASURED[{torch.cuda.get_device_name()!r}] =", few_rows_table(few))
    if counts:
        print(markdown_table(counts, ["shape", "step", "batch", "small_m_rows", "kernels", "per_layer", "copies"]))
    save_json(args.out, {"env": environment(), "args": vars(args), "bandwidth_Bps": bw, "rows": rows, "sweep": best,
                         "counts": counts})


if __name__ == "__main__":
    main()
