"""Triton kernel micro-benchmark on CUDA: paged-attention decode against the torch reference and the
KV-bandwidth floor, plus the KV store and the rejection sampler.

    python benchmarks/gpu_kernels.py [--out benchmarks/out/kernels_h100.json] [--seq-len 1024] [--batch-sizes 1 8 32]

Decode: Qwen3-8B attention shape (32 query heads, 8 KV heads, head dim 128), bf16, block size 16, every
request at --seq-len keys. Times are GPU times from CUDA events, medians of --repeats after warm-up:
"graph" replays a CUDA graph of --launches back-to-back launches (no Python launch cost: what a captured
decode step pays), "eager" times the same launches from Python. The floor is the bytes of K and V that one
launch must read over the device-to-device copy bandwidth measured in the same run (bytes read + written
per second). The torch reference (engine.kernels.attention.paged.paged_attention_ref, one request at a
time, with host syncs) and the engine's torch backend layout (blocks gathered into a dense tensor + SDPA)
are timed for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, save_json  # noqa: E402
from gpu_shapes import copy_bandwidth  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.kernels.attention.kv_store import store_kv  # noqa: E402
from engine.kernels.attention.paged import paged_attention, paged_attention_ref  # noqa: E402
from engine.kernels.speculation.rejection import rejection_sample_from_noise as rejection_triton  # noqa: E402
from engine.speculation.rejection_sampler import rejection_sample_from_noise as rejection_torch  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def gpu_ms(fn: Callable[[], object], repeats: int, warmup: int = 5) -> float:
    """Median GPU time of fn() in ms, from CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_of(fn: Callable[[], object], launches: int) -> torch.cuda.CUDAGraph:
    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return graph


def decode_inputs(batch: int, seq_len: int) -> tuple:
    blocks_per_req = -(-seq_len // BLOCK_SIZE)
    num_blocks = 1 + batch * blocks_per_req
    kv = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    perm = torch.randperm(num_blocks - 1, device="cuda") + 1  # blocks scattered over the cache, as in serving
    table = perm.view(batch, blocks_per_req).to(torch.int32)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    return q, kv, qsl, seq_lens, table


def bench_decode(batch: int, seq_len: int, bandwidth: float, repeats: int, launches: int) -> dict:
    q, kv, qsl, seq_lens, table = decode_inputs(batch, seq_len)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5

    def kernel() -> None:
        paged_attention(q, kv[0], kv[1], out, qsl, seq_lens, table, scale, None, 1)

    graph = graph_of(kernel, launches)
    graph_us = gpu_ms(graph.replay, repeats) / launches * 1e3

    def eager() -> None:
        for _ in range(launches):
            kernel()

    eager_us = gpu_ms(eager, repeats) / launches * 1e3

    ref = torch.empty_like(q)
    ref_us = gpu_ms(lambda: paged_attention_ref(q, kv[0], kv[1], ref, qsl, seq_lens, table, scale, None, 1),
                    max(3, repeats // 20)) * 1e3
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)

    # The torch backend's way: gather the block table into dense K/V, then SDPA (GQA).
    def sdpa() -> torch.Tensor:
        k = kv[0][table.long()].view(batch, -1, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = kv[1][table.long()].view(batch, -1, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)

    sdpa_us = gpu_ms(sdpa, repeats) * 1e3
    kv_bytes = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * kv.element_size()
    floor_us = kv_bytes / bandwidth * 1e6
    return {"batch": batch, "seq_len": seq_len, "kv_MB": kv_bytes / 1e6, "floor_us": floor_us,
            "triton_graph_us": graph_us, "triton_eager_us": eager_us, "vs_floor": graph_us / floor_us,
            "achieved_TBps": kv_bytes / (graph_us * 1e-6) / 1e12, "gather_sdpa_us": sdpa_us, "torch_ref_us": ref_us}


def bench_store(num_tokens: int, repeats: int, launches: int) -> dict:
    kv = torch.zeros(2, 4096, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    value = torch.randn_like(key)
    slots = torch.randperm(kv.shape[1] * BLOCK_SIZE, device="cuda")[:num_tokens]
    graph = graph_of(lambda: store_kv(key, value, kv[0], kv[1], slots), launches)
    us = gpu_ms(graph.replay, repeats) / launches * 1e3
    return {"num_tokens": num_tokens, "triton_graph_us": us}


def bench_rejection(batch: int, k: int, vocab: int, repeats: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.rand(batch, k + 1, vocab, device="cuda", generator=g).softmax(-1)
    q = torch.rand(batch, k, vocab, device="cuda", generator=g).softmax(-1)
    drafts = torch.randint(0, vocab, (batch, k), device="cuda", generator=g)
    num = torch.full((batch,), k, device="cuda")
    u = torch.rand(batch, k, device="cuda", generator=g)
    e = torch.empty(batch, 1, vocab, device="cuda").exponential_(generator=g)
    args = (drafts, num, q, p, "probabilistic", None, u, e)
    tri = gpu_ms(lambda: rejection_triton(*args), repeats) * 1e3
    graph = graph_of(lambda: rejection_triton(*args), 1)
    tri_graph = gpu_ms(graph.replay, repeats) * 1e3
    ref = gpu_ms(lambda: rejection_torch(*args), repeats) * 1e3
    # Random drafts: the target rejects most at once, then the residual is raced (one vocabulary pass).
    return {"batch": batch, "k": k, "vocab": vocab, "triton_graph_us": tri_graph, "triton_eager_us": tri,
            "torch_eager_us": ref}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results as JSON to this path")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--launches", type=int, default=20, help="kernel launches per timed graph replay")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_kernels.py needs CUDA (the kernels are compiled for the GPU)")

    bandwidth = copy_bandwidth()
    decode = [bench_decode(b, args.seq_len, bandwidth, args.repeats, args.launches) for b in args.batch_sizes]
    store = [bench_store(n, args.repeats, args.launches) for n in (1, 32, 512)]
    rejection = [bench_rejection(b, 4, 151936, args.repeats // 4) for b in (1, 32)]

    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written)")
    print(f"\npaged_attention decode, {NUM_HEADS}q/{NUM_KV_HEADS}kv heads, d{HEAD_DIM}, bf16, block {BLOCK_SIZE} (us)")
    print(markdown_table(decode, ["batch", "seq_len", "kv_MB", "floor_us", "triton_graph_us", "vs_floor",
                                  "achieved_TBps", "triton_eager_us", "gather_sdpa_us", "torch_ref_us"]))
    print("\nstore_kv (us)")
    print(markdown_table(store, ["num_tokens", "triton_graph_us"]))
    print("\nrejection sampling, probabilistic, one launch (us)")
    print(markdown_table(rejection, ["batch", "k", "vocab", "triton_graph_us", "triton_eager_us", "torch_eager_us"]))
    save_json(args.out, {"environment": environment(), "copy_bandwidth_TBps": bandwidth / 1e12,
                         "decode": decode, "store_kv": store, "rejection": rejection})


if __name__ == "__main__":
    main()
