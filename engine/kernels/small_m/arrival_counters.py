"""Arrival counters of split-K products: persistent zeroed int32 buffers, one counter per output tile.

A split-K launch (engine/kernels/small_m/linear.py) gives each output tile SPLIT_K programs; each writes its
partial sums, then increments its tile's counter, and the one that arrives last sums the partials and sets the
counter back to 0. So a buffer is zero between launches and needs no memset per call, which also makes the launch
capturable in a CUDA graph and replayable any number of times (no host sync, nothing allocated that differs
between capture and replay).

Two launches that use one buffer must not run at once. Eager launches take the buffer of their stream (launches on
one stream run in order; under programmatic dependent launch a kernel touches the counters only after waiting for
the previous one). Graph captures take the device's graph buffer: a graph bakes in the address, and the stream it
is replayed on is not known at capture, so graphs whose products split K must not be replayed concurrently on two
streams (the engine replays every graph on its one stream). Buffers are allocated, zeroed, only outside a capture:
the device's graph buffer with its first eager buffer, so a capture must follow an eager call on the device (the
engine's warm-up and GraphPool.capture's warm-up runs are such calls).
"""

from __future__ import annotations

import torch

from engine.kernels.triton_compat import tl, triton

MIN_COUNTERS = 4096  # the first buffer's size: output tiles of 16 features cover N up to 65536
_buffers: dict[tuple[str, int | None, int], torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # grown-out buffers a captured graph may still address: never freed


def arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """At least `tiles` zeroed int32 counters for a launch on `device`'s current stream (or, while that stream is
    capturing a CUDA graph, the device's graph buffer), zero again after every launch that uses them."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, -1 if capturing else stream)
    buf = _buffers.get(key)
    if buf is not None and buf.numel() >= tiles:
        return buf
    if capturing:
        raise RuntimeError(f"split-K product: no arrival counters for {tiles} output tiles on {device} while a CUDA "
                           "graph is capturing (they are zeroed outside a capture): run the product once eagerly on "
                           "the device first, or launch it with SPLIT_K=1")
    graph_key = (device.type, device.index, -1)
    for k in {key, graph_key}:
        old = _buffers.get(k)
        if old is None or old.numel() < tiles:
            if old is not None:
                _retired.append(old)
            size = max(MIN_COUNTERS, 2 * (old.numel() if old is not None else 0), tiles)
            _buffers[k] = torch.zeros(size, dtype=torch.int32, device=device)
    return _buffers[key]


@triton.jit
def sum_splits(acc, part_ptr, count_ptr, tile, split, num_splits, offs, mask, MN):
    """A split-K program's meeting point: store its float32 partial sums acc at the workspace's slice `split` (offs:
    their offsets within a [M, N] slice of MN elements; mask: the tile's valid ones) and arrive at `tile`'s counter.
    Returns (whether this program arrived last, and there the slices' sum in slice order, whichever arrived last, so
    that a result does not depend on the arrival order); the last sets the counter back to 0 for the next launch."""
    parts = part_ptr + offs
    tl.store(parts + split * MN, acc, mask=mask)
    tl.debug_barrier()  # every thread's partials stored before the (one-thread) release below
    last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == num_splits - 1
    if last:
        acc = tl.zeros_like(acc)
        for s in range(0, num_splits):  # from L2 (.cg): another SM's writes, never a stale L1 line
            acc += tl.load(parts + s * MN, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile, 0)
    return last, acc
