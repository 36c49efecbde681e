"""Paged attention over the KV cache: one Triton kernel for prefill, chunked prefill, decode and verify.

Request i owns query tokens query_start_loc[i]:query_start_loc[i+1]; its token t sits at position
seq_lens[i] - q_len_i + t and attends to the keys at positions <= its own (causal), and with a sliding
window W only to those at positions > its position - W. Keys live in fixed-size blocks named by the
request's row of the block table.

Layout of the work (grid = (M blocks, requests, KV heads)): a program takes one KV head of one request and
BLOCK_M rows of that request's (query token x query head of this KV head) pairs, row r being token
r // heads_per_kv and head r % heads_per_kv. Folding the grouped query heads into the rows of tl.dot loads
each K/V tile once for all the heads that share it, and lets a decode step (1 token x 4-8 heads) fill the
16-row minimum of tl.dot. Keys are visited in tiles of TILE_N positions with an online softmax (fp32
running max, sum and accumulator, as in FlashAttention-2); each key's block id is looked up per position,
so tiles may span several cache blocks.

The grid depends only on host ints (number of requests, max_query_len, KV heads, and the splits chosen from
them): inside a CUDA graph the per-request lengths change between replays, so every loop bound is read from
device memory. Small decode / verify batches would leave most SMs idle (batch 1 of an 8-KV-head model: 8
programs), so their keys are split over several programs (flash-decoding) whose partial results a small
second kernel combines; measured on an H100 (bf16, 32q/8kv heads, d128, 1024 keys, in a CUDA graph): batch 1
22.4 -> 6.2 us, batch 8 25.4 -> 12.8 us (1.13x the KV-read floor), batch 32 51 us unsplit (1.12x). The split count is
fixed by the grid (sized for the longest context); each request uses as many splits as its key tiles fill and the
combine reads only those, so a grid wide enough for 32k tokens costs a short request little.

Attention sinks (GPT-OSS; optional): one logit per query head, in the softmax's units, that joins each row's
denominator and attends to no value. It is added once a row's running max is final: to l_i at the end of an unsplit
program, or to the combined denominator in the combine kernel (never in each split, which would count it once a
split).
"""

from __future__ import annotations

import math

import torch

from engine.kernels.attention.args import check_launch, check_query_and_cache, check_sinks, check_sliding_window
from engine.kernels.attention.launch import kernel_variant
from engine.kernels.triton_compat import HAS_TRITON, launch, require_triton, tl, triton, wait_for_previous_kernel

__all__ = ["HAS_TRITON", "paged_attention", "paged_attention_ref"]


# A value that changes from step to step must not pick a compiled variant (Triton specializes an int argument on
# being 1 or a multiple of 16): a new variant compiles inside a serving step, for a second or more.
@triton.jit(do_not_specialize=["num_splits"])
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
        partial_ptr, partial_ml_ptr, partial_live_ptr,  # split-KV workspace (read only when SPLIT)
        sinks_ptr,  # [num_heads] float32 sink logits (read only when HAS_SINKS and not SPLIT)
        num_heads,
        num_splits,  # programs sharing one request's keys (1 unless SPLIT)
        scale_log2,  # softmax scale * log2(e): the kernel uses exp2
        window,  # sliding window W (read only when HAS_WINDOW)
        stride_qt, stride_qh, stride_qd,
        stride_ot, stride_oh, stride_od,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, HEADS_PER_KV: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
        HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr,
        USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)  # first: see triton_compat (programmatic dependent launch)
    m_block = tl.program_id(0)
    req = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(query_start_loc_ptr + req).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + req + 1).to(tl.int32) - q_start
    first_row = m_block * BLOCK_M
    # Also skips requests with q_len 0 (padding of a CUDA graph's batch).
    if first_row < q_len * HEADS_PER_KV:
        seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
        context_len = seq_len - q_len  # keys stored before this step's tokens

        rows = first_row + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        tok = rows // HEADS_PER_KV  # [BLOCK_M] query token within the request
        head = kv_head * HEADS_PER_KV + rows % HEADS_PER_KV  # [BLOCK_M] query head
        row_valid = tok < q_len  # [BLOCK_M]
        q_pos = context_len + tok  # [BLOCK_M]
        dim = tl.arange(0, HEAD_DIM_P)  # [HEAD_DIM_P]
        dim_valid = dim < HEAD_DIM

        q_rows = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dim[None, :] * stride_qd,
                    mask=row_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_P]
        q = q.to(k_ptr.dtype.element_ty)

        # Key range of this program's rows: up to the last valid row's position, and with a window from
        # the first row's window start; tiles entirely outside it are never loaded.
        last_tok = tl.minimum(first_row + BLOCK_M, q_len * HEADS_PER_KV) - 1
        kv_end = context_len + last_tok // HEADS_PER_KV + 1
        kv_start = 0
        if HAS_WINDOW:
            kv_start = tl.maximum(context_len + first_row // HEADS_PER_KV - window + 1, 0)
        tile_lo = kv_start // TILE_N
        tile_hi = tl.cdiv(kv_end, TILE_N)
        if SPLIT:
            # Flash-decoding: this program takes one contiguous share of the tiles. The split count is the grid's,
            # sized for the longest context the graph may see; a shorter context has fewer shares (`live` splits)
            # and the programs past them load no key and write nothing: the combine reads the live ones alone.
            per_split = tl.maximum(tl.cdiv(tile_hi - tile_lo, num_splits), 1)
            live = tl.cdiv(tile_hi - tile_lo, per_split)
            if split == 0:
                tl.store(partial_live_ptr + q_rows * num_heads + head, live.to(tl.int32), mask=row_valid)
            # [BLOCK_M] bool, the same for every row: past the live splits a share is empty (tile_lo >= tile_hi).
            go = tl.full([BLOCK_M], split, dtype=tl.int32) < live
            tile_lo = tile_lo + split * per_split
            tile_hi = tl.minimum(tile_hi, tile_lo + per_split)

        # Running max (log2 domain) starts finite: a row whose keys in a tile are all masked then gets
        # exp2(-inf - floor) = 0 and a rescale of exp2(0) = 1, not the NaN of (-inf) - (-inf).
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # [BLOCK_M]
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M] running sum of exp2
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
        block_row = block_table_ptr + req.to(tl.int64) * stride_bt
        k_head = k_ptr + kv_head * stride_kh
        v_head = v_ptr + kv_head * stride_vh
        for tile in range(tile_lo, tile_hi):
            k_pos = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
            # Keys before the window start are masked too, not only whole tiles: their blocks may have been
            # released (null) in a sliding-window group.
            k_valid = (k_pos >= kv_start) & (k_pos < kv_end)
            block = tl.load(block_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)  # [TILE_N]
            offset = k_pos % BLOCK_SIZE
            kv_mask = k_valid[:, None] & dim_valid[None, :]
            k = tl.load(k_head + block[:, None] * stride_kb + offset[:, None] * stride_ks + dim[None, :] * stride_kd,
                        mask=kv_mask, other=0.0)  # [TILE_N, HEAD_DIM_P]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N] fp32
            visible = (k_pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
            if HAS_WINDOW:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
            alpha = tl.exp2(m_i - m_new)  # [BLOCK_M] rescale of what was accumulated so far
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, TILE_N]
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_head + block[:, None] * stride_vb + offset[:, None] * stride_vs + dim[None, :] * stride_vd,
                        mask=kv_mask, other=0.0)  # [TILE_N, HEAD_DIM_P]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        if not SPLIT:
            if HAS_SINKS:  # the sink's exp against the row's final max (log2 domain, as m_i)
                sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
                # Capped at 2^126 (no inf from the rows past q_len, whose max is -1e30): a sink that large leaves the
                # row ~0 either way, as its keys add at least 1 to l_i.
                l_i += tl.where(row_valid, tl.exp2(tl.minimum(sink - m_i, 126.0)), 0.0)
            # Rows past q_len saw no key (l_i = 0); they are not stored, the guard only avoids 0 / 0.
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dim[None, :] * stride_od,
                     acc.to(o_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
        else:
            # Unnormalised partial results of a live split (each sees at least one tile).
            slot = (q_rows * num_heads + head) * num_splits + split  # [BLOCK_M] workspace row
            stored = row_valid & go
            tl.store(partial_ptr + slot[:, None] * HEAD_DIM_P + dim[None, :], acc, mask=stored[:, None])
            tl.store(partial_ml_ptr + slot * 2, m_i, mask=stored)
            tl.store(partial_ml_ptr + slot * 2 + 1, l_i, mask=stored)


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _combine_splits_kernel(
        o_ptr, partial_ptr, partial_ml_ptr, partial_live_ptr, query_start_loc_ptr, sinks_ptr, num_reqs, num_heads,
        num_splits,
        stride_ot, stride_oh, stride_od,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, SPLIT_CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr,
        USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)  # first: see triton_compat (programmatic dependent launch)
    token = tl.program_id(0)
    head = tl.program_id(1)
    # Tokens past the last request's are graph padding: their workspace rows were never written.
    if token < tl.load(query_start_loc_ptr + num_reqs):
        row = token.to(tl.int64) * num_heads + head
        live = tl.load(partial_live_ptr + row)  # splits that wrote a partial result for this (token, head)
        first = row * num_splits
        lanes = tl.arange(0, SPLIT_CHUNK)  # [SPLIT_CHUNK]
        dim = tl.arange(0, HEAD_DIM_P)  # [HEAD_DIM_P]
        # The first SPLIT_CHUNK splits are loaded without waiting for `live` (every lane below num_splits exists in
        # the workspace), and lanes past it, stale or never written, are dropped after the load: a short request
        # combines in one round trip, as before splits could outnumber its tiles.
        exists = lanes < num_splits  # [SPLIT_CHUNK]
        slot = first + lanes  # [SPLIT_CHUNK]
        m = tl.load(partial_ml_ptr + slot * 2, mask=exists, other=-1.0e30)  # [SPLIT_CHUNK] log2-domain maxima
        l_sum = tl.load(partial_ml_ptr + slot * 2 + 1, mask=exists, other=0.0)  # [SPLIT_CHUNK]
        part = tl.load(partial_ptr + slot[:, None] * HEAD_DIM_P + dim[None, :], mask=exists[:, None],
                       other=0.0)  # [SPLIT_CHUNK, HEAD_DIM_P]
        ok = lanes < live
        m = tl.where(ok, m, -1.0e30)
        m_run = tl.max(m, 0)
        weight = tl.exp2(m - m_run)  # [SPLIT_CHUNK]; 0 past live
        denom = tl.sum(weight * tl.where(ok, l_sum, 0.0), 0)
        acc = tl.sum(tl.where(ok[:, None], part, 0.0) * weight[:, None], 0)  # [HEAD_DIM_P]; garbage past live dropped
        # A wide grid's long request: the further splits SPLIT_CHUNK at a time, rescaled online.
        for c in range(SPLIT_CHUNK, live, SPLIT_CHUNK):
            ok = c + lanes < live
            slot = first + c + lanes
            m = tl.load(partial_ml_ptr + slot * 2, mask=ok, other=-1.0e30)
            m_new = tl.maximum(m_run, tl.max(m, 0))
            rescale = tl.exp2(m_run - m_new)
            weight = tl.exp2(m - m_new)
            denom = denom * rescale + tl.sum(weight * tl.load(partial_ml_ptr + slot * 2 + 1, mask=ok, other=0.0), 0)
            part = tl.load(partial_ptr + slot[:, None] * HEAD_DIM_P + dim[None, :], mask=ok[:, None], other=0.0)
            acc = acc * rescale + tl.sum(part * weight[:, None], 0)
            m_run = m_new
        if HAS_SINKS:  # once, against the combined max (log2 domain)
            denom += tl.exp2(tl.minimum(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m_run, 126.0))
        tl.store(o_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dim * stride_od,
                 (acc / denom).to(o_ptr.dtype.element_ty), mask=dim < HEAD_DIM)


def paged_attention(query: torch.Tensor,  # [num_tokens, num_heads, head_dim] bf16/fp16/fp32
                    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
                    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
                    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written for valid tokens only
                    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32 (or int64)
                    seq_lens: torch.Tensor,  # [num_reqs] int32 (or int64); KV length including this step
                    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32 (or int64); 0 = null block
                    scale: float,
                    sliding_window: int | None,
                    max_query_len: int,
                    *,
                    num_kv_splits: int | None = None,
                    sinks: torch.Tensor | None = None) -> None:  # [num_heads] float sink logits, or None
    """Attention of every request's query tokens over its paged keys and values, written into `out`.

    `max_query_len` is a host-side upper bound of every request's query length; it sizes the grid, which
    never depends on device data (safe to capture in a CUDA graph). Tokens past query_start_loc[num_reqs]
    (graph padding) are left untouched.

    num_kv_splits: how many programs share one request's keys (flash-decoding), a power of two; None picks
    one from the host-side shapes and the GPU's SM count: small decode / verify batches split their keys so
    that the GPU has enough programs to reach its memory bandwidth, larger ones do not (1).

    sinks: one logit per query head joining each row's softmax denominator (GPT-OSS); None: no sink.
    """
    require_triton("paged_attention", query, key_cache, value_cache, out, query_start_loc, seq_lens, block_table)
    num_heads, head_dim, num_kv_heads, block_size = _check_args(query, key_cache, value_cache, out,
                                                                query_start_loc, seq_lens, block_table,
                                                                sliding_window, max_query_len, sinks)
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_query_len == 0 or query.shape[0] == 0:
        return
    check_launch("paged_attention", num_reqs, "requests", num_kv_splits)
    heads_per_kv = num_heads // num_kv_heads
    head_dim_p = triton.next_power_of_2(head_dim)
    block_m, m_blocks, splits, tile_n, num_warps = kernel_variant(num_reqs, max_query_len, heads_per_kv, num_kv_heads,
                                                                  head_dim, block_table.shape[1] * block_size,
                                                                  query.device, num_kv_splits,
                                                                  kv_bytes=key_cache.element_size())
    partial = partial_ml = partial_live = out  # never read with one split
    if splits > 1:
        num_tokens = query.shape[0]
        partial = torch.empty(num_tokens, num_heads, splits, head_dim_p, dtype=torch.float32, device=out.device)
        partial_ml = torch.empty(num_tokens, num_heads, splits, 2, dtype=torch.float32, device=out.device)
        partial_live = torch.empty(num_tokens, num_heads, dtype=torch.int32, device=out.device)
    grid = (m_blocks, num_reqs, num_kv_heads * splits)
    launch(
        _paged_attention_kernel, grid, query.device,
        query, key_cache, value_cache, out, query_start_loc, seq_lens, block_table, partial, partial_ml, partial_live,
        sinks if sinks is not None else out,
        num_heads,
        splits, scale * math.log2(math.e), sliding_window or 0,
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), block_table.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, HEADS_PER_KV=heads_per_kv, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, TILE_N=tile_n, HAS_WINDOW=sliding_window is not None,
        # fp32 caches: full-precision products (tl.dot would use TF32 on tensor cores otherwise).
        DOT_PRECISION="ieee" if key_cache.dtype == torch.float32 else "tf32", SPLIT=splits > 1,
        HAS_SINKS=sinks is not None, num_warps=num_warps)
    if splits > 1:
        launch(
            _combine_splits_kernel, (query.shape[0], num_heads), query.device,
            out, partial, partial_ml, partial_live, query_start_loc, sinks if sinks is not None else out, num_reqs,
            num_heads, splits, *out.stride(),
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, SPLIT_CHUNK=16, HAS_SINKS=sinks is not None,
            num_warps=1 if head_dim_p <= 128 else 2)


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                        scale: float, sliding_window: int | None, max_query_len: int, *,
                        sinks: torch.Tensor | None = None) -> None:
    """Plain-torch reference of `paged_attention` (same arguments), one request at a time, in fp32; a sink is one
    more column of each row's softmax, dropped after it.

    Independent of the kernel: gathers each request's keys position by position into a dense sequence and
    applies an explicit causal / sliding-window mask. Syncs with the host; for tests and CPU only.
    """
    _check_args(query, key_cache, value_cache, out, query_start_loc, seq_lens, block_table, sliding_window,
                max_query_len, sinks)
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        pos = torch.arange(seq_len, device=key_cache.device)  # [seq_len]
        blocks = block_table[i].long()[pos // block_size]
        keys = key_cache[blocks, pos % block_size].float()  # [seq_len, num_kv_heads, head_dim]
        values = value_cache[blocks, pos % block_size].float()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [seq_len, num_heads, head_dim]
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[start:end].to(key_cache.dtype).float()  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale  # [num_heads, q_len, seq_len]
        q_pos = seq_len - q_len + torch.arange(q_len, device=pos.device)  # [q_len]
        visible = pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(-1, 1, 1).expand(num_heads, q_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)


def _check_args(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                sliding_window: int | None, max_query_len: int,
                sinks: torch.Tensor | None = None) -> tuple[int, int, int, int]:
    """Shape checks only (no device data is read). Returns (num_heads, head_dim, num_kv_heads, block_size)."""
    shapes = check_query_and_cache(query, key_cache, value_cache, out, "num_tokens")
    num_reqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or tuple(query_start_loc.shape) != (num_reqs + 1,):
        raise ValueError(f"seq_lens must be [num_reqs] and query_start_loc [num_reqs + 1], got "
                         f"{tuple(seq_lens.shape)} and {tuple(query_start_loc.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(f"block_table must be [{num_reqs}, max_blocks], got {tuple(block_table.shape)}")
    check_sliding_window(sliding_window)
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative host int, got {max_query_len!r}")
    check_sinks(sinks, shapes[0])
    return shapes
