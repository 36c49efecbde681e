"""A decoder layer's products at 1-64 rows on one GPU: the few-row kernels with norms, activation and residual adds
folded in (engine/kernels/small_m_linear.py) against cuBLAS with the separate elementwise kernels, plus the number
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
1.2x and a 64-row layer within 1.6x of a one-row one. `--sweep fma --rows 1` also times each projection's cuBLAS
form with its separate kernel and prints this GPU model's ONE_ROW_MEASURED entry (`one_row_table`). `kernels`: CUDA
kernels of one eager forward under torch.profiler (a draft step for the draft shape: forward, argmax and the draft
loop's input rebuild).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import environment, graph_us, markdown_table, save_json
from gpu_linear import projections
from gpu_shapes import copy_bandwidth, shape_dir
from torch.profiler import ProfilerActivity, profile

from engine.kernels import small_m_linear as sml
from engine.kernels.activation import act_and_mul
from engine.kernels.rms_norm import add_rms_norm, rms_norm
from engine.kernels.small_m_tiles import split_k_range, tiles_for
from engine.kernels.triton_compat import set_pdl

L2_BYTES = 200 << 20  # rotate weights over at least this much memory


def layer_weights(shape: str) -> list[dict[str, torch.Tensor]]:
    p = projections(shape)
    h = p["qkv_proj"][0]
    one = sum(n * k for k, n in (p[x] for x in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))) * 2
    copies = max(2, -(-L2_BYTES // one))

    def w(name: str) -> torch.Tensor:
        k, n = p[name]
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5

    return [dict(qkv=w("qkv_proj"), o=w("o_proj"), gate_up=w("gate_up_proj"), down=w("down_proj"),
                 n1=torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5,
                 n2=torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5) for _ in range(copies)]


def bench_shape(shape: str, rows: list[int], bw: float, sweep: str | None) -> tuple[list[dict], list[dict]]:
    ws = layer_weights(shape)
    out, best = [], []
    if sweep and "splitk" in sweep:
        rows = sorted(set(rows) | {1})  # one row first: the split-K sweep's reference
    one_row: dict[str, float] = {}
    for m in rows:
        row, b = bench_rows(shape, m, ws, bw, sweep, one_row)
        out.append(row)
        best += b
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    ws.clear()
    torch.cuda.empty_cache()
    return out, best


def bench_rows(shape: str, m: int, ws: list[dict[str, torch.Tensor]], bw: float, sweep: str | None,
               one_row: dict[str, float]) -> tuple[dict, list[dict]]:
    """One row count: the layer chains, each projection alone; with sweep also other tilings. one_row: each
    projection's time at one row, filled at m = 1 (the split-K sweep's reference)."""
    p = projections(shape)
    h, attn_width, inter = p["qkv_proj"][0], p["o_proj"][0], p["down_proj"][0]
    layer_bytes = sum(t.numel() * 2 for name, t in ws[0].items() if name not in ("n1", "n2"))
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(m, attn_width, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)

    def old(i: int) -> None:
        w = ws[i % len(ws)]
        hh, s = add_rms_norm(x, res, w["n1"], 1e-6)
        F.linear(hh, w["qkv"])
        o = F.linear(a, w["o"])
        hh, s = add_rms_norm(o, s, w["n2"], 1e-6)
        F.linear(hh, w["gate_up"])
        F.linear(act_and_mul(gu, "silu"), w["down"])

    def new(i: int, cfg: dict | None = None) -> None:
        w = ws[i % len(ws)]
        _, s = sml.norm_linear(x, res, w["n1"], 1e-6, 0.0, w["qkv"], config=cfg)
        s = sml.linear_add(a, w["o"], None, s, config=cfg)
        sml.norm_linear(s, None, w["n2"], 1e-6, 0.0, w["gate_up"], config=cfg)
        sml.act_linear(gu, "silu", w["down"], config=cfg)

    calls = 4 * len(ws)
    row = {"shape": shape, "rows": m, "floor_us": layer_bytes / bw * 1e6,
           "old_layer_us": graph_us(old, calls), "new_layer_us": graph_us(new, calls),
           "new_no_pdl_layer_us": no_pdl_us(new, calls)}
    row["old_vs_floor"] = row["old_layer_us"] / row["floor_us"]
    row["new_vs_floor"] = row["new_layer_us"] / row["floor_us"]

    def w(i: int, name: str) -> torch.Tensor:
        return ws[i % len(ws)][name]

    kernels = {
        "qkv": (lambda i, cfg=None: sml.norm_linear(x, None, w(i, "n1"), 1e-6, 0.0, w(i, "qkv"), config=cfg), x),
        "o": (lambda i, cfg=None: sml.linear_add(a, w(i, "o"), None, res, config=cfg), a),
        "gate_up": (lambda i, cfg=None: sml.norm_linear(x, None, w(i, "n2"), 1e-6, 0.0, w(i, "gate_up"),
                                                       config=cfg), x),
        "down": (lambda i, cfg=None: sml.act_linear(gu, "silu", w(i, "down"), config=cfg), act_and_mul(gu, "silu")),
    }
    # cuBLAS with the separate elementwise kernel each fused product replaces
    unfused = {
        "qkv": lambda i: F.linear(rms_norm(x, w(i, "n1"), 1e-6), w(i, "qkv")),
        "o": lambda i: F.linear(a, w(i, "o")) + res,
        "gate_up": lambda i: F.linear(rms_norm(x, w(i, "n2"), 1e-6), w(i, "gate_up")),
        "down": lambda i: F.linear(act_and_mul(gu, "silu"), w(i, "down")),
    }
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
            b = sweep_one(shape, m, name, fn, calls, floor, row[f"{name}_new_us"], rule, forms)
            if m == 1:  # what ONE_ROW_MEASURED weighs the best tiling against
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


def sweep_grid(m: int, forms: str = "fma,dot,row") -> list[dict]:
    """Tilings the sweep times at m rows: the FMA form (a [rows, BLOCK_N, BLOCK_K] fp32 accumulator, so its tile
    shrinks as rows grow) and, from 2 rows, the DOT form (tl.dot on a 16-row tile, software-pipelined loads) and the
    row loop (the FMA form one row at a time, its weight tile the size of one row's)."""
    grid = []
    if m >= 2 and "row" in forms:
        # The one-row rule's tiles and their neighbours (a weight tile of at most 64 elements a thread).
        for bn, bk, warps in ((8, 512, 4), (16, 512, 4), (4, 1024, 4), (8, 1024, 4), (4, 2048, 4), (4, 1024, 8),
                              (8, 1024, 8), (16, 1024, 8), (4, 2048, 8), (8, 2048, 8)):
            grid.append(dict(USE_DOT=False, ROW_LOOP=True, BLOCK_M=triton_pow2(m), BLOCK_N=bn, BLOCK_K=bk,
                             num_warps=warps, num_stages=3))
    for bn in (1, 2, 4, 8, 16) if "fma" in forms else ():
        for bk in (256, 512, 1024, 2048, 4096):
            for warps in (4, 8):
                if triton_pow2(m) * bn * bk > 64 * 32 * warps or bn * bk < 32 * warps:  # registers / idle threads
                    continue
                grid.append(dict(USE_DOT=False, BLOCK_M=triton_pow2(m), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                 num_stages=3))
    if m >= 2 and "dot" in forms:
        for bn in (16, 32, 64):
            for bk in (64, 128, 256):
                for stages in (3, 5):
                    grid.append(dict(USE_DOT=True, BLOCK_M=max(16, triton_pow2(m)), BLOCK_N=bn, BLOCK_K=bk,
                                     num_warps=4, num_stages=stages))
    return grid


def sweep_one(shape: str, m: int, name: str, fn, calls: int, floor: float, default_us: float, rule: dict,
              forms: str = "fma,dot,row") -> dict:
    """Time the tilings of sweep_grid; `rule`: what _config picks, whose rank among them (1: the fastest) and
    time over the best are recorded, which is what a change of the rule needs."""
    results = []
    for cfg in sweep_grid(m, forms):
        try:
            us = graph_us(lambda i, cfg=cfg: fn(i, cfg), calls, replays=10)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
            print("skip", cfg, type(e).__name__, flush=True)
            continue
        results.append((us, cfg))
    results.sort(key=lambda r: r[0])
    us, cfg = results[0]
    top = [(round(u, 2), form(c), c["BLOCK_N"], c["BLOCK_K"], c["num_warps"],
            c["num_stages"]) for u, c in results[:5]]
    key = ("USE_DOT", "BLOCK_N", "BLOCK_K", "num_warps")
    rank = next((i + 1 for i, (_, c) in enumerate(results)
                 if all(c[x] == rule[x] for x in key) and form(c) == form(rule)), None)
    rule_us = results[rank - 1][0] if rank else None
    print(f"sweep {shape} rows={m} {name}: default {default_us:.2f} us, best {us:.2f} us {cfg} "
          f"(floor {floor:.2f}); rule {[rule[x] for x in key]} rank {rank} of {len(results)}; top5 {top}", flush=True)
    return {"shape": shape, "rows": m, "proj": name, "default_us": default_us, "best_us": us, "floor_us": floor,
            "best": cfg, "top5": top, "rule": {x: rule[x] for x in key}, "rule_rank": rank,
            "rule_vs_best": rule_us / us if rule_us else None}


def splitk_grid(m: int, n: int, k: int, sms: int) -> list[dict]:
    """Split-K DOT tilings at m rows (5-64): the row tile is the rows padded to a power of two (16 at least);
    BLOCK_N 32 or 64; BLOCK_K 128/256 (64/128 for 64-row tiles, whose operand tiles are larger); the splits that
    give between half a program and four programs per SM (the plain path, split 1, among them where in range), each
    as the kernel runs it (equal K ranges: split counts that share one are timed once). Four warps, three stages:
    the kernel compiles once per tiling and prologue (the split is a run-time argument), which keeps the sweep's
    compile time in its budget."""
    bm = max(16, triton_pow2(m))
    grid, seen = [], set()
    for bn in (32, 64):
        for bk in (128, 256) if bm < 64 else (64, 128):
            tiles = -(-n // bn)
            for split in (1, 2, 3, 4, 6, 8, 12, 16):
                splits, k_split = split_k_range(k, bk, split)
                if (bn, bk, splits) in seen or not sms // 2 <= tiles * splits <= 4 * sms and splits > 1:
                    continue
                seen.add((bn, bk, splits))
                grid.append(dict(USE_DOT=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=splits, num_warps=4,
                                 num_stages=3))
    return grid


def sweep_splitk(shape: str, m: int, name: str, fn, calls: int, n: int, k: int, rule: dict) -> dict:
    """Time the split-K tilings of splitk_grid; the rule's pick (`tiles_for`) among them, as in sweep_one."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for cfg in splitk_grid(m, n, k, sms) + [rule]:
        try:
            us = graph_us(lambda i, cfg=cfg: fn(i, cfg), calls, replays=10)
        except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
            print("skip", cfg, type(e).__name__, flush=True)
            continue
        results.append((us, cfg))
    rule_us = results[-1][0] if results and results[-1][1] is rule else None
    results.sort(key=lambda r: r[0])
    us, cfg = results[0]
    top = [(round(u, 2), c["BLOCK_N"], c["BLOCK_K"], split_k_range(k, c["BLOCK_K"], c.get("SPLIT_K", 1))[0])
           for u, c in results[:5]]
    print(f"splitk {shape} rows={m} {name}: best {us:.2f} us {cfg}; rule {rule_us and round(rule_us, 2)} us; "
          f"top5 (us, BLOCK_N, BLOCK_K, splits) {top}", flush=True)
    return {"shape": shape, "rows": m, "proj": name, "n": n, "k": k, "best_us": us, "best": cfg, "top5": top,
            "rule": rule, "rule_us": rule_us, "rule_vs_best": rule_us / us if rule_us else None,
            "results": [(u, c) for u, c in results if c is not rule]}


def measured_table(best: list[dict]) -> dict[tuple[int, int, int], dict]:
    """small_m_tiles.DOT_MEASURED from a split-K sweep: per (BLOCK_M, N, K) the tiling with the least time summed
    over the row counts swept with that row tile (5, 8 and 16 rows share the 16-row tile)."""
    sums: dict[tuple, dict[str, list]] = {}
    for b in best:
        for us, cfg in b.get("results", ()):
            key = (cfg["BLOCK_M"], b["n"], b["k"])
            entry = sums.setdefault(key, {}).setdefault(repr(sorted(cfg.items())), [0.0, set(), cfg])
            entry[0] += us
            entry[1].add(b["rows"])
    table = {}
    for key, by_cfg in sums.items():
        rows = set().union(*(e[1] for e in by_cfg.values()))
        full = [e for e in by_cfg.values() if e[1] == rows]  # timed at every row count of this tile
        table[key] = {x: v for x, v in min(full, key=lambda e: e[0])[2].items() if x not in ("USE_DOT", "BLOCK_M")}
    return table


def one_row_table(best: list[dict], margin: float = 0.05) -> dict[tuple[int, int], dict | str]:
    """This GPU model's entry of small_m_tiles.ONE_ROW_MEASURED from a one-row sweep: per (N, K) "CUBLAS" where
    cuBLAS with its separate norm / activation / add kernel beats the best tiling by more than `margin`, else the
    best tiling where the rule's is more than `margin` slower than it; shapes where the rule holds are left out."""
    table: dict[tuple[int, int], dict | str] = {}
    for b in best:
        if b["unfused_us"] < b["best_us"] * (1 - margin):
            table[(b["n"], b["k"])] = "CUBLAS"
        elif (b["rule_vs_best"] or float("inf")) > 1 + margin:  # None: the rule's tiling is not in the grid
            table[(b["n"], b["k"])] = {x: b["best"][x] for x in ("BLOCK_N", "BLOCK_K", "num_warps")}
    return table


def layer_summary(shape: str, m: int, best: list[dict]) -> None:
    """One layer's four products at m rows (the best split-K tilings, the rule's, cuBLAS with the separate
    elementwise kernels) against the same at one row (the tuned one-row kernels)."""
    one = sum(b["one_row_us"] for b in best)
    for b in best:
        b["best_vs_one_row"] = b["best_us"] / b["one_row_us"]
        b["best_vs_unfused"] = b["best_us"] / b["unfused_us"]
    tot = {key: sum(b[key] or float("nan") for b in best) for key in ("best_us", "rule_us", "unfused_us")}
    print(f"splitk layer {shape} rows={m}: one row {one:.2f} us; best {tot['best_us']:.2f} us "
          f"({tot['best_us'] / one:.2f}x one row); rule {tot['rule_us']:.2f} us ({tot['rule_us'] / one:.2f}x); "
          f"cuBLAS+elementwise {tot['unfused_us']:.2f} us ({tot['unfused_us'] / one:.2f}x)", flush=True)


def form(cfg: dict) -> str:
    return "dot" if cfg["USE_DOT"] else "row" if cfg.get("ROW_LOOP") else "fma"


def triton_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def count_kernels(shape: str, rows_setting: int, batch: int, draft: bool) -> dict:
    """CUDA kernels of one eager forward at `batch` decode rows (a draft step with draft=True)."""
    from engine.config import EngineConfig, ModelConfig
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
        r, b = bench_shape(shape, [int(x) for x in rows_for.get(shape, args.rows).split(",")], bw, args.sweep)
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
        print("DOT_MEASURED =", measured_table(split))  # for engine/kernels/small_m_tiles.py
    one_row = [b for b in best if "unfused_us" in b and b["rows"] == 1]
    if one_row:  # for engine/kernels/small_m_tiles.py ("CUBLAS" stands for small_m_tiles.CUBLAS)
        print(f"ONE_ROW_MEASURED[{torch.cuda.get_device_name()!r}] =", one_row_table(one_row))
    if counts:
        print(markdown_table(counts, ["shape", "step", "batch", "small_m_rows", "kernels", "per_layer", "copies"]))
    save_json(args.out, {"env": environment(), "args": vars(args), "bandwidth_Bps": bw, "rows": rows, "sweep": best,
                         "counts": counts})


if __name__ == "__main__":
    main()
