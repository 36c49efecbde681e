"""Weights requested into the GPU's L2 cache ahead of the products that read them (Triton kernel + typed wrapper +
torch reference).

Why: a batch-1 decode step of a small model (a draft) alternates bandwidth-bound products with latency-bound work
(attention's three kernels, each kernel's ramp and tail). During the latency-bound part HBM sits idle: a 0.6B
layer's attention takes about 9 us and reads about 2 MB, while the layer's 31 MB of weights take about 10 us at
full bandwidth. A prefetch issued before that stretch lets HBM stream the following products' weights into L2
meanwhile (H100: 50 MB of L2), and the products then read them at L2 speed. Only layers whose prefetched weights
fit well inside L2 take it (`fits_l2`): an 8B layer's products are hundreds of MB, bandwidth-bound on their own.

How: a table of (address, bytes) chunks, built once per layer and stage after the weights are loaded (weights
never move afterwards, and CUDA graphs capture the table's pointer). Each lane of the kernel requests one chunk:
on Hopper with one bulk request (`cp.async.bulk.prefetch.L2`, asynchronous: the lane does not wait for the data),
elsewhere with a line-by-line `prefetch.global.L2` loop. A prefetch is only a hint: it changes no memory, so the
torch reference does nothing, and the kernel's test is that every tensor is bit-for-bit unchanged and that the
products that follow compute what they compute without it.

Under programmatic dependent launch (engine/kernels/triton_compat.py) the requests go out before the kernel's wait
(the table and the weights are never written by a kernel), and the wait keeps the chain intact: the next kernel
waits on this one, and this one completes only after the one before it.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels.triton_compat import HAS_TRITON, interpreting, launch, tl, triton, wait_for_previous_kernel

__all__ = ["PrefetchTable", "fits_l2", "join_prefetches", "l2_prefetch", "l2_prefetch_ref", "l2_size"]

CHUNK_BYTES = 16384  # one lane's request; 16 KB keeps 45 programs busy for a 0.6B layer's 23 MB (see benchmarks)
LANES = 32  # chunks per program: one warp, each lane one request
LINE_BYTES = 128  # the portable path's step: one L2 line per prefetch instruction


@triton.jit
def _l2_prefetch_kernel(table_ptr, num_chunks, BULK: tl.constexpr, LINE: tl.constexpr, LANES_: tl.constexpr,
                        USE_PDL: tl.constexpr):
    offs = tl.program_id(0) * LANES_ + tl.arange(0, LANES_)
    mask = offs < num_chunks
    addr = tl.load(table_ptr + offs * 2, mask=mask, other=0)  # [LANES] int64 global addresses
    size = tl.load(table_ptr + offs * 2 + 1, mask=mask, other=0).to(tl.int32)  # [LANES] bytes, 16-byte multiples
    if BULK:
        # One asynchronous bulk request per lane (sm_90); a masked lane has size 0 and requests nothing.
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        for off in range(0, tl.max(size, axis=0), LINE):
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.lt.s32 p, $2, $3; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                "=r,l,r,r", [addr + off, tl.zeros_like(size) + off, size], dtype=tl.int32, is_pure=False, pack=1)
    wait_for_previous_kernel(USE_PDL)  # after the requests: see the module docstring


class PrefetchTable:
    """The chunks of some tensors' storage, as a device table the kernel reads: [num_chunks, 2] int64 (address,
    bytes). Holds references to the tensors, so their memory outlives the table."""

    def __init__(self, tensors: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> None:
        if not tensors:
            raise ValueError("a prefetch table needs at least one tensor")
        if chunk_bytes <= 0 or chunk_bytes % 16:
            raise ValueError(f"chunk_bytes must be a positive multiple of 16, got {chunk_bytes}")
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"prefetch tensors must share one device, got {sorted(map(str, devices))}")
        rows: list[tuple[int, int]] = []
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("prefetch tensors must be contiguous (their storage is requested as one range)")
            start, nbytes = t.data_ptr(), t.numel() * t.element_size()
            # Bulk requests take 16-byte aligned addresses and sizes: widen the range to 16-byte bounds (the
            # allocator's blocks are far more aligned than that, so the widened range stays inside the allocation).
            lo, hi = start & ~15, (start + nbytes + 15) & ~15
            rows += [(a, min(chunk_bytes, hi - a)) for a in range(lo, hi, chunk_bytes)]
        self.tensors = tensors
        self.device = tensors[0].device
        self.nbytes = sum(n for _, n in rows)
        self.table = torch.tensor(rows, dtype=torch.int64, device=self.device)  # [num_chunks, 2] int64

    @property
    def num_chunks(self) -> int:
        return self.table.shape[0]


@functools.cache
def l2_size(device_index: int) -> int:
    """The L2 cache of a CUDA device, in bytes."""
    return int(torch.cuda.get_device_properties(device_index).L2_cache_size)


def fits_l2(nbytes: int, device: torch.device) -> bool:
    """Whether prefetching `nbytes` is worth it: at most half of the device's L2, so the prefetched lines survive
    the reads (KV, activations) made before their product comes."""
    if device.type != "cuda" or not HAS_TRITON:
        return False
    return nbytes <= l2_size(device.index if device.index is not None else torch.cuda.current_device()) // 2


@functools.cache
def _bulk(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device_index: int) -> torch.cuda.Stream:
    if device_index not in _SIDE_STREAMS:
        _SIDE_STREAMS[device_index] = torch.cuda.Stream(device_index)
    return _SIDE_STREAMS[device_index]


def l2_prefetch(table: PrefetchTable, side: bool = True) -> None:
    """Request the table's chunks into L2 (CUDA only; a no-op elsewhere, where there is no L2 to warm: CPU and
    Triton's interpreter, which cannot run PTX).

    side: on a stream of its own, forked from the current one here (so it starts once the kernels launched before
    it are done, and runs beside the ones launched after); call join_prefetches before the current stream's work
    ends (a CUDA graph's capture requires it). A kernel whose bulk requests are in flight does not complete before
    they land, so in the current stream's chain it would hold the next kernel back for the whole transfer.
    False: in the current stream (measurement only)."""
    if table.device.type != "cuda" or not HAS_TRITON or interpreting():
        return
    index = table.device.index if table.device.index is not None else torch.cuda.current_device()
    grid = (triton.cdiv(table.num_chunks, LANES),)
    if not side:
        launch(_l2_prefetch_kernel, grid, table.device, table.table, table.num_chunks, BULK=_bulk(index),
               LINE=LINE_BYTES, LANES_=LANES, num_warps=1)
        return
    stream = _side_stream(index)
    stream.wait_stream(torch.cuda.current_stream(index))
    with torch.cuda.stream(stream):
        _l2_prefetch_kernel[grid](table.table, table.num_chunks, BULK=_bulk(index), LINE=LINE_BYTES, LANES_=LANES,
                                  USE_PDL=False, num_warps=1)


def join_prefetches(device: torch.device) -> None:
    """Make the current stream wait for the prefetches forked from it (see l2_prefetch)."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _SIDE_STREAMS:
        torch.cuda.current_stream(index).wait_stream(_SIDE_STREAMS[index])


def l2_prefetch_ref(table: PrefetchTable) -> None:
    """The torch reference: a prefetch changes no memory, so there is nothing to compute."""
    del table
