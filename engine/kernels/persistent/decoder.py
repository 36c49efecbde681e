"""Every decoder layer of a decode step in one launch (Triton kernel; its plan, typed wrapper and torch reference are
in engine/kernels/persistent/plan.py).

Why: a draft token of a 0.6B model at batch 1 reads about 1.2 GB, 0.4 ms at an H100's copy bandwidth, yet its step
of seven kernels a layer took 0.83-1.0 ms: each of about 200 launches pays a ramp-up and a tail of its own (a few
microseconds) that no one-kernel-at-a-time design removes, and dependent launch hides only the launch itself. Here
one program per SM walks all layers; between the six stages of a layer the programs meet at a grid barrier on the
device, and each program requests its next stage's weight tile *between* its arrival and its wait (weights are
never written, so nothing orders those loads), so HBM streams the next product's weights while the slowest program
finishes the current stage.

Stages of a layer, each split over the programs (a program's share of a product is one tile of BN output features
over the whole K, so the weight tile is a single load of up to 64 KB):
  0 qkv       x = rmsnorm(h) (every program recomputes the row statistics: h is a few KB) ; qkv = x Wqkv^T (+ b)
  1 attention work units (row, KV head, split of the context): q/k norm and rotary of the new token (recomputed by
              each unit of its head), the unit of split 0 stores the new key and value, each unit attends over its
              share of the old keys (the last split also over the new token, from registers) and writes its float32
              partial (running max, sum, accumulator)
  2 combine   units (row, q head): the splits' partials into the attention output
  3 o_proj    h += attn Wo^T                       (each program owns BN columns of h: no race)
  4 gate_up   x = rmsnorm(h) ; a = act(x Wg^T) * (x Wu^T)
  5 down      h += a Wd^T
The barrier is engine/kernels/persistent/grid_barrier.py (a counter zeroed before the launch; a wait that spins too
long sets the error flag, which tests read, rather than hang the GPU). The grid is at most one program per SM, so every
program is resident at once.

Under Triton's interpreter the programs of one launch run one after another, so a spinning barrier would never
open: there the wrapper launches each (layer, stage) on its own (ONLY_STAGE >= 0, no barrier), the same code. The
GPU test runs both ways.

Rounding is the unfused layers' (engine/kernels/small_m/linear.py, attention/qk_norm_rope_store.py,
attention/paged.py): the norm's output, each product, act(gate), act * up, q and k after the norm and rotation, and
every residual sum are rounded to the activation dtype; products and softmax accumulate in float32 (exp2 of scaled
scores; p rounded to the cache dtype before it weighs the values). Only the order of float32 sums differs.
"""

from __future__ import annotations

from engine.kernels.attention.qk_norm_rope_store import _norm_half
from engine.kernels.persistent.grid_barrier import arrive as _arrive
from engine.kernels.persistent.grid_barrier import stamp as _stamp
from engine.kernels.persistent.grid_barrier import wait as _wait
from engine.kernels.triton_compat import tl, triton

# Columns of the per-layer pointer table (int64 addresses; 0 for an absent bias or norm), in this order: qkv, qkv
# bias, o_proj, gate_up, down, input norm, post-attention norm, q norm, k norm, key cache, value cache.
NUM_PTRS = 11
NUM_STAGES = 6


@triton.jit
def _ptr(table, layer, col: tl.constexpr, ELEM: tl.constexpr):
    return tl.load(table + layer * 11 + col).to(tl.pointer_type(ELEM))


@triton.jit
def _cols(t, bn, N, BN: tl.constexpr):
    """Tile t's output features: bn of them (a block of BN lanes, the power of two above), masked to N."""
    lane = tl.arange(0, BN)
    cols = t * bn + lane
    return cols, (lane < bn) & (cols < N)


@triton.jit
def _tile(w_ptr, t, bn, N, K, row_offset, BN: tl.constexpr, BK: tl.constexpr):
    """Weight rows row_offset + tile t's features, over all K columns: [BN, BK]."""
    cols, cm = _cols(t, bn, N, BN)
    kk = tl.arange(0, BK)
    mask = cm[:, None] & (kk < K)[None, :]
    return tl.load(w_ptr + (row_offset + cols[:, None]).to(tl.int64) * K + kk[None, :], mask=mask, other=0.0)


@triton.jit
def _normed_row(h_ptr, r, nw_ptr, eps, H: tl.constexpr, BK: tl.constexpr):
    """rmsnorm(h[r]) rounded to h's dtype, as [BK] (Llama form: normalised, rounded, times the weight, rounded)."""
    kk = tl.arange(0, BK)
    km = kk < H
    x = tl.load(h_ptr + r * H + kk, mask=km, other=0.0, cache_modifier=".cg")
    dt = x.dtype
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)
    return ((xf * rstd).to(dt).to(tl.float32) * w).to(dt)


@triton.jit
def _silu_or_gelu(g, GELU_TANH: tl.constexpr):
    if GELU_TANH:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _head_half_norm_rope(src, d, HALF: tl.constexpr, nw_ptr, eps, cos, sin, HAS_QK_NORM: tl.constexpr):
    """One head's halves (rotate-half layout) from the qkv row at src: q/k norm (Qwen3) then rotary, rounded as
    qk_norm_rope_store. Returns the halves in the activation dtype."""
    x1 = tl.load(src + d, cache_modifier=".cg")
    x2 = tl.load(src + HALF + d, cache_modifier=".cg")
    dt = x1.dtype
    if HAS_QK_NORM:
        x1, x2 = _norm_half(x1, x2, nw_ptr, d, d < HALF, eps, 0.0, HALF, False)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    return (f1 * cos - f2 * sin).to(dt), (f2 * cos + f1 * sin).to(dt)


@triton.jit
def _linear_residual(w_first, w_ptr, x_ptr, h_ptr, pid, P, num_rows, bn, H: tl.constexpr, K: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr):
    """h[:, the tiles' features] += x W^T, rounded as linear_add (the product, then the sum): o_proj (x the attention
    output) and down (x act * up). w_first: this program's first tile, requested before the barrier's wait."""
    ELEM = h_ptr.dtype.element_ty
    kk = tl.arange(0, BK)
    w = w_first
    for t in range(pid, tl.cdiv(H, bn), P):
        if t != pid:
            w = _tile(w_ptr, t, bn, H, K, 0, BN, BK)
        cols, cm = _cols(t, bn, H, BN)
        for r in tl.static_range(ROWS):
            if r < num_rows:
                x = tl.load(x_ptr + r * K + kk, mask=kk < K, other=0.0, cache_modifier=".cg")
                y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1).to(ELEM)
                hv = tl.load(h_ptr + r * H + cols, mask=cm, other=0.0, cache_modifier=".cg")
                tl.store(h_ptr + r * H + cols, (hv.to(tl.float32) + y.to(tl.float32)).to(ELEM), mask=cm,
                         cache_modifier=".cg")


@triton.jit
def _persistent_decoder_kernel(
        table_ptr,  # [num_layers, 11] int64 addresses (the columns above)
        h_ptr,  # [ROWS, H] the residual stream: the embeddings in, the last layer's sum out
        qkv_ptr, attn_ptr, act_ptr,  # [ROWS, NQKV], [ROWS, NQ * 2 * HALF], [ROWS, INTER] activations
        pm_ptr, pacc_ptr,  # [ROWS, NQ, SPLITS, 2] (max, sum) and [ROWS, NQ, SPLITS, 2 * HALF] float32 partials
        pos_ptr, slot_ptr, seq_lens_ptr, bt_ptr,  # [>= ROWS] int64, [>= ROWS] int64, [>= ROWS] int32, block table
        cos_ptr, sin_ptr,  # [max_positions, HALF] float32
        bar_ptr, err_ptr,  # [1] int32 barrier counter (zero at launch), [1] int32 error flag
        times_ptr,  # [num_layers * 12 + 1] int64 with TIMING: per stage, program 0's start and arrival
        num_rows, layer_begin, layer_end, eps, qk_eps, scale_log2, window,
        bn_qkv, bn_o, bn_gu, bn_down,  # output features a tile (<= the BN_* block)
        stride_bt, stride_kb, stride_ks, stride_kh,
        H: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr, INTER: tl.constexpr,
        BK_H: tl.constexpr, BK_O: tl.constexpr, BK_I: tl.constexpr,
        BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr,
        ROWS: tl.constexpr, SPLITS: tl.constexpr, GROUP_P: tl.constexpr, TILE_KV: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, HAS_QK_NORM: tl.constexpr,
        HAS_WINDOW: tl.constexpr, GELU_TANH: tl.constexpr, ONLY_STAGE: tl.constexpr, GRID_SYNC: tl.constexpr,
        TIMING: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    ELEM = h_ptr.dtype.element_ty
    NQKV: tl.constexpr = (NQ + 2 * NKV) * 2 * HALF
    D: tl.constexpr = 2 * HALF
    GROUP: tl.constexpr = NQ // NKV
    n_qkv = tl.cdiv(NQKV, bn_qkv)
    n_gu = tl.cdiv(INTER, bn_gu)
    d = tl.arange(0, HALF)
    arrivals = 0

    w_qkv = _tile(_ptr(table_ptr, layer_begin, 0, ELEM), pid, bn_qkv, NQKV, H, 0, BN_QKV, BK_H)
    for layer in range(layer_begin, layer_end):
        _stamp(times_ptr, layer * 12 + 0, pid, TIMING)
        # ---- stage 0: norm + qkv -----------------------------------------------------------------------------
        if (ONLY_STAGE < 0) or (ONLY_STAGE == 0):
            w_ptr = _ptr(table_ptr, layer, 0, ELEM)
            b_ptr = _ptr(table_ptr, layer, 1, ELEM)
            n_ptr = _ptr(table_ptr, layer, 5, ELEM)
            w = w_qkv
            for t in range(pid, n_qkv, P):
                if t != pid:
                    w = _tile(w_ptr, t, bn_qkv, NQKV, H, 0, BN_QKV, BK_H)
                cols, cm = _cols(t, bn_qkv, NQKV, BN_QKV)
                for r in tl.static_range(ROWS):
                    if r < num_rows:
                        x = _normed_row(h_ptr, r, n_ptr, eps, H, BK_H)
                        y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
                        if HAS_QKV_BIAS:
                            y += tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)
                        tl.store(qkv_ptr + r * NQKV + cols, y.to(ELEM), mask=cm, cache_modifier=".cg")
        _stamp(times_ptr, layer * 12 + 1, pid, TIMING)
        arrivals += 1
        _arrive(bar_ptr, GRID_SYNC)
        _wait(bar_ptr, err_ptr, arrivals * P, GRID_SYNC)

        _stamp(times_ptr, layer * 12 + 2, pid, TIMING)
        # ---- stage 1: q/k norm, rotary, KV store, split attention ------------------------------------------------
        if (ONLY_STAGE < 0) or (ONLY_STAGE == 1):
            kc_ptr = _ptr(table_ptr, layer, 9, ELEM)
            vc_ptr = _ptr(table_ptr, layer, 10, ELEM)
            qn_ptr = _ptr(table_ptr, layer, 7, ELEM)
            kn_ptr = _ptr(table_ptr, layer, 8, ELEM)
            g_idx = tl.arange(0, GROUP_P)
            g_mask = g_idx < GROUP
            for u in range(pid, num_rows * NKV * SPLITS, P):
                r = u // (NKV * SPLITS)
                kvh = (u // SPLITS) % NKV
                s = u % SPLITS
                seq_len = tl.load(seq_lens_ptr + r).to(tl.int32)
                if seq_len > 0:
                    pos = tl.load(pos_ptr + r)
                    cos = tl.load(cos_ptr + pos * HALF + d)
                    sin = tl.load(sin_ptr + pos * HALF + d)
                    row = qkv_ptr + r * NQKV
                    k1, k2 = _head_half_norm_rope(row + (NQ + kvh) * D, d, HALF, kn_ptr, qk_eps, cos, sin,
                                                  HAS_QK_NORM)
                    v1 = tl.load(row + (NQ + NKV + kvh) * D + d, cache_modifier=".cg")
                    v2 = tl.load(row + (NQ + NKV + kvh) * D + HALF + d, cache_modifier=".cg")
                    KT = kc_ptr.dtype.element_ty
                    k1, k2, v1, v2 = k1.to(KT), k2.to(KT), v1.to(KT), v2.to(KT)
                    slot = tl.load(slot_ptr + r)
                    if (s == 0) & (slot >= 0):
                        off = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks + kvh * stride_kh
                        tl.store(kc_ptr + off + d, k1)
                        tl.store(kc_ptr + off + HALF + d, k2)
                        tl.store(vc_ptr + off + d, v1)
                        tl.store(vc_ptr + off + HALF + d, v2)
                    # this head group's q rows: [GROUP_P, HALF] halves, normalised (_norm_half's arithmetic, a row
                    # a head) and rotated
                    q_rows = row + (kvh * GROUP + g_idx)[:, None] * D
                    q1 = tl.load(q_rows + d[None, :], mask=g_mask[:, None], other=0.0, cache_modifier=".cg")
                    q2 = tl.load(q_rows + HALF + d[None, :], mask=g_mask[:, None], other=0.0, cache_modifier=".cg")
                    dt = q1.dtype
                    if HAS_QK_NORM:
                        f1, f2 = q1.to(tl.float32), q2.to(tl.float32)
                        rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / D + qk_eps)
                        w1 = tl.load(qn_ptr + d).to(tl.float32)
                        w2 = tl.load(qn_ptr + HALF + d).to(tl.float32)
                        q1 = ((f1 * rstd[:, None]).to(dt).to(tl.float32) * w1[None, :]).to(dt)
                        q2 = ((f2 * rstd[:, None]).to(dt).to(tl.float32) * w2[None, :]).to(dt)
                    f1, f2 = q1.to(tl.float32), q2.to(tl.float32)
                    q1 = (f1 * cos[None, :] - f2 * sin[None, :]).to(dt).to(KT).to(tl.float32)
                    q2 = (f2 * cos[None, :] + f1 * sin[None, :]).to(dt).to(KT).to(tl.float32)
                    # this split's share of the old keys [lo, pos)
                    lo = 0
                    if HAS_WINDOW:
                        lo = tl.maximum(pos - window + 1, 0)
                    n_old = pos - lo
                    chunk = tl.cdiv(tl.cdiv(n_old, SPLITS), TILE_KV) * TILE_KV
                    start = lo + s * chunk
                    end = tl.minimum(start + chunk, pos)
                    m_i = tl.full([GROUP_P], -1.0e30, tl.float32)
                    l_i = tl.zeros([GROUP_P], tl.float32)
                    acc1 = tl.zeros([GROUP_P, HALF], tl.float32)
                    acc2 = tl.zeros([GROUP_P, HALF], tl.float32)
                    for t0 in range(start, end, TILE_KV):
                        p_pos = t0 + tl.arange(0, TILE_KV)
                        valid = p_pos < end
                        blk = tl.load(bt_ptr + r * stride_bt + p_pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
                        off = blk * stride_kb + (p_pos % BLOCK_SIZE) * stride_ks + kvh * stride_kh
                        kk1 = tl.load(kc_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                        kk2 = tl.load(kc_ptr + off[:, None] + HALF + d[None, :], mask=valid[:, None], other=0.0)
                        sc = (tl.sum(q1[:, None, :] * kk1.to(tl.float32)[None, :, :], axis=2)
                              + tl.sum(q2[:, None, :] * kk2.to(tl.float32)[None, :, :], axis=2)) * scale_log2
                        sc = tl.where(valid[None, :], sc, -1.0e30)
                        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
                        alpha = tl.exp2(m_i - m_new)
                        p = tl.exp2(sc - m_new[:, None])
                        p = tl.where(valid[None, :], p, 0.0)
                        l_i = l_i * alpha + tl.sum(p, axis=1)
                        pv = p.to(KT).to(tl.float32)
                        vv1 = tl.load(vc_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                        vv2 = tl.load(vc_ptr + off[:, None] + HALF + d[None, :], mask=valid[:, None], other=0.0)
                        acc1 = acc1 * alpha[:, None] + tl.sum(pv[:, :, None] * vv1.to(tl.float32)[None, :, :], axis=1)
                        acc2 = acc2 * alpha[:, None] + tl.sum(pv[:, :, None] * vv2.to(tl.float32)[None, :, :], axis=1)
                        m_i = m_new
                    if s == SPLITS - 1:  # the new token, from registers
                        sc = (tl.sum(q1 * k1.to(tl.float32)[None, :], axis=1)
                              + tl.sum(q2 * k2.to(tl.float32)[None, :], axis=1)) * scale_log2
                        m_new = tl.maximum(m_i, sc)
                        alpha = tl.exp2(m_i - m_new)
                        p = tl.exp2(sc - m_new)
                        l_i = l_i * alpha + p
                        pv = p.to(KT).to(tl.float32)
                        acc1 = acc1 * alpha[:, None] + pv[:, None] * v1.to(tl.float32)[None, :]
                        acc2 = acc2 * alpha[:, None] + pv[:, None] * v2.to(tl.float32)[None, :]
                        m_i = m_new
                    heads = kvh * GROUP + g_idx
                    part = (r * NQ + heads) * SPLITS + s  # [GROUP_P]
                    tl.store(pm_ptr + part * 2, m_i, mask=g_mask, cache_modifier=".cg")
                    tl.store(pm_ptr + part * 2 + 1, l_i, mask=g_mask, cache_modifier=".cg")
                    tl.store(pacc_ptr + part[:, None] * D + d[None, :], acc1, mask=g_mask[:, None],
                             cache_modifier=".cg")
                    tl.store(pacc_ptr + part[:, None] * D + HALF + d[None, :], acc2, mask=g_mask[:, None],
                             cache_modifier=".cg")
        _stamp(times_ptr, layer * 12 + 3, pid, TIMING)
        arrivals += 1
        _arrive(bar_ptr, GRID_SYNC)
        _wait(bar_ptr, err_ptr, arrivals * P, GRID_SYNC)

        _stamp(times_ptr, layer * 12 + 4, pid, TIMING)
        # ---- stage 2: combine the splits -------------------------------------------------------------------------
        if (ONLY_STAGE < 0) or (ONLY_STAGE == 2):
            sp = tl.arange(0, SPLITS)
            for u in range(pid, num_rows * NQ, P):
                r = u // NQ
                seq_len = tl.load(seq_lens_ptr + r).to(tl.int32)
                o1 = tl.zeros([HALF], tl.float32)
                o2 = tl.zeros([HALF], tl.float32)
                if seq_len > 0:
                    part = u * SPLITS + sp  # [SPLITS]
                    mx = tl.load(pm_ptr + part * 2, cache_modifier=".cg")
                    ls = tl.load(pm_ptr + part * 2 + 1, cache_modifier=".cg")
                    wgt = tl.exp2(mx - tl.max(mx, axis=0))
                    a1 = tl.load(pacc_ptr + part[:, None] * D + d[None, :], cache_modifier=".cg")
                    a2 = tl.load(pacc_ptr + part[:, None] * D + HALF + d[None, :], cache_modifier=".cg")
                    denom = tl.sum(wgt * ls, axis=0)
                    o1 = tl.sum(wgt[:, None] * a1, axis=0) / denom
                    o2 = tl.sum(wgt[:, None] * a2, axis=0) / denom
                tl.store(attn_ptr + u * D + d, o1.to(ELEM), cache_modifier=".cg")
                tl.store(attn_ptr + u * D + HALF + d, o2.to(ELEM), cache_modifier=".cg")
        _stamp(times_ptr, layer * 12 + 5, pid, TIMING)
        arrivals += 1
        _arrive(bar_ptr, GRID_SYNC)
        wo_ptr = _ptr(table_ptr, layer, 2, ELEM)
        w_o = _tile(wo_ptr, pid, bn_o, H, NQ * D, 0, BN_O, BK_O)  # before the wait: see the module docstring
        _wait(bar_ptr, err_ptr, arrivals * P, GRID_SYNC)

        _stamp(times_ptr, layer * 12 + 6, pid, TIMING)
        # ---- stage 3: o_proj + residual --------------------------------------------------------------------------
        if (ONLY_STAGE < 0) or (ONLY_STAGE == 3):
            _linear_residual(w_o, wo_ptr, attn_ptr, h_ptr, pid, P, num_rows, bn_o, H, NQ * D, BN_O, BK_O, ROWS)
        _stamp(times_ptr, layer * 12 + 7, pid, TIMING)
        arrivals += 1
        _arrive(bar_ptr, GRID_SYNC)
        wgu_ptr = _ptr(table_ptr, layer, 3, ELEM)
        w_g = _tile(wgu_ptr, pid, bn_gu, INTER, H, 0, BN_GU, BK_H)
        w_u = _tile(wgu_ptr, pid, bn_gu, INTER, H, INTER, BN_GU, BK_H)
        _wait(bar_ptr, err_ptr, arrivals * P, GRID_SYNC)

        _stamp(times_ptr, layer * 12 + 8, pid, TIMING)
        # ---- stage 4: norm + gate_up + act * up ------------------------------------------------------------------
        if (ONLY_STAGE < 0) or (ONLY_STAGE == 4):
            n2_ptr = _ptr(table_ptr, layer, 6, ELEM)
            wg = w_g
            wu = w_u
            for t in range(pid, n_gu, P):
                if t != pid:
                    wg = _tile(wgu_ptr, t, bn_gu, INTER, H, 0, BN_GU, BK_H)
                    wu = _tile(wgu_ptr, t, bn_gu, INTER, H, INTER, BN_GU, BK_H)
                cols, cm = _cols(t, bn_gu, INTER, BN_GU)
                for r in tl.static_range(ROWS):
                    if r < num_rows:
                        x = _normed_row(h_ptr, r, n2_ptr, eps, H, BK_H).to(tl.float32)
                        g = tl.sum(wg.to(tl.float32) * x[None, :], axis=1).to(ELEM).to(tl.float32)
                        up = tl.sum(wu.to(tl.float32) * x[None, :], axis=1).to(ELEM).to(tl.float32)
                        a = _silu_or_gelu(g, GELU_TANH).to(ELEM).to(tl.float32)
                        tl.store(act_ptr + r * INTER + cols, (a * up).to(ELEM), mask=cm, cache_modifier=".cg")
        _stamp(times_ptr, layer * 12 + 9, pid, TIMING)
        arrivals += 1
        _arrive(bar_ptr, GRID_SYNC)
        wd_ptr = _ptr(table_ptr, layer, 4, ELEM)
        w_d = _tile(wd_ptr, pid, bn_down, H, INTER, 0, BN_DOWN, BK_I)
        _wait(bar_ptr, err_ptr, arrivals * P, GRID_SYNC)

        _stamp(times_ptr, layer * 12 + 10, pid, TIMING)
        # ---- stage 5: down + residual ----------------------------------------------------------------------------
        if (ONLY_STAGE < 0) or (ONLY_STAGE == 5):
            _linear_residual(w_d, wd_ptr, act_ptr, h_ptr, pid, P, num_rows, bn_down, H, INTER, BN_DOWN, BK_I, ROWS)
        if layer + 1 < layer_end:
            _stamp(times_ptr, layer * 12 + 11, pid, TIMING)
            arrivals += 1
            _arrive(bar_ptr, GRID_SYNC)
            w_qkv = _tile(_ptr(table_ptr, layer + 1, 0, ELEM), pid, bn_qkv, NQKV, H, 0, BN_QKV, BK_H)
            _wait(bar_ptr, err_ptr, arrivals * P, GRID_SYNC)
    _stamp(times_ptr, layer_end * 12, pid, TIMING)
