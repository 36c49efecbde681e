"""The input RMSNorm, the qkv product and attention's prologue in one kernel, for a few rows (1-4: a batch-1 decode,
a draft step): the small-M product of engine/kernels/small_m_linear.py whose epilogue does the work of
engine/kernels/qk_norm_rope_store.py, per-head q/k RMSNorm, rotary embedding of q and k and the store of the new
keys and values into the paged KV cache (Triton kernel + typed wrapper + torch reference).

At one row a Llama-family layer is otherwise norm+qkv, attention's prologue, attention (+ its split-KV combine),
o_proj+residual, norm+gate_up, act+down: this folds the second launch into the first (five launches per layer).

Layout: a program owns one head (q, k or v) of every row and a slice of K. It computes the head's two halves as
two accumulators, columns d and d + D/2 (the rotate-half layout of the rotary kernels, as HF), so the rotation
pairs up elementwise and the head's norm statistics are sums over both. Since a program owns a whole head, a
model has few programs (Qwen3-0.6B: 16 + 8 + 8 = 32 heads), fewer than an H100's 132 SMs: the K reduction is
split over SPLIT_K programs per head. Each stores its float32 partial product; an atomic counter per head tells
the last of them to arrive, which sums the partials in the order of their slices (so the result does not depend
on which program finishes last), runs the epilogue and sets the counter back to zero for the next launch. The
counters live per device (`_counters`) and start at zero; kernels sharing them must not run concurrently, which
holds for a model's layers run in stream order (a launch interrupted halfway, e.g. by a device error, leaves them
dirty). With SPLIT_K = 1 a program sums its whole K itself, no counter involved. `_config` picks SPLIT_K so that
the grid holds about two programs per SM; the benchmark (benchmarks/gpu_small_m.py --fused-qkv) times the others.

Rounding is that of the unfused pair (small_m_linear.norm_linear, then qk_norm_rope_store): the residual sum is
rounded to the activation dtype, the input norm's output too (the Llama or Gemma form, as in small_m_linear); the
product accumulates in float32, the bias is added in float32 and the result is rounded to the activation dtype,
which is the qkv the unfused prologue would read; then the per-head norm (statistics in float32, output rounded),
the rotation in float32 of the rounded values, rounded again; keys and values are cast to the cache's dtype. Only
the order of the float32 sums differs (the split of K, and the per-head sums). A negative slot marks a padding
token of a CUDA graph's batch: its keys and values are not stored (its q is still computed).
"""

from __future__ import annotations

import torch

from engine.kernels.qk_norm_rope_store import _check_args as _check_prologue_args
from engine.kernels.qk_norm_rope_store import qk_norm_rope_store_ref
from engine.kernels.rms_norm import use_fused_kernels
from engine.kernels.small_m_linear import FMA_MAX_ROWS, _input_tile, _num_sms, norm_linear_ref
from engine.kernels.triton_compat import launch, require_triton, tl, triton, wait_for_previous_kernel

__all__ = ["MAX_ROWS", "takes_rows", "norm_qkv_rope_store", "norm_qkv_rope_store_ref"]

MAX_ROWS = FMA_MAX_ROWS  # the FMA form only: above it the layers keep the separate prologue kernel


@triton.jit
def _head_norm(x1, x2, w_ptr, d, d_mask, eps, offset, HALF: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """RMSNorm of one head of every row, given as its two halves [rows, HALF_P]; both halves rounded to the input
    dtype (qk_norm_rope_store's _norm_half, row by row)."""
    dt = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_OFFSET:
        y1, y2 = f1 * rstd[:, None] * (offset + w1), f2 * rstd[:, None] * (offset + w2)
    else:
        y1 = (f1 * rstd[:, None]).to(dt).to(tl.float32) * w1
        y2 = (f2 * rstd[:, None]).to(dt).to(tl.float32) * w2
    return y1.to(dt), y2.to(dt)


@triton.jit
def _epilogue(y1, y2, head, rows, m_mask, d, d_mask,
              b_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
              stride_cos, stride_qot, stride_qoh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
              stride_vch, qk_eps, qk_offset,
              NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_QK_NORM: tl.constexpr, HAS_QK_OFFSET: tl.constexpr):
    """The head's product sums y1, y2 (float32, [rows, HALF_P]: columns d and HALF + d) to q, or to the KV cache."""
    dt = q_out_ptr.dtype.element_ty
    if HAS_BIAS:
        y1 += tl.load(b_ptr + head * (2 * HALF) + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        y2 += tl.load(b_ptr + head * (2 * HALF) + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    x1, x2 = y1.to(dt), y2.to(dt)  # the qkv product's output, as the unfused product rounds it
    mask = m_mask[:, None] & d_mask[None, :]
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        if HAS_QK_NORM:
            if head < NUM_Q_HEADS:
                x1, x2 = _head_norm(x1, x2, q_w_ptr, d, d_mask, qk_eps, qk_offset, HALF, HAS_QK_OFFSET)
            else:
                x1, x2 = _head_norm(x1, x2, k_w_ptr, d, d_mask, qk_eps, qk_offset, HALF, HAS_QK_OFFSET)
        pos = tl.load(pos_ptr + rows, mask=m_mask, other=0).to(tl.int64)
        cos = tl.load(cos_ptr + pos[:, None] * stride_cos + d[None, :], mask=mask, other=0.0)
        sin = tl.load(sin_ptr + pos[:, None] * stride_cos + d[None, :], mask=mask, other=0.0)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        x1, x2 = (f1 * cos - f2 * sin).to(dt), (f2 * cos + f1 * sin).to(dt)
    if head < NUM_Q_HEADS:
        dst = q_out_ptr + rows.to(tl.int64)[:, None] * stride_qot + head * stride_qoh + d[None, :]
        tl.store(dst, x1, mask=mask)
        tl.store(dst + HALF, x2, mask=mask)
    else:
        slot = tl.load(slot_ptr + rows, mask=m_mask, other=-1).to(tl.int64)
        keep = mask & (slot >= 0)[:, None]
        slot = tl.where(slot >= 0, slot, 0)
        block, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        if head < NUM_Q_HEADS + NUM_KV_HEADS:
            dst = (k_cache_ptr + block[:, None] * stride_kcb + off[:, None] * stride_kcs
                   + (head - NUM_Q_HEADS) * stride_kch + d[None, :])
        else:
            dst = (v_cache_ptr + block[:, None] * stride_vcb + off[:, None] * stride_vcs
                   + (head - NUM_Q_HEADS - NUM_KV_HEADS) * stride_vch + d[None, :])
        ty = k_cache_ptr.dtype.element_ty  # the wrapper checks that both caches share it
        tl.store(dst, x1.to(ty), mask=keep)
        tl.store(dst + HALF, x2.to(ty), mask=keep)


@triton.jit
def _norm_qkv_rope_store_kernel(
        x_ptr, res_ptr, res_out_ptr, nw_ptr, w_ptr, b_ptr,
        pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
        part_ptr, count_ptr,
        M, K, k_per_split, stride_x, stride_r, stride_ro, stride_w, stride_cos, stride_qot, stride_qoh,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        eps, offset, qk_eps, qk_offset,
        NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HAS_RES: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_QK_NORM: tl.constexpr, HAS_QK_OFFSET: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)  # first: see triton_compat (programmatic dependent launch)
    split = tl.program_id(0)  # the K slice: a head's slices are neighbours in launch order
    head = tl.program_id(1)  # q heads, then k heads, then v heads: the projection's column order
    rows = tl.arange(0, BLOCK_M)
    m_mask = rows < M
    d = tl.arange(0, HALF_P)
    d_mask = d < HALF
    # The input norm's row statistics, over all of K in every program (the rows are a few KB, in L2); the first
    # program also writes the residual sum out.
    offs_s = tl.arange(0, BLOCK_S)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_written = tl.where((split == 0) & (head == 0), K, 0)
    for k0 in range(0, K, BLOCK_S):
        kk = k0 + offs_s
        mask = m_mask[:, None] & (kk < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=mask, other=0.0)
        if HAS_RES:
            x = (x + tl.load(res_ptr + rows[:, None] * stride_r + kk[None, :], mask=mask, other=0.0)).to(x.dtype)
            tl.store(res_out_ptr + rows[:, None] * stride_ro + kk[None, :], x, mask=mask & (kk < k_written)[None, :])
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
    rstd = 1.0 / tl.sqrt(ss / K + eps)
    # This program's slice of the head's product, its two halves apart.
    w1_rows = w_ptr + (head * (2 * HALF) + d).to(tl.int64)[:, None] * stride_w
    w2_rows = w1_rows + HALF * stride_w
    offs_k = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros([BLOCK_M, HALF_P, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, HALF_P, BLOCK_K], dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_hi
        w_mask = d_mask[:, None] & k_mask[None, :]
        w1 = tl.load(w1_rows + kk[None, :], mask=w_mask, other=0.0)
        w2 = tl.load(w2_rows + kk[None, :], mask=w_mask, other=0.0)
        a = _input_tile(x_ptr, res_ptr, nw_ptr, rows, kk, m_mask, k_mask, stride_x, stride_r, K, rstd, offset,
                        1, HAS_RES, HAS_OFFSET, False).to(tl.float32)[:, None, :]
        acc1 += a * w1.to(tl.float32)[None, :, :]
        acc2 += a * w2.to(tl.float32)[None, :, :]
    y1 = tl.sum(acc1, axis=2)
    y2 = tl.sum(acc2, axis=2)
    if SPLIT_K == 1:
        _epilogue(y1, y2, head, rows, m_mask, d, d_mask, b_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr,
                  slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_qot, stride_qoh, stride_kcb,
                  stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, qk_eps, qk_offset, NUM_Q_HEADS,
                  NUM_KV_HEADS, HALF, BLOCK_SIZE, HAS_BIAS, HAS_QK_NORM, HAS_QK_OFFSET)
    else:
        # partials: [heads, SPLIT_K, BLOCK_M, 2, HALF_P] float32
        part = part_ptr + head.to(tl.int64) * (SPLIT_K * BLOCK_M * 2 * HALF_P)
        tile = rows[:, None] * (2 * HALF_P) + d[None, :]
        tl.store(part + split * (BLOCK_M * 2 * HALF_P) + tile, y1)
        tl.store(part + split * (BLOCK_M * 2 * HALF_P) + HALF_P + tile, y2)
        tl.debug_barrier()  # every thread's partial is stored before the counter moves
        arrived = tl.atomic_add(count_ptr + head, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last of the head's programs: every other partial is visible
            tl.debug_barrier()
            y1 = tl.zeros([BLOCK_M, HALF_P], dtype=tl.float32)
            y2 = tl.zeros([BLOCK_M, HALF_P], dtype=tl.float32)
            for s in range(SPLIT_K):  # in slice order, whichever program came last
                y1 += tl.load(part + s * (BLOCK_M * 2 * HALF_P) + tile, cache_modifier=".cg")
                y2 += tl.load(part + s * (BLOCK_M * 2 * HALF_P) + HALF_P + tile, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + head, 0)  # ready for the next launch
            _epilogue(y1, y2, head, rows, m_mask, d, d_mask, b_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr,
                      slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_qot, stride_qoh, stride_kcb,
                      stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, qk_eps, qk_offset, NUM_Q_HEADS,
                      NUM_KV_HEADS, HALF, BLOCK_SIZE, HAS_BIAS, HAS_QK_NORM, HAS_QK_OFFSET)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown counters: a captured CUDA graph may still address them


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 zeros on `device`, the same tensor on every call (a CUDA graph captures its address);
    the kernel leaves them zero. Allocated by the first launch, which is eager (it compiles the kernel)."""
    t = _COUNTERS.get(device)
    if t is None or t.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("norm_qkv_rope_store: run it once eagerly before capturing a CUDA graph with it")
        if t is not None:
            _RETIRED.append(t)
        t = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = t
    return t


def takes_rows(x: torch.Tensor, limit: int) -> bool:
    """Whether a layer on the small-M path (small_m_linear.takes_rows(x, limit)) may run this kernel on x."""
    return 0 < x.shape[0] <= min(limit, MAX_ROWS) and use_fused_kernels(x)


def _config(m: int, num_heads: int, half: int, k: int, device: torch.device) -> dict:
    """Tile sizes and the split of K. The two halves' accumulators hold 8192 float32 between them (64 registers a
    thread at 4 warps, as small_m_linear's FMA form), which sets BLOCK_K; K is split until the grid holds about
    two programs per SM, each slice a whole number of BLOCK_K (see `split_k`)."""
    block_m = triton.next_power_of_2(m)
    half_p = triton.next_power_of_2(half)
    block_k = max(16, min(triton.next_power_of_2(k), 8192 // (2 * block_m * half_p)))
    split = split_k(k, triton.cdiv(2 * _num_sms(device), num_heads), block_k)[0]
    return dict(BLOCK_M=block_m, BLOCK_K=block_k, SPLIT_K=split, BLOCK_S=min(triton.next_power_of_2(k), 1024),
                num_warps=4)


def split_k(k: int, split: int, block_k: int) -> tuple[int, int]:
    """(the split of K a launch makes, K per slice) when asked for `split` slices: slices of whole BLOCK_K tiles,
    none left empty, so the split made may be smaller than the one asked for."""
    per_slice = triton.cdiv(triton.cdiv(k, max(1, split)), block_k) * block_k
    return triton.cdiv(k, per_slice), per_slice


def norm_qkv_rope_store(x: torch.Tensor,  # [rows, hidden], rows <= MAX_ROWS
                        residual: torch.Tensor | None,  # [rows, hidden] or None
                        norm_weight: torch.Tensor,  # [hidden]: the input norm
                        eps: float, offset: float,
                        weight: torch.Tensor,  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
                        bias: torch.Tensor | None,  # [(num_heads + 2 * num_kv_heads) * head_dim]
                        num_heads: int, num_kv_heads: int,
                        positions: torch.Tensor,  # [rows] int64
                        cos: torch.Tensor,  # [max_positions, head_dim / 2] float32
                        sin: torch.Tensor,  # [max_positions, head_dim / 2] float32
                        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
                        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
                        slot_mapping: torch.Tensor,  # [rows] int32/int64; < 0: padding, not stored
                        q_norm_weight: torch.Tensor | None = None,  # [head_dim]; with k_norm_weight or neither
                        k_norm_weight: torch.Tensor | None = None,  # [head_dim]
                        qk_eps: float = 1e-6, qk_offset: float = 0.0,
                        config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """small_m_linear.norm_linear into the qkv projection, then qk_norm_rope_store, in one launch: returns (q
    [rows, num_heads, head_dim], a new contiguous tensor; x + residual, x itself when residual is None), keys and
    values stored by slot. `config` overrides _config's choices (the benchmark's sweep)."""
    require_triton("norm_qkv_rope_store", *(t for t in (x, residual, norm_weight, weight, bias, positions, cos, sin,
                                                         key_cache, value_cache, slot_mapping, q_norm_weight,
                                                         k_norm_weight) if t is not None))
    m, hidden = x.shape if x.dim() == 2 else (0, 0)
    width = weight.shape[0] if weight.dim() == 2 else 0
    if x.dim() != 2 or x.stride(-1) != 1 or weight.dim() != 2 or weight.stride(-1) != 1 or weight.shape[1] != hidden:
        raise ValueError(f"x [rows, hidden] and weight [width, hidden] must be contiguous in their last dimension, "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"norm_qkv_rope_store takes 1 to {MAX_ROWS} rows, got {m}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight dtypes differ: {x.dtype} and {weight.dtype}")
    for t, shape in ((residual, (m, hidden)), (bias, (width,)), (norm_weight, (hidden,))):
        if t is not None and (tuple(t.shape) != shape or t.stride(-1) != 1):
            raise ValueError(f"expected a tensor of shape {shape}, contiguous in its last dimension, got "
                             f"{tuple(t.shape)}")
    qkv_shape = torch.empty(m, width, device="meta")  # the unfused prologue's input, for its checks
    _, head_dim = _check_prologue_args(qkv_shape, num_heads, num_kv_heads, positions, cos, sin, key_cache,
                                       value_cache, slot_mapping, q_norm_weight, k_norm_weight)
    half = head_dim // 2
    heads = num_heads + 2 * num_kv_heads
    cfg = {**_config(m, heads, half, hidden, x.device), **(config or {})}
    cfg["SPLIT_K"], k_per_split = split_k(hidden, cfg["SPLIT_K"], cfg["BLOCK_K"])
    split = cfg["SPLIT_K"]
    half_p = triton.next_power_of_2(half)
    if cfg["BLOCK_M"] < m or cfg["BLOCK_M"] & (cfg["BLOCK_M"] - 1):
        raise ValueError(f"BLOCK_M must be a power of two >= rows, got {cfg['BLOCK_M']}")
    q_out = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    res_out = torch.empty(m, hidden, dtype=x.dtype, device=x.device) if residual is not None else None
    if split > 1:
        partials = torch.empty(heads * split * cfg["BLOCK_M"] * 2 * half_p, dtype=torch.float32, device=x.device)
        counters = _counters(x.device, heads)
    else:
        partials = counters = q_out  # not read
    has_norm = q_norm_weight is not None
    launch(_norm_qkv_rope_store_kernel, (split, heads), x.device,
           x, residual if residual is not None else x, res_out if res_out is not None else q_out, norm_weight,
           weight, bias if bias is not None else weight,
           positions, cos, sin, q_norm_weight if has_norm else x, k_norm_weight if has_norm else x, slot_mapping,
           q_out, key_cache, value_cache, partials, counters,
           m, hidden, k_per_split, x.stride(0), residual.stride(0) if residual is not None else 0,
           res_out.stride(0) if res_out is not None else 0, weight.stride(0), cos.stride(0), q_out.stride(0),
           q_out.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
           value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
           eps, offset, qk_eps, qk_offset,
           NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, HALF_P=half_p,
           BLOCK_SIZE=key_cache.shape[1], HAS_RES=residual is not None, HAS_OFFSET=bool(offset),
           HAS_BIAS=bias is not None, HAS_QK_NORM=has_norm, HAS_QK_OFFSET=bool(qk_offset), **cfg)
    return q_out, (res_out if res_out is not None else x)


def norm_qkv_rope_store_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                            offset: float, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                            num_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                            qk_eps: float = 1e-6, qk_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `norm_qkv_rope_store` (same arguments, no config): the unfused pair's references,
    norm_linear_ref then qk_norm_rope_store_ref."""
    qkv, s = norm_linear_ref(x, residual, norm_weight, eps, offset, weight, bias)
    q = qk_norm_rope_store_ref(qkv, num_heads, num_kv_heads, positions, cos, sin, key_cache, value_cache,
                               slot_mapping, q_norm_weight, k_norm_weight, qk_eps, qk_offset)
    return q, s
