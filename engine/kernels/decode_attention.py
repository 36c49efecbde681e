"""A decode step's attention in one kernel: attention's prologue (q/k RMSNorm, rotary embedding, KV store) and
split-KV paged attention with its combine (Triton kernel + typed wrapper + torch reference).

At one query token per request a layer's attention is otherwise three launches: the prologue
(qk_norm_rope_store.py), paged attention split over the keys (flash-decoding, paged_attention.py) and the small
kernel that combines the splits. Each moves a few hundred kilobytes; measured on an H100 their launch, ramp-up and
tail cost are most of their time, about 14 us a layer of the 0.6B draft's 1.2 ms step. Here:
- every program takes one request's KV head and one share of its keys, and computes the q heads of that KV head
  (norm, rotation) from the projection's output itself: a few hundred bytes, recomputed by every split;
- the program whose share holds the new token's position computes the new key and value, stores them in the
  cache, and passes a CTA barrier before it reads them back as part of its last tile; no other program reads that
  position, so no launch-wide ordering is needed;
- each program writes its unnormalised partial result, then takes a ticket from a per-(request, KV head) counter;
  the program with the last ticket combines every split's partial (flash-decoding's second pass) and sets the
  counter back to zero for the next launch.

The arithmetic is that of the unfused kernels: the same norm and rotation roundings, keys and values cast to the
cache's dtype, an online softmax in float32 and exp2 with the scale folded into log2(e). q @ k^T is taken as two
products over the halves of the head dimension (the halves that the rotation produces), which only changes the
order of float32 additions.

Only for steps whose every request has at most one query token (max_query_len == 1, a host-side bound): decode
steps of a target, every draft step after the first of a draft loop. Other steps take the unfused kernels.
"""

from __future__ import annotations

import math

import torch

from engine.kernels.paged_attention import (
    MAX_AUTO_SPLITS,
    _combine_splits_kernel,
    _tile_n,
    kernel_variant,
    paged_attention_ref,
)
from engine.kernels.qk_norm_rope_store import _norm_half, qk_norm_rope_store_ref
from engine.kernels.triton_compat import launch, require_triton, tl, triton, wait_for_previous_kernel

__all__ = ["decode_attention", "decode_attention_ref", "decode_fusion_enabled", "set_decode_fusion"]

_FUSION = {"enabled": True}


def set_decode_fusion(enabled: bool) -> None:
    """Take the fused decode kernel for one-token steps (the default), or the three unfused kernels (to compare)."""
    _FUSION["enabled"] = enabled


def decode_fusion_enabled() -> bool:
    return _FUSION["enabled"]


@triton.jit
def _norm_rows(x1, x2, w_ptr, d, dmask, eps, offset, HALF: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """RMSNorm of each row of [rows, HALF_P] halves, as _norm_half does for one head; rounded to the input dtype."""
    dt = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)  # [rows]
    w1 = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if HAS_OFFSET:
        y1, y2 = f1 * rstd[:, None] * (offset + w1), f2 * rstd[:, None] * (offset + w2)
    else:
        y1 = (f1 * rstd[:, None]).to(dt).to(tl.float32) * w1
        y2 = (f2 * rstd[:, None]).to(dt).to(tl.float32) * w2
    return y1.to(dt), y2.to(dt)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_attention_kernel(
        qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, o_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
        partial_ptr, partial_ml_ptr, counter_ptr,  # split-KV workspace and tickets (read only when SPLIT)
        num_splits,  # programs sharing one request's keys (1 unless SPLIT)
        scale_log2,  # softmax scale * log2(e): the kernel uses exp2
        window,  # sliding window W (read only when HAS_WINDOW)
        eps, offset,  # the q/k norms' epsilon and weight offset (Gemma: 1)
        stride_t, stride_cos, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PER_KV: tl.constexpr,
        HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, SPLITS_P: tl.constexpr, HAS_NORM: tl.constexpr, HAS_OFFSET: tl.constexpr,
        HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, TICKETS: tl.constexpr,
        USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)  # first: see triton_compat (programmatic dependent launch)
    req = tl.program_id(0)
    kv_head = tl.program_id(1) // num_splits
    split = tl.program_id(1) % num_splits

    q_start = tl.load(query_start_loc_ptr + req).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + req + 1).to(tl.int32) - q_start
    # Requests with no token are padding of a CUDA graph's batch: every program of theirs returns here, so none
    # takes a ticket either.
    if q_len > 0:
        tok = q_start.to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
        q_pos = seq_len - 1  # the one query token's position; keys at positions <= it are visible
        dt = qkv_ptr.dtype.element_ty
        d = tl.arange(0, HALF_P)  # [HALF_P]
        dmask = d < HALF
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + d, mask=dmask, other=0.0)  # [HALF_P] fp32
        sin = tl.load(sin_ptr + pos * stride_cos + d, mask=dmask, other=0.0)

        # The q heads of this KV head, as rows (padded to BLOCK_M, the 16-row minimum of tl.dot), in two halves.
        r = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        row_valid = r < HEADS_PER_KV
        head = kv_head * HEADS_PER_KV + r  # [BLOCK_M] query head
        qmask = row_valid[:, None] & dmask[None, :]
        q_src = qkv_ptr + tok * stride_t + head[:, None] * (2 * HALF) + d[None, :]
        q1 = tl.load(q_src, mask=qmask, other=0.0)  # [BLOCK_M, HALF_P]
        q2 = tl.load(q_src + HALF, mask=qmask, other=0.0)
        if HAS_NORM:
            q1, q2 = _norm_rows(q1, q2, q_w_ptr, d, dmask, eps, offset, HALF, HAS_OFFSET)
        f1, f2 = q1.to(tl.float32), q2.to(tl.float32)
        q1 = (f1 * cos[None, :] - f2 * sin[None, :]).to(dt).to(k_cache_ptr.dtype.element_ty)
        q2 = (f2 * cos[None, :] + f1 * sin[None, :]).to(dt).to(k_cache_ptr.dtype.element_ty)

        kv_end = seq_len
        kv_start = 0
        if HAS_WINDOW:
            kv_start = tl.maximum(q_pos - window + 1, 0)
        tile_lo = kv_start // TILE_N
        tile_hi = tl.cdiv(kv_end, TILE_N)
        last_tile = tile_hi - 1  # holds the new token's position
        if SPLIT:
            per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
            tile_lo = tile_lo + split * per_split
            tile_hi = tl.minimum(tile_hi, tile_lo + per_split)

        k_head = k_cache_ptr + kv_head * stride_kh
        v_head = v_cache_ptr + kv_head * stride_vh
        if (last_tile >= tile_lo) & (last_tile < tile_hi):
            # This program's share holds the new position: store the new key and value (a negative slot is a
            # padding token: nothing is stored).
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            if slot >= 0:
                k_src = qkv_ptr + tok * stride_t + (NUM_Q_HEADS + kv_head) * (2 * HALF)
                k1 = tl.load(k_src + d, mask=dmask, other=0.0)
                k2 = tl.load(k_src + HALF + d, mask=dmask, other=0.0)
                if HAS_NORM:
                    k1, k2 = _norm_half(k1, k2, k_w_ptr, d, dmask, eps, offset, HALF, HAS_OFFSET)
                g1, g2 = k1.to(tl.float32), k2.to(tl.float32)
                k1, k2 = (g1 * cos - g2 * sin).to(dt), (g2 * cos + g1 * sin).to(dt)
                v_src = qkv_ptr + tok * stride_t + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * (2 * HALF)
                v1 = tl.load(v_src + d, mask=dmask, other=0.0)
                v2 = tl.load(v_src + HALF + d, mask=dmask, other=0.0)
                block, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
                ty = k_cache_ptr.dtype.element_ty  # the wrapper checks that both caches share it
                k_dst = k_head + block * stride_kb + off * stride_ks
                v_dst = v_head + block * stride_vb + off * stride_vs
                tl.store(k_dst + d, k1.to(ty), mask=dmask)
                tl.store(k_dst + HALF + d, k2.to(ty), mask=dmask)
                tl.store(v_dst + d, v1.to(ty), mask=dmask)
                tl.store(v_dst + HALF + d, v2.to(ty), mask=dmask)
        # The tile loop below reads the new key and value back, loaded by other threads of this program.
        tl.debug_barrier()

        # Running max (log2 domain) starts finite, as in paged_attention: fully masked tiles add exactly nothing.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # [BLOCK_M]
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M] running sum of exp2
        dim = tl.arange(0, 2 * HALF_P)  # [2 * HALF_P] for values, loaded whole
        dim_valid = (dim % HALF_P) < HALF
        dim_off = (dim // HALF_P) * HALF + dim % HALF_P  # a padded head keeps its halves HALF_P apart
        acc = tl.zeros([BLOCK_M, 2 * HALF_P], dtype=tl.float32)
        block_row = block_table_ptr + req.to(tl.int64) * stride_bt
        for tile in range(tile_lo, tile_hi):
            k_pos = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
            # Keys before a window's start are masked too: their blocks may have been released (null).
            k_valid = (k_pos >= kv_start) & (k_pos < kv_end)
            block = tl.load(block_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)  # [TILE_N]
            offset_in = k_pos % BLOCK_SIZE
            k_rows = k_head + block[:, None] * stride_kb + offset_in[:, None] * stride_ks
            kmask = k_valid[:, None] & dmask[None, :]
            k1 = tl.load(k_rows + d[None, :], mask=kmask, other=0.0)  # [TILE_N, HALF_P]
            k2 = tl.load(k_rows + HALF + d[None, :], mask=kmask, other=0.0)
            s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N] fp32
            s = (s + tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION)) * scale_log2
            visible = (k_valid & (k_pos <= q_pos))[None, :] & row_valid[:, None]
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
            alpha = tl.exp2(m_i - m_new)  # [BLOCK_M]
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, TILE_N]
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_head + block[:, None] * stride_vb + offset_in[:, None] * stride_vs + dim_off[None, :],
                        mask=k_valid[:, None] & dim_valid[None, :], other=0.0)  # [TILE_N, 2 * HALF_P]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        o_rows = o_ptr + tok * stride_ot + head[:, None] * stride_oh + dim_off[None, :]
        if not SPLIT:
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(o_rows, acc.to(o_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
        else:
            # Unnormalised partial results; a split that saw no key writes m = floor, l = 0, acc = 0.
            ws = (tok * NUM_Q_HEADS + head) * num_splits + split  # [BLOCK_M] workspace row
            tl.store(partial_ptr + ws[:, None] * (2 * HALF_P) + dim[None, :], acc, mask=row_valid[:, None])
            tl.store(partial_ml_ptr + ws * 2, m_i, mask=row_valid)
            tl.store(partial_ml_ptr + ws * 2 + 1, l_i, mask=row_valid)
        if SPLIT and TICKETS:
            # Every thread's partial is written before the ticket is taken (the release covers what the barrier
            # ordered); the last program's loads bypass L1, which may hold nothing of other SMs' writes.
            tl.debug_barrier()
            counter = counter_ptr + req * NUM_KV_HEADS + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel")
            if ticket == num_splits - 1:
                splits = tl.arange(0, SPLITS_P)  # [SPLITS_P]
                live = splits < num_splits
                for h in tl.static_range(HEADS_PER_KV):
                    q_head = kv_head * HEADS_PER_KV + h
                    rows = (tok * NUM_Q_HEADS + q_head) * num_splits + splits  # [SPLITS_P]
                    # Lanes past num_splits weigh exp2(floor - max) = 0 and add nothing.
                    m = tl.load(partial_ml_ptr + rows * 2, mask=live, other=-1.0e30, cache_modifier=".cg")
                    weight = tl.exp2(m - tl.max(m, 0))  # [SPLITS_P]
                    l_s = tl.load(partial_ml_ptr + rows * 2 + 1, mask=live, other=0.0, cache_modifier=".cg")
                    denom = tl.sum(weight * l_s, 0)
                    part = tl.load(partial_ptr + rows[:, None] * (2 * HALF_P) + dim[None, :], mask=live[:, None],
                                   other=0.0, cache_modifier=".cg")  # [SPLITS_P, 2 * HALF_P]
                    out = tl.sum(part * weight[:, None], 0) / denom  # [2 * HALF_P]
                    tl.store(o_ptr + tok * stride_ot + q_head * stride_oh + dim_off, out.to(o_ptr.dtype.element_ty),
                             mask=dim_valid)
                tl.atomic_xchg(counter, 0)  # ready for the next launch (every ticket of this one is taken)


def decode_attention(qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
                     num_heads: int, num_kv_heads: int,
                     positions: torch.Tensor,  # [num_tokens] int64
                     cos: torch.Tensor,  # [max_positions, head_dim / 2] float32
                     sin: torch.Tensor,  # [max_positions, head_dim / 2] float32
                     key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
                     value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
                     slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; < 0: padding, not stored
                     out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; written for valid tokens only
                     query_start_loc: torch.Tensor,  # [num_reqs + 1] int32; every request has at most 1 token
                     seq_lens: torch.Tensor,  # [num_reqs] int32; KV length including this step's token
                     block_table: torch.Tensor,  # [num_reqs, max_blocks] int32; 0 = null block
                     scale: float,
                     sliding_window: int | None,
                     split_counters: torch.Tensor,  # [>= num_reqs * num_kv_heads] int32, zero; left zero
                     q_norm_weight: torch.Tensor | None = None,  # [head_dim]; with k_norm_weight or neither
                     k_norm_weight: torch.Tensor | None = None,  # [head_dim]
                     eps: float = 1e-6, norm_offset: float = 0.0,
                     *, num_kv_splits: int | None = None, tile_n: int | None = None,
                     num_warps: int | None = None, tickets: bool | None = None) -> None:
    """Norm and rotate q and k, store k and v by slot, and attend: what qk_norm_rope_store followed by
    paged_attention do for a step of at most one query token per request, in one launch.

    The caller guarantees that no request has more than one query token (the grid has one program row per
    request); it cannot be checked without reading device data. `split_counters` must be zero on entry and is
    zero again when the kernel completes; launches that may overlap (other streams) need counters of their own.
    num_kv_splits: as paged_attention's (None: chosen from host-side shapes). tile_n (keys per loop iteration, a
    power of two >= 16) and num_warps override the defaults, for tuning (benchmarks/gpu_decode_attention.py).
    """
    require_triton("decode_attention", qkv, positions, cos, sin, key_cache, value_cache, slot_mapping, out,
                   query_start_loc, seq_lens, block_table, split_counters)
    n, head_dim = _check_args(qkv, num_heads, num_kv_heads, positions, cos, sin, key_cache, value_cache,
                              slot_mapping, out, query_start_loc, seq_lens, block_table, sliding_window,
                              split_counters, q_norm_weight, k_norm_weight)
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or n == 0:
        return
    if num_kv_splits is not None and (num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1)):
        raise ValueError(f"num_kv_splits must be a power of two >= 1, got {num_kv_splits}")
    heads_per_kv = num_heads // num_kv_heads
    half = head_dim // 2
    half_p = max(16, triton.next_power_of_2(half))  # tl.dot's inner dimension is at least 16 (zero-padded)
    block_size = key_cache.shape[1]
    # The splits' combine: in this kernel by the program with the last ticket, or as paged_attention's second
    # kernel (which needs the same workspace layout: a power-of-two head_dim).
    separate = half == half_p and not tickets
    if tile_n is not None and (tile_n < 16 or tile_n & (tile_n - 1)):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
    tile_n = tile_n or _tile_n(head_dim)
    block_m, _, splits = kernel_variant(num_reqs, 1, heads_per_kv, num_kv_heads, head_dim,
                                        block_table.shape[1] * block_size, qkv.device, num_kv_splits)
    partial = partial_ml = out  # never read with one split
    if splits > 1:
        partial = torch.empty(n, num_heads, splits, 2 * half_p, dtype=torch.float32, device=out.device)
        partial_ml = torch.empty(n, num_heads, splits, 2, dtype=torch.float32, device=out.device)
    has_norm = q_norm_weight is not None
    launch(
        _decode_attention_kernel, (num_reqs, num_kv_heads * splits), qkv.device,
        qkv, positions, cos, sin, q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,
        slot_mapping, key_cache, value_cache, out, query_start_loc, seq_lens, block_table,
        partial, partial_ml, split_counters, splits, scale * math.log2(math.e), sliding_window or 0, eps, norm_offset,
        qkv.stride(0), cos.stride(0), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_table.stride(0),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PER_KV=heads_per_kv, HALF=half, HALF_P=half_p,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, TILE_N=tile_n, SPLITS_P=max(MAX_AUTO_SPLITS, splits),
        HAS_NORM=has_norm, HAS_OFFSET=bool(norm_offset), HAS_WINDOW=sliding_window is not None,
        # fp32 caches: full-precision products (tl.dot would use TF32 on tensor cores otherwise).
        DOT_PRECISION="ieee" if key_cache.dtype == torch.float32 else "tf32", SPLIT=splits > 1,
        TICKETS=not separate, num_warps=num_warps or (4 if block_m * 2 * half_p <= 64 * 128 else 8))
    if splits > 1 and separate:
        launch(
            _combine_splits_kernel, (n, num_heads), qkv.device,
            out, partial, partial_ml, query_start_loc, num_reqs, num_heads, splits, *out.stride(),
            HEAD_DIM=head_dim, HEAD_DIM_P=2 * half_p, SPLITS_P=max(MAX_AUTO_SPLITS, splits),
            num_warps=1 if head_dim <= 128 else 2)


def decode_attention_ref(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, sliding_window: int | None,
                         split_counters: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                         k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                         norm_offset: float = 0.0) -> None:
    """Plain-torch reference of `decode_attention` (same arguments; the counters are only checked): the unfused
    kernels' references, one after the other. Syncs with the host; for tests and CPU only."""
    _check_args(qkv, num_heads, num_kv_heads, positions, cos, sin, key_cache, value_cache, slot_mapping, out,
                query_start_loc, seq_lens, block_table, sliding_window, split_counters, q_norm_weight, k_norm_weight)
    q = qk_norm_rope_store_ref(qkv, num_heads, num_kv_heads, positions, cos, sin, key_cache, value_cache,
                               slot_mapping, q_norm_weight, k_norm_weight, eps, norm_offset)
    paged_attention_ref(q, key_cache, value_cache, out, query_start_loc, seq_lens, block_table, scale,
                        sliding_window, 1)


def _check_args(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                out: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                block_table: torch.Tensor, sliding_window: int | None, split_counters: torch.Tensor,
                q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None) -> tuple[int, int]:
    """Shape checks only (no device data is read). Returns (num_tokens, head_dim)."""
    from engine.kernels.paged_attention import _check_args as check_attention
    from engine.kernels.qk_norm_rope_store import _check_args as check_prologue

    n, head_dim = check_prologue(qkv, num_heads, num_kv_heads, positions, cos, sin, key_cache, value_cache,
                                 slot_mapping, q_norm_weight, k_norm_weight)
    if tuple(out.shape) != (n, num_heads, head_dim):
        raise ValueError(f"out must be [{n}, {num_heads}, {head_dim}], got {tuple(out.shape)}")
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous in head_dim")
    check_attention(out, key_cache, value_cache, out, query_start_loc, seq_lens, block_table, sliding_window, 1)
    if split_counters.dtype != torch.int32 or split_counters.dim() != 1:
        raise ValueError(f"split_counters must be a 1-D int32 tensor, got {split_counters.dtype} "
                         f"{tuple(split_counters.shape)}")
    if split_counters.numel() < seq_lens.shape[0] * num_kv_heads:
        raise ValueError(f"split_counters holds {split_counters.numel()} counters; {seq_lens.shape[0]} requests x "
                         f"{num_kv_heads} KV heads need {seq_lens.shape[0] * num_kv_heads}")
    return n, head_dim
