"""What an L2 prefetch buys a few-row product (engine/kernels/l2_prefetch.py), one GPU.

In a CUDA graph: a spin of --spin-us (standing in for a layer's attention, which leaves HBM idle) then one
single-row product of a weight of --mb megabytes (engine/kernels/small_m_linear.py), with and without an L2
prefetch of that weight launched before the spin. Weights rotate over --sets copies so that, without the prefetch,
they come from HBM. Reports the product's time: (spin + product) minus the spin alone, medians.

    python benchmarks/gpu_l2_prefetch.py --mb 4,12,23 --chunk-bytes 4096,16384,65536
"""

from __future__ import annotations

import argparse

import torch
from common import environment, markdown_table, save_json
from gpu_decode import cuda_median_ms

from engine.kernels import l2_prefetch
from engine.kernels.l2_prefetch import PrefetchTable
from engine.kernels.small_m_linear import linear_add


def graph_ms(fn, steps: int) -> float:
    """Median ms of one replay of a CUDA graph of fn."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return cuda_median_ms(g.replay, steps)


def measure(mb: float, chunks: list[int], cycles: int, sets: int, steps: int, dev: torch.device,
            sides: tuple[bool, ...]) -> list[dict]:
    hidden = 1024
    n = int(mb * 2**20 / 2 / hidden)  # bf16 rows of `hidden`
    ws = [torch.randn(n, hidden, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    add = torch.zeros(1, n, device=dev, dtype=torch.bfloat16)

    def run(tables: list[PrefetchTable] | None, product: bool, side: bool = True) -> None:
        for i, w in enumerate(ws):
            if tables is not None:
                l2_prefetch.l2_prefetch(tables[i], side)
            torch.cuda._sleep(cycles)
            if product:
                linear_add(x, w, None, add)
        l2_prefetch.join_prefetches(dev)

    spin = graph_ms(lambda: run(None, False), steps)
    plain = graph_ms(lambda: run(None, True), steps)
    rows = []
    for chunk in chunks:
        tables = [PrefetchTable([w], chunk) for w in ws]
        for side in sides:
            both = graph_ms(lambda tables=tables, side=side: run(tables, True, side), steps)
            spin_pf = graph_ms(lambda tables=tables, side=side: run(tables, False, side), steps)
            rows.append({"mb": mb, "chunk_bytes": chunk, "stream": "side" if side else "same",
                         "floor_us": mb * 2**20 / 3.0e12 * 1e6, "product_us": (plain - spin) / sets * 1e3,
                         "spin_and_product_after_prefetch_us": (both - spin) / sets * 1e3,
                         "product_after_prefetch_us": (both - spin_pf) / sets * 1e3,
                         "prefetch_and_spin_us": spin_pf / sets * 1e3, "spin_us": spin / sets * 1e3})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", default="4,12,23", help="weight sizes in MB (hidden 1024: the 0.6B shape's width)")
    ap.add_argument("--chunk-bytes", default="16384")
    ap.add_argument("--spin-us", type=float, default=10.0)
    ap.add_argument("--sets", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--streams", default="side,same", help="where the prefetch kernel runs: its own stream (side), "
                    "the product's (same), or both in turn")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    # Spin cycles for --spin-us at the SM clock (torch.cuda._sleep counts cycles).
    clock_hz = torch.cuda.get_device_properties(dev).clock_rate * 1e3 if hasattr(
        torch.cuda.get_device_properties(dev), "clock_rate") else 1.755e9
    cycles = int(args.spin_us * 1e-6 * clock_hz)
    rows = []
    for mb in (float(x) for x in args.mb.split(",")):
        rows += measure(mb, [int(c) for c in args.chunk_bytes.split(",")], cycles, args.sets, args.steps, dev,
                        tuple(x == "side" for x in args.streams.split(",")))
        torch.cuda.empty_cache()
    print(markdown_table(rows, list(rows[0])))
    save_json(args.out, {"env": environment(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
