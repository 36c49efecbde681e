"""How a paged-attention launch is laid out, from host ints only: rows a program takes, flash-decoding splits, key
tile width and warps (engine/kernels/attention/paged.py launches it; tree attention shares the split rule).

Every choice depends on host-side shapes and the GPU's SM count alone, never on device data, so a captured graph
keeps its grid while the lengths it reads change between replays.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from engine.kernels.triton_compat import shared_memory as _shared_memory  # 0 where not reported: no wider tile
from engine.kernels.triton_compat import triton

__all__ = ["MAX_AUTO_SPLITS", "WIDE_SPLITS", "WIDE_MIN_TILES", "AttentionLaunch", "compiled_variant",
           "default_tile_and_warps", "kernel_variant"]


class AttentionLaunch(NamedTuple):
    """How one paged-attention launch is laid out, from host ints only."""
    block_m: int  # (token, head) rows a program takes
    m_blocks: int  # programs along a request's rows
    splits: int  # programs sharing one request's keys (flash-decoding)
    tile_n: int  # keys a program reads per loop iteration
    num_warps: int


def kernel_variant(num_reqs: int, max_query_len: int, heads_per_kv: int, num_kv_heads: int, head_dim: int,
                   max_keys: int, device: torch.device, num_kv_splits: int | None = None, *,
                   kv_bytes: int) -> AttentionLaunch:
    """The launch of this shape (`kv_bytes`: the KV cache's element size). Compiled variants differ by BLOCK_M,
    TILE_N, warps and whether the keys are split (the split count itself is a runtime argument), so
    `compiled_variant` of every shape a runner may see is a small set that a warm-up can compile before the first
    request."""
    rows = max_query_len * heads_per_kv  # upper bound of one request's (token, head) rows per KV head
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    m_blocks = triton.cdiv(rows, block_m)
    programs = m_blocks * num_reqs * num_kv_heads
    # Splits count 64-key tiles (32 at head dim 256) whatever tile the kernel then streams: the split rules were
    # measured so. max_tiles is a host-side bound of any request's tiles.
    max_tiles = triton.cdiv(max_keys, _tile_n(head_dim))
    splits = num_kv_splits
    if splits is None:
        splits = _decode_splits(programs, max_tiles, device)
    tile_n, num_warps = _tile_and_warps(block_m, head_dim, programs * splits, max_keys // splits, device, kv_bytes)
    return AttentionLaunch(block_m, m_blocks, splits, tile_n, num_warps)


def compiled_variant(num_reqs: int, max_query_len: int, heads_per_kv: int, num_kv_heads: int, head_dim: int,
                     max_keys: int, device: torch.device, *, kv_bytes: int) -> tuple[int, bool, int, int]:
    """What selects a compiled kernel for this launch shape: (BLOCK_M, keys split, TILE_N, warps)."""
    v = kernel_variant(num_reqs, max_query_len, heads_per_kv, num_kv_heads, head_dim, max_keys, device,
                       kv_bytes=kv_bytes)
    return v.block_m, v.splits > 1, v.tile_n, v.num_warps


def _tile_n(head_dim: int) -> int:
    return 64 if triton.next_power_of_2(head_dim) <= 128 else 32


def default_tile_and_warps(block_m: int, head_dim: int) -> tuple[int, int]:
    """(TILE_N, num_warps) where no measured rule applies: prefill rows, other head dims, and tree attention."""
    return _tile_n(head_dim), 4 if block_m * triton.next_power_of_2(head_dim) <= 64 * 128 else 8


MAX_AUTO_SPLITS = 16


def _auto_splits(programs: int, max_tiles: int, device: torch.device) -> int:
    """Split keys while the grid fits in two waves of the GPU's SMs (decided from host-side shapes only, so
    a captured graph keeps its grid); at most MAX_AUTO_SPLITS, and no more than there can be tiles."""
    if device.type != "cuda":
        return 1
    splits = 1
    while splits < MAX_AUTO_SPLITS and programs * splits * 2 <= 2 * _num_sms(device) and splits * 2 <= max_tiles:
        splits *= 2
    return splits


# A grid of at most one program per 16 SMs before splitting (batch 1 of an 8-KV-head model: 8 programs) splits its keys
# up to WIDE_SPLITS ways, four programs an SM. On one H200 a Qwen3-0.6B draft token at batch 1 took 1.39 -> 1.19 ms at
# 8k tokens of context and 2.95 -> 2.15 ms at 32k against `_auto_splits`' 16 splits, and the Qwen3-8B decode step at
# 32k 6.89 -> 6.29 ms; at batch 8 the wide rule was 3-4% slower, so larger grids keep `_auto_splits`
# (benchmarks/RESULTS.md, "Flash-decoding splits at batch 1"). Past 64 splits (batch 1 of one to four KV heads) a
# split keeps at least WIDE_MIN_TILES tiles: SmolLM2's 3 KV heads at 32k tokens took 15.7 -> 14.5 us a layer with 128
# splits of 256 keys, but 128 splits of 64 keys (8k tokens) were slower than 64 (8.5 against 7.7 us), as were Gemma
# 3's at 8k (22.5 against 16.5 us; "Attention at head dims 64 and 256").
WIDE_SPLITS = 128
WIDE_MIN_TILES = 4


def _decode_splits(programs: int, max_tiles: int, device: torch.device) -> int:
    """Paged attention's splits: `_auto_splits`, or for a tiny grid up to WIDE_SPLITS within four programs an SM.
    A request shorter than the grid's longest context uses only the splits its tiles fill (the kernel's `live`)."""
    if device.type != "cuda" or programs * 16 > _num_sms(device):
        return _auto_splits(programs, max_tiles, device)
    splits = 1
    while (splits < WIDE_SPLITS and programs * splits * 2 <= 4 * _num_sms(device)
           and splits * 2 * (1 if splits < 64 else WIDE_MIN_TILES) <= max_tiles):
        splits *= 2
    return splits


# Key tiles and warps of a decode or a verify (up to 32 rows a program), by head dim and how many programs share an SM;
# prefill rows keep `default_tile_and_warps`. Swept one layer's attention on one H200 with
# benchmarks/gpu_attention_tune.py, then checked in the draft loop (benchmarks/RESULTS.md, "Attention's key tiles,
# swept" for head dim 128, "Attention at head dims 64 and 256" for the others):
# - head dim 128, four programs an SM (a tiny grid's wide splits: batch 1 of an 8-KV-head model) whose splits hold 256
#   keys or more stream with two warps: a Qwen3-0.6B draft token at batch 1 and 32k tokens took 2.11-2.16 -> 1.83-1.86
#   ms, and the Qwen3-8B verify of 5 tokens (32 rows, 32-key tiles) 59.5 -> 53.2 us a layer. With 128 keys a split
#   (8k tokens) the kernel alone was faster with two warps too (20.2 -> 17.9 us) but the draft token slower (1.13 ->
#   1.16-1.20 ms), so short splits keep four;
# - head dim 128, about two programs an SM (batch 2-32, or the verify at batch 8) read 128 keys an iteration: a
#   Qwen3-0.6B draft token at batch 8 took 3.54-3.60 -> 3.07-3.08 ms at 8k tokens and 10.1-10.2 -> 8.18 at 32k (1.10x
#   its floor with KV), and the 8B decode step at batch 8 and 32k 16.5 -> 14.0 ms. Not where a split's share is under
#   128 keys (a short longest context split many ways): 512 tokens at batch 1-4 lost 0.4-1.1 us a layer with the
#   wider tile, half of it empty;
# - head dim 64 (SmolLM2: 3 KV heads) reads 128 keys an iteration where a split holds 128 or more, with 8 warps from
#   1024 keys a split: 20.1 -> 14.5 us a layer at batch 1 and 32k tokens (with 128 splits), 117 -> 82 us at batch 8;
# - head dim 256 (Gemma 3: one KV head) reads 64 keys with 8 warps below three programs an SM (batch 1: 38.7 -> 33.6
#   us at 32k tokens, 12.3 -> 9.1 at 2k), and 32 keys with 2 warps at four (batch 8: 91.1 -> 79.1 us at 32k).
# A wider tile is taken only where its pipeline (three stages of a key and a value tile) fits the GPU's shared memory,
# so float32 caches and GPUs of less shared memory keep the narrower one.
def _tile_and_warps(block_m: int, head_dim: int, grid_programs: int, split_keys: int, device: torch.device,
                    kv_bytes: int) -> tuple[int, int]:
    """(TILE_N, num_warps) of a launch of `grid_programs` programs (splits included) whose splits take up to
    `split_keys` keys each. Off CUDA (Triton's interpreter) the grid counts as one program an SM and every tile
    fits."""
    usual = default_tile_and_warps(block_m, head_dim)
    dim = triton.next_power_of_2(head_dim)
    if block_m > 32 or dim not in (64, 128, 256):
        return usual
    per_sm = grid_programs / _num_sms(device) if device.type == "cuda" else 1.0
    if dim == 128:
        if per_sm >= 3:
            pick = ((64 if block_m == 16 else 32), 2) if split_keys >= 256 else usual
        else:
            pick = (128 if split_keys >= 128 else 64), 4
    elif dim == 64:
        pick = (128, 8 if split_keys >= 1024 else 4) if split_keys >= 128 else usual
    else:
        pick = ((32, 2) if split_keys >= 128 else (64, 4)) if per_sm >= 3 else (64, 8)
    return pick if _fits(pick[0], dim, kv_bytes, device) else usual


_PIPELINE_STAGES = 3  # Triton's default, which the kernel keeps (2-4 stages moved a layer by at most 4%)


def _fits(tile_n: int, head_dim_p: int, kv_bytes: int, device: torch.device) -> bool:
    """Whether a key tile of this width, pipelined, fits the device's shared memory: the stages' key and value
    tiles, an upper bound of what the compiled kernel allocates."""
    if device.type != "cuda":
        return True
    need = _PIPELINE_STAGES * 2 * tile_n * head_dim_p * kv_bytes
    return need <= _shared_memory(device)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count

