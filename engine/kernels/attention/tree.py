"""Tree attention over the paged KV cache: the rows of several trees of branches in one Triton kernel.

A tree (engine/attention/tree_metadata.py) is one request's committed prefix, its KV read in place from the
request's own blocks (block_table), plus nodes whose KV sits in flat scratch slots (node_slots). Each query row of
the forward sits at a node; it attends to the prefix's keys and to the nodes that `visible` marks (its own chain of
ancestors and itself, never a sibling branch), with a sliding window W counted back from the row's own position
over both: key position > row position - W.

Layout of the work (grid = (M blocks, trees, KV heads x splits)): as in paged.py, a program takes one KV
head and BLOCK_M rows of (tree row x query head of this KV head) pairs, row m being the tree's row m //
heads_per_kv and head m % heads_per_kv. So every row of a tree shares the prefix pass: each prefix K/V tile is
loaded once for all the tree's rows and heads (up to BLOCK_M = 64 pairs; a wider tree takes a second M block,
which reads the prefix again), which is what makes a tree of 15 rows cost about what one row costs; a row costs
its share of the tensor-core work only. Then the nodes, in tiles of TILE_NODES scratch slots, under the `visible`
mask. Online softmax in fp32 (FlashAttention-2, exp2 domain), as paged_attention.

Small batches of trees would leave most SMs idle (one tree of an 8-KV-head draft: 8 programs), so the prefix's
tiles are split over several programs (flash-decoding), and so are the node tiles; a small second kernel combines
their partial results.

The grid depends only on host ints (number of trees, the metadata's max_rows, KV heads, and the splits chosen from
them), every length is read from device memory, so a launch is captured in a CUDA graph per tree bucket
(engine/runner/tree_graphs.py).

Faster variants, should profiles ask for them: a tree wider than 64 (row, head) pairs re-reads the prefix once per
M block (an M loop inside the program over K/V tiles held in shared memory would read it once; a BLOCK_M of 128
did not pay, see MAX_BLOCK_M); the node pass visits every node tile of the tree for every M block, visible or
not (a per-row-block node range would skip the branches a block's rows never see).
"""

from __future__ import annotations

import math

import torch

from engine.kernels.attention.args import check_launch, check_query_and_cache, check_sinks, check_sliding_window
from engine.kernels.attention.launch import MAX_AUTO_SPLITS, _auto_splits, _tile_n, default_tile_and_warps
from engine.kernels.triton_compat import HAS_TRITON, launch, require_triton, tl, triton, wait_for_previous_kernel

__all__ = ["HAS_TRITON", "tree_attention", "tree_attention_ref", "tree_kernel_variant"]

TILE_NODES = 16  # nodes per tile of the node pass (tl.dot's minimum width)
# (row, head) pairs a program takes at most; a wider tree takes several M blocks, each reading the prefix. 128 (one
# pass for a 64-row tree of a Qwen3-0.6B draft) measured no faster on an H200: the blocks run side by side and the
# second reads the prefix from L2 (benchmarks/gpu_tree_attention.py --max-block-m 64,128).
MAX_BLOCK_M = 64


@triton.jit(do_not_specialize=["num_splits", "max_rows", "max_nodes"])
def _tree_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, block_table_ptr, row_index_ptr, row_pos_ptr, prefix_lens_ptr,
        node_pos_ptr, node_slots_ptr, visible_ptr,
        partial_ptr, partial_ml_ptr,  # split-KV workspace (read only when SPLIT)
        sinks_ptr,  # [num_heads] float32 sink logits (read only when HAS_SINKS and not SPLIT)
        num_heads,
        num_splits,  # programs sharing one tree's prefix (1 unless SPLIT)
        max_rows, max_nodes,
        scale_log2,  # softmax scale * log2(e): the kernel uses exp2
        window,  # sliding window W (read only when HAS_WINDOW)
        stride_qt, stride_qh, stride_qd,
        stride_ot, stride_oh, stride_od,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_bt, stride_ri, stride_rp, stride_np, stride_ns, stride_vt, stride_vr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, HEADS_PER_KV: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, TILE_NODES: tl.constexpr,
        HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr,
        USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)  # first: see triton_compat (programmatic dependent launch)
    m_block = tl.program_id(0)
    tree = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    r = rows // HEADS_PER_KV  # [BLOCK_M] the tree's row
    head = kv_head * HEADS_PER_KV + rows % HEADS_PER_KV  # [BLOCK_M] query head
    in_range = r < max_rows
    # Padding rows have position -1 (and, like rows past max_rows, are neither read nor written).
    q_pos = tl.load(row_pos_ptr + tree * stride_rp + r, mask=in_range, other=-1).to(tl.int32)  # [BLOCK_M]
    row_valid = q_pos >= 0
    if tl.max(row_valid.to(tl.int32), 0) > 0:
        q_rows = tl.load(row_index_ptr + tree * stride_ri + r, mask=row_valid, other=0).to(tl.int64)  # [BLOCK_M]
        dim = tl.arange(0, HEAD_DIM_P)  # [HEAD_DIM_P]
        dim_valid = dim < HEAD_DIM
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dim[None, :] * stride_qd,
                    mask=row_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_P]
        q = q.to(k_ptr.dtype.element_ty)
        prefix_len = tl.load(prefix_lens_ptr + tree).to(tl.int32)

        # Running max (log2 domain) starts finite: a row whose keys in a tile are all masked then gets
        # exp2(-inf - floor) = 0 and a rescale of exp2(0) = 1, not the NaN of (-inf) - (-inf).
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # [BLOCK_M]
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M] running sum of exp2
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)  # [BLOCK_M, HEAD_DIM_P]
        k_head = k_ptr + kv_head * stride_kh
        v_head = v_ptr + kv_head * stride_vh

        # ---- the prefix: keys 0..prefix_len - 1, from the earliest window start of this block's rows ----
        kv_start = 0
        if HAS_WINDOW:
            first_pos = tl.min(tl.where(row_valid, q_pos, prefix_len + max_nodes), 0)
            kv_start = tl.maximum(first_pos - window + 1, 0)
        tile_lo = kv_start // TILE_N
        tile_hi = tl.cdiv(prefix_len, TILE_N)
        if SPLIT:
            per_split = tl.cdiv(tl.maximum(tile_hi - tile_lo, 0), num_splits)
            tile_lo = tile_lo + split * per_split
            tile_hi = tl.minimum(tile_hi, tile_lo + per_split)
        block_row = block_table_ptr + tree * stride_bt
        for tile in range(tile_lo, tile_hi):
            k_pos = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
            # Keys before the window start are masked, not only whole tiles: their blocks may have been released.
            k_valid = (k_pos >= kv_start) & (k_pos < prefix_len)
            block = tl.load(block_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)  # [TILE_N]
            offset = k_pos % BLOCK_SIZE
            kv_mask = k_valid[:, None] & dim_valid[None, :]
            k = tl.load(k_head + block[:, None] * stride_kb + offset[:, None] * stride_ks + dim[None, :] * stride_kd,
                        mask=kv_mask, other=0.0)  # [TILE_N, HEAD_DIM_P]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N] fp32
            seen = k_valid[None, :] & row_valid[:, None]
            if HAS_WINDOW:
                seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
            alpha = tl.exp2(m_i - m_new)  # [BLOCK_M] rescale of what was accumulated so far
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, TILE_N]
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_head + block[:, None] * stride_vb + offset[:, None] * stride_vs + dim[None, :] * stride_vd,
                        mask=kv_mask, other=0.0)  # [TILE_N, HEAD_DIM_P]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # ---- the nodes: scratch slots, each row seeing its own chain (`visible`), windowed by node position ----
        # Split s takes node tiles s, s + splits, ...: spread like the prefix, not all on one program, whose share
        # would otherwise be the launch's critical path (a tree of 85 nodes is 6 tiles against a prefix split's 1).
        for n0 in range(split * TILE_NODES, max_nodes, num_splits * TILE_NODES):
            node = n0 + tl.arange(0, TILE_NODES)  # [TILE_NODES]
            n_valid = node < max_nodes
            slot = tl.load(node_slots_ptr + tree * stride_ns + node, mask=n_valid, other=0).to(tl.int64)
            n_pos = tl.load(node_pos_ptr + tree * stride_np + node, mask=n_valid,
                            other=-1).to(tl.int32)  # [TILE_NODES]
            vis = tl.load(visible_ptr + tree * stride_vt + r[:, None] * stride_vr + node[None, :],
                          mask=row_valid[:, None] & n_valid[None, :], other=0) != 0  # [BLOCK_M, TILE_NODES]
            if HAS_WINDOW:
                vis = vis & (n_pos[None, :] > q_pos[:, None] - window)
            n_live = n_valid & (n_pos >= 0)
            vis = vis & n_live[None, :]
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            kv_mask = n_live[:, None] & dim_valid[None, :]
            k = tl.load(k_head + block[:, None] * stride_kb + offset[:, None] * stride_ks
                        + dim[None, :] * stride_kd, mask=kv_mask, other=0.0)  # [TILE_NODES, HEAD_DIM_P]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_NODES]
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_head + block[:, None] * stride_vb + offset[:, None] * stride_vs
                        + dim[None, :] * stride_vd, mask=kv_mask, other=0.0)  # [TILE_NODES, HEAD_DIM_P]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        if not SPLIT:
            if HAS_SINKS:  # as paged_attention: once, against the row's final max, capped short of inf
                sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
                l_i += tl.where(row_valid, tl.exp2(tl.minimum(sink - m_i, 126.0)), 0.0)
            # Every valid row sees itself (l_i > 0); the guard only avoids 0 / 0 on rows that are not stored.
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dim[None, :] * stride_od,
                     acc.to(o_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
        else:
            # Unnormalised partial results; a split that saw no key writes m = floor, l = 0, acc = 0.
            ws = (q_rows * num_heads + head) * num_splits + split  # [BLOCK_M] workspace row
            tl.store(partial_ptr + ws[:, None] * HEAD_DIM_P + dim[None, :], acc, mask=row_valid[:, None])
            tl.store(partial_ml_ptr + ws * 2, m_i, mask=row_valid)
            tl.store(partial_ml_ptr + ws * 2 + 1, l_i, mask=row_valid)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_tree_splits_kernel(
        o_ptr, partial_ptr, partial_ml_ptr, sinks_ptr, num_heads, num_splits, stride_ot, stride_oh, stride_od,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, SPLITS_P: tl.constexpr, HAS_SINKS: tl.constexpr,
        USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)  # first: see triton_compat (programmatic dependent launch)
    # A padding row of a CUDA graph's bucket (engine/runner/tree_graphs.py) combines a workspace nobody wrote; its
    # output is never read.
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P)  # [SPLITS_P]
    live = splits < num_splits
    dim = tl.arange(0, HEAD_DIM_P)  # [HEAD_DIM_P]
    ws = (row * num_heads + head) * num_splits + splits  # [SPLITS_P]
    # Lanes past num_splits weigh exp2(floor - max) = 0 and add nothing.
    m = tl.load(partial_ml_ptr + ws * 2, mask=live, other=-1.0e30)  # [SPLITS_P] log2-domain maxima
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - m_max)  # [SPLITS_P]
    denom = tl.sum(weight * tl.load(partial_ml_ptr + ws * 2 + 1, mask=live, other=0.0), 0)
    if HAS_SINKS:  # once, against the combined max
        denom += tl.exp2(tl.minimum(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m_max, 126.0))
    acc = tl.load(partial_ptr + ws[:, None] * HEAD_DIM_P + dim[None, :], mask=live[:, None],
                  other=0.0)  # [SPLITS_P, HEAD_DIM_P]
    out = tl.sum(acc * weight[:, None], 0) / denom  # [HEAD_DIM_P]
    tl.store(o_ptr + row * stride_ot + head * stride_oh + dim * stride_od, out.to(o_ptr.dtype.element_ty),
             mask=dim < HEAD_DIM)


def tree_attention(query: torch.Tensor,  # [num_rows, num_heads, head_dim] bf16/fp16/fp32
                   key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
                   value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
                   out: torch.Tensor,  # [num_rows, num_heads, head_dim]
                   block_table: torch.Tensor,  # [num_trees, max_blocks] int32/int64; the prefix's blocks, 0 = null
                   row_index: torch.Tensor,  # [num_trees, max_rows] int64; flat row of each tree row
                   row_positions: torch.Tensor,  # [num_trees, max_rows] int64; -1: padding row
                   prefix_lens: torch.Tensor,  # [num_trees] int64
                   node_positions: torch.Tensor,  # [num_trees, max_nodes] int64; -1: padding node
                   node_slots: torch.Tensor,  # [num_trees, max_nodes] int64; this KV-cache group's scratch slots
                   visible: torch.Tensor,  # [num_trees, max_rows, max_nodes] bool; row sees node
                   scale: float,
                   sliding_window: int | None,
                   *,
                   num_kv_splits: int | None = None,
                   sinks: torch.Tensor | None = None) -> None:  # [num_heads] float sink logits, or None
    """Tree attention of every tree's rows (engine/attention/tree_metadata.py, one KV-cache group's view) over the
    prefix's paged keys and the visible nodes' scratch keys, written into `out` (every flat row is some tree's row).

    num_kv_splits: how many programs share one tree's prefix (flash-decoding), a power of two; None picks one from
    the host-side shapes and the GPU's SM count, as paged_attention does. sinks: as paged_attention's.
    """
    require_triton("tree_attention", query, key_cache, value_cache, out, block_table, row_index, row_positions,
                   prefix_lens, node_positions, node_slots, visible)
    num_heads, head_dim, num_kv_heads, block_size = _check_args(
        query, key_cache, value_cache, out, block_table, row_index, row_positions, prefix_lens, node_positions,
        node_slots, visible, sliding_window, sinks)
    num_trees, max_rows = row_positions.shape
    max_nodes = node_positions.shape[1]
    if num_trees == 0 or max_rows == 0 or query.shape[0] == 0:
        return
    check_launch("tree_attention", num_trees, "trees", num_kv_splits)
    heads_per_kv = num_heads // num_kv_heads
    head_dim_p = triton.next_power_of_2(head_dim)
    block_m, m_blocks, splits = tree_kernel_variant(num_trees, max_rows, heads_per_kv, num_kv_heads, head_dim,
                                                    block_table.shape[1] * block_size, query.device, num_kv_splits)
    partial = partial_ml = out  # never read with one split
    if splits > 1:
        num_rows = query.shape[0]
        partial = torch.empty(num_rows, num_heads, splits, head_dim_p, dtype=torch.float32, device=out.device)
        partial_ml = torch.empty(num_rows, num_heads, splits, 2, dtype=torch.float32, device=out.device)
    grid = (m_blocks, num_trees, num_kv_heads * splits)
    tile_n, num_warps = default_tile_and_warps(block_m, head_dim)
    launch(
        _tree_attention_kernel, grid, query.device,
        query, key_cache, value_cache, out, block_table, row_index, row_positions, prefix_lens, node_positions,
        node_slots, visible.view(torch.uint8),  # a free view: the kernel reads bytes
        partial, partial_ml, sinks if sinks is not None else out, num_heads, splits, max_rows, max_nodes,
        scale * math.log2(math.e), sliding_window or 0,
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(),
        block_table.stride(0), row_index.stride(0), row_positions.stride(0), node_positions.stride(0),
        node_slots.stride(0), visible.stride(0), visible.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, HEADS_PER_KV=heads_per_kv, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, TILE_N=tile_n, TILE_NODES=TILE_NODES, HAS_WINDOW=sliding_window is not None,
        # fp32 caches: full-precision products (tl.dot would use TF32 on tensor cores otherwise).
        DOT_PRECISION="ieee" if key_cache.dtype == torch.float32 else "tf32", SPLIT=splits > 1,
        HAS_SINKS=sinks is not None, num_warps=num_warps)
    if splits > 1:
        launch(
            _combine_tree_splits_kernel, (query.shape[0], num_heads), query.device,
            out, partial, partial_ml, sinks if sinks is not None else out, num_heads, splits, *out.stride(),
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, SPLITS_P=max(MAX_AUTO_SPLITS, splits),
            HAS_SINKS=sinks is not None,
            num_warps=1 if head_dim_p <= 128 else 2)


def tree_kernel_variant(num_trees: int, max_rows: int, heads_per_kv: int, num_kv_heads: int, head_dim: int,
                        max_prefix_keys: int, device: torch.device,
                        num_kv_splits: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, M blocks, splits) of a launch, from host ints only."""
    pairs = max_rows * heads_per_kv  # (row, head) pairs of one tree per KV head
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(pairs)))
    m_blocks = triton.cdiv(pairs, block_m)
    splits = num_kv_splits
    if splits is None:
        splits = _auto_splits(m_blocks * num_trees * num_kv_heads, triton.cdiv(max_prefix_keys, _tile_n(head_dim)),
                              device)
    return block_m, m_blocks, splits


def tree_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                       block_table: torch.Tensor, row_index: torch.Tensor, row_positions: torch.Tensor,
                       prefix_lens: torch.Tensor, node_positions: torch.Tensor, node_slots: torch.Tensor,
                       visible: torch.Tensor, scale: float, sliding_window: int | None, *,
                       sinks: torch.Tensor | None = None) -> None:
    """Plain-torch reference of `tree_attention` (same arguments), one row at a time, in fp32; a sink is one more
    column of each row's softmax, dropped after it.

    Independent of the kernel and of the torch backend's masks: for each row it lists the keys the row sees (the
    prefix positions in its window, then the visible nodes in their window), gathers them and takes a softmax.
    Syncs with the host; for tests and CPU only.
    """
    _check_args(query, key_cache, value_cache, out, block_table, row_index, row_positions, prefix_lens,
                node_positions, node_slots, visible, sliding_window, sinks)
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    block_size = key_cache.shape[1]
    flat_k = key_cache.reshape(-1, num_kv_heads, key_cache.shape[3])  # [num_blocks * block_size, kv_heads, dim]
    flat_v = value_cache.reshape(-1, num_kv_heads, value_cache.shape[3])
    # The metadata on the host once (not one sync per key).
    tables, row_index_h, row_pos_h = block_table.long().cpu(), row_index.tolist(), row_positions.tolist()
    node_pos_h, node_slots_h, visible_h = node_positions.tolist(), node_slots.cpu(), visible.cpu()
    for t, prefix_len in enumerate(prefix_lens.tolist()):
        for r, q_pos in enumerate(row_pos_h[t]):
            if q_pos < 0:
                continue
            lo = max(0, q_pos - sliding_window + 1) if sliding_window is not None else 0
            pos = torch.arange(lo, max(lo, prefix_len))
            nodes = [n for n, n_pos in enumerate(node_pos_h[t])
                     if bool(visible_h[t, r, n]) and (sliding_window is None or n_pos > q_pos - sliding_window)]
            slots = torch.cat([tables[t, pos // block_size] * block_size + pos % block_size,
                               node_slots_h[t, nodes]]).to(key_cache.device)
            keys = flat_k[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [n_keys, heads, dim]
            values = flat_v[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)
            row = row_index_h[t][r]
            q = query[row].to(key_cache.dtype).float()  # [heads, dim]
            scores = torch.einsum("hd,khd->hk", q, keys) * scale  # [heads, n_keys]
            if sinks is not None:
                probs = torch.cat([scores, sinks.float()[:, None]], dim=-1).softmax(dim=-1)[:, :-1]
            else:
                probs = scores.softmax(dim=-1)
            out[row] = torch.einsum("hk,khd->hd", probs, values).to(out.dtype)


def _check_args(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                block_table: torch.Tensor, row_index: torch.Tensor, row_positions: torch.Tensor,
                prefix_lens: torch.Tensor, node_positions: torch.Tensor, node_slots: torch.Tensor,
                visible: torch.Tensor, sliding_window: int | None,
                sinks: torch.Tensor | None = None) -> tuple[int, int, int, int]:
    """Shape checks only (no device data is read). Returns (num_heads, head_dim, num_kv_heads, block_size)."""
    shapes = check_query_and_cache(query, key_cache, value_cache, out, "num_rows")
    if row_positions.dim() != 2 or row_index.shape != row_positions.shape:
        raise ValueError(f"row_index and row_positions must both be [num_trees, max_rows], got "
                         f"{tuple(row_index.shape)} and {tuple(row_positions.shape)}")
    num_trees, max_rows = row_positions.shape
    if tuple(prefix_lens.shape) != (num_trees,):
        raise ValueError(f"prefix_lens must be [{num_trees}], got {tuple(prefix_lens.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != num_trees:
        raise ValueError(f"block_table must be [{num_trees}, max_blocks], got {tuple(block_table.shape)}")
    if node_positions.dim() != 2 or node_positions.shape[0] != num_trees or node_slots.shape != node_positions.shape:
        raise ValueError(f"node_positions and node_slots must both be [{num_trees}, max_nodes], got "
                         f"{tuple(node_positions.shape)} and {tuple(node_slots.shape)}")
    if tuple(visible.shape) != (num_trees, max_rows, node_positions.shape[1]) or visible.dtype != torch.bool:
        raise ValueError(f"visible must be bool [{num_trees}, {max_rows}, {node_positions.shape[1]}], got "
                         f"{visible.dtype} {tuple(visible.shape)}")
    if visible.stride(2) != 1:
        raise ValueError("visible must be contiguous in its last dimension")
    for name, t in (("row_index", row_index), ("row_positions", row_positions), ("prefix_lens", prefix_lens),
                    ("node_positions", node_positions), ("node_slots", node_slots)):
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    check_sliding_window(sliding_window)
    check_sinks(sinks, shapes[0])
    return shapes
