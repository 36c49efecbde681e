"""The tiling sweeps of benchmarks/gpu_small_m.py, and the tables they print for engine/kernels/small_m/tiles.py:
`sweep_one` times the FMA, row-loop and DOT tilings of one projection at some rows, `sweep_splitk` the split-K DOT
tilings at 5-64 rows; `measured_table` turns a split-K sweep into DOT_MEASURED, `few_rows_table` a sweep at 1-4
rows into a GPU model's FEW_ROWS_MEASURED entry."""

from __future__ import annotations

import torch
from common import graph_us

from engine.kernels.small_m.tiles import split_k_range


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
    rank = next((i + 1 for i, (_, c) in enumerate(results)  # (Triton's default pipeline depth is 3 stages)
                 if all(c[x] == rule[x] for x in key) and form(c) == form(rule)
                 and c.get("num_stages", 3) == rule.get("num_stages", 3)), None)
    rule_us = results[rank - 1][0] if rank else None
    print(f"sweep {shape} rows={m} {name}: default {default_us:.2f} us, best {us:.2f} us {cfg} "
          f"(floor {floor:.2f}); rule {[rule[x] for x in key]} rank {rank} of {len(results)}; top5 {top}", flush=True)
    return {"shape": shape, "rows": m, "proj": name, "default_us": default_us, "best_us": us, "floor_us": floor,
            "best": cfg, "top5": top, "rule": {x: rule[x] for x in key}, "rule_rank": rank,
            "rule_vs_best": rule_us / us if rule_us else None}


def splitk_grid(m: int, n: int, k: int, sms: int, allow_split: bool = True) -> list[dict]:
    """Split-K DOT tilings at m rows (5-64): the row tile is the rows padded to a power of two (16 at least);
    BLOCK_N 16, 32 or 64 (16 only for 16-row tiles: a square tile, the most programs without a split); BLOCK_K
    128/256/512 (64/128 for 64-row tiles, whose operand tiles are larger); the splits that give between half a program
    and four programs per SM (the plain path, split 1, among them where in range), each as the kernel runs it (equal
    K ranges: split counts that share one are timed once). Four warps (two too for 16 x 16 tiles, one mma each),
    three stages: the kernel compiles once per tiling and prologue (the split is a run-time argument), which keeps
    the sweep's compile time in its budget. allow_split False: no split (the gated epilogue takes none)."""
    bm = max(16, triton_pow2(m))
    grid, seen = [], set()
    for bn in (16, 32, 64) if bm == 16 else (32, 64):
        for bk in (128, 256, 512) if bm == 16 else (128, 256) if bm < 64 else (64, 128):
            tiles = -(-n // bn)
            for split in (1, 2, 3, 4, 6, 8, 12, 16) if allow_split else (1,):
                splits, k_split = split_k_range(k, bk, split)
                if (bn, bk, splits) in seen or not sms // 2 <= tiles * splits <= 4 * sms and splits > 1:
                    continue
                seen.add((bn, bk, splits))
                for warps in (2, 4) if bn == 16 else (4,):
                    grid.append(dict(USE_DOT=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=splits,
                                     num_warps=warps, num_stages=3))
    return grid


def sweep_splitk(shape: str, m: int, name: str, fn, calls: int, n: int, k: int, rule: dict) -> dict:
    """Time the split-K tilings of splitk_grid; the rule's pick (`tiles_for`) among them, as in sweep_one."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for cfg in splitk_grid(m, n, k, sms, allow_split=name != "gate_up") + [rule]:
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
    """This GPU model's entry of small_m_tiles.DOT_MEASURED from a split-K sweep: per (BLOCK_M, N, K) the tiling
    with the least time summed over the row counts swept with that row tile (5, 8 and 16 rows share the 16-row
    tile)."""
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


def few_rows_table(best: list[dict], margin: float = 0.05) -> dict[tuple[int, int, int], dict | str]:
    """This GPU model's entry of small_m_tiles.FEW_ROWS_MEASURED from a sweep at 1-4 rows: per (rows padded to a
    power of two, N, K) "CUBLAS" where cuBLAS with its separate norm / activation / add kernel beats the best tiling
    by more than `margin`, else the best tiling (its form's flag where it is not the FMA form, its pipeline stages
    for the DOT form) where the rule's is more than `margin` slower than it; shapes where the rule holds are left
    out."""
    table: dict[tuple[int, int, int], dict | str] = {}
    for b in best:
        key = (triton_pow2(b["rows"]), b["n"], b["k"])
        if b["unfused_us"] < b["best_us"] * (1 - margin):
            table[key] = "CUBLAS"
        elif (b["rule_vs_best"] or float("inf")) > 1 + margin:  # None: the rule's tiling is not in the grid
            cfg = b["best"]
            flags = {"USE_DOT": True} if cfg["USE_DOT"] else {"ROW_LOOP": True} if cfg.get("ROW_LOOP") else {}
            stages = {"num_stages": cfg["num_stages"]} if cfg["USE_DOT"] else {}
            table[key] = {**flags, **{x: cfg[x] for x in ("BLOCK_N", "BLOCK_K", "num_warps")}, **stages}
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
