"""The few-row kernel's (engine/kernels/small_m/linear.py) building blocks: the input tile with its prologue (a
norm, or the gated activation), the multiply-add forms (FMA, row loop, tl.dot), and the output store with its
epilogues (bias, the gated activation, the residual add, the rows' sums of squares). Rounding as that file says."""

from __future__ import annotations

from engine.kernels.e4m3 import e4m3_to_bf16
from engine.kernels.triton_compat import tl, triton

__all__ = ["accumulate_pair", "group_scale", "store_output", "weight_tile"]


@triton.jit
def weight_tile(w_rows, s_rows, kk, k0, GROUP_K: tl.constexpr, w_mask, n_mask, x_dtype: tl.constexpr,
                W_SCALE: tl.constexpr, USE_DOT: tl.constexpr, W_PTX: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at columns kk (from k0), as the multiply-add takes it. W_SCALE 0: as
    stored, in the activations' dtype. FP8 (stored as bytes, read as float8_e4m3fn: one byte a weight, half the
    bytes a step reads), the tl.dot form: converted exactly to the activations' dtype (W_PTX: bfloat16 through
    e4m3_to_bf16), unscaled; the tile's partial product takes the scales (group_scale, or the row's at the end).
    The FMA forms: converted exactly to float32; W_SCALE 2 multiplies each row by its scale of the column group the
    tile lies in (the tile never straddles two: BLOCK_K divides GROUP_K), W_SCALE 1 leaves the row's one scale to
    the finished sum."""
    # if/else, not an early return: the compiler still builds what follows a return inside a constexpr branch,
    # and the FP8 conversion does not build for a 16-bit weight
    if W_SCALE == 0:
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
    elif USE_DOT:
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0)
        if W_PTX:
            w = e4m3_to_bf16(w)
        else:
            w = w.to(tl.float8e4nv, bitcast=True).to(x_dtype)
    else:
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if W_SCALE == 2:
            w = w * tl.load(s_rows + k0 // GROUP_K, mask=n_mask, other=0.0)[:, None]
    return w


@triton.jit
def group_scale(s_rows, k0, GROUP_K: tl.constexpr, n_mask, W_SCALE: tl.constexpr, USE_DOT: tl.constexpr):
    """The scales [BLOCK_N] of the column group the K tile at k0 lies in, for the tl.dot form's partial product of an
    FP8 weight with a scale a group (W_SCALE 2); elsewhere 1 (the FMA forms scale the weight tile, a scale a row
    multiplies the finished sum)."""
    if USE_DOT and W_SCALE == 2:
        s = tl.load(s_rows + k0 // GROUP_K, mask=n_mask, other=0.0)
    else:
        s = 1.0
    return s


@triton.jit
def _input_tile(x_ptr, res_ptr, nw_ptr, rows, kk, m_mask, k_mask, stride_x, stride_r, inter, rstd, offset,
                PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_OFFSET: tl.constexpr, GELU_TANH: tl.constexpr):
    """The product's input at rows x columns kk, in the activation dtype (see the module docstring)."""
    mask = m_mask[:, None] & k_mask[None, :]
    ptrs = x_ptr + rows[:, None] * stride_x + kk[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    dt = x.dtype
    if PROLOGUE == 1:
        if HAS_RES:
            x = (x + tl.load(res_ptr + rows[:, None] * stride_r + kk[None, :], mask=mask, other=0.0)).to(dt)
        nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        xf = x.to(tl.float32) * rstd[:, None]
        if HAS_OFFSET:
            x = (xf * (offset + nw[None, :])).to(dt)
        else:
            x = (xf.to(dt).to(tl.float32) * nw[None, :]).to(dt)
    elif PROLOGUE == 2:
        gate = x.to(tl.float32)
        up = tl.load(ptrs + inter, mask=mask, other=0.0).to(tl.float32)
        x = (_act(gate, GELU_TANH).to(dt).to(tl.float32) * up).to(dt)
    return x


@triton.jit
def _act(gate, GELU_TANH: tl.constexpr):
    """The gated MLP's activation of a float32 gate: GELU (tanh form) or SiLU."""
    if GELU_TANH:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))  # tanh(z) = 2 sigmoid(2z) - 1
    return gate / (1.0 + tl.exp(-gate))


@triton.jit
def _multiply_add(acc, a, w, s, USE_DOT: tl.constexpr, DOT_IEEE: tl.constexpr, SCALED: tl.constexpr):
    """acc + a @ w.T for an input tile a [BLOCK_M, BLOCK_K] and a weight tile w [BLOCK_N, BLOCK_K]: into acc
    [BLOCK_M, BLOCK_N] with tl.dot (SCALED: the product times the weight rows' scales s [BLOCK_N]), or into acc
    [BLOCK_M, BLOCK_N, BLOCK_K] (FMA form, summed over K at the end)."""
    if USE_DOT:
        if SCALED:  # the tile's product alone, scaled, then added
            if DOT_IEEE:
                acc += tl.dot(a, tl.trans(w), input_precision="ieee") * s[None, :]
            else:
                acc += tl.dot(a.to(w.dtype), tl.trans(w)) * s[None, :]
        else:  # accumulated in the product itself (acc as the MMA's addend)
            if DOT_IEEE:
                acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(a.to(w.dtype), tl.trans(w))
    else:
        acc += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _accumulate(acc, w, s, x_ptr, res_ptr, nw_ptr, M, rows, kk, m_mask, k_mask, stride_x, stride_r, inter, rstd,
                offset, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_OFFSET: tl.constexpr,
                GELU_TANH: tl.constexpr, USE_DOT: tl.constexpr, DOT_IEEE: tl.constexpr, ROW_LOOP: tl.constexpr,
                BLOCK_M: tl.constexpr, SCALED: tl.constexpr):
    """acc plus the product of the input's columns kk with the weight tile w [BLOCK_N, BLOCK_K] (SCALED: times the
    rows' scales s, group_scale's). ROW_LOOP: one row
    at a time into acc [BLOCK_M, BLOCK_N], each row's products summed over the tile at once, so the weight tile
    keeps its one-row size whatever the rows (the FMA form's accumulator grows with them)."""
    if ROW_LOOP:
        wf = w.to(tl.float32)
        for i in tl.static_range(BLOCK_M):
            row = i + tl.arange(0, 1)
            rstd_i = tl.sum(tl.where(rows == i, rstd, 0.0), axis=0) + tl.zeros([1], dtype=tl.float32)
            a = _input_tile(x_ptr, res_ptr, nw_ptr, row, kk, row < M, k_mask, stride_x, stride_r, inter, rstd_i,
                            offset, PROLOGUE, HAS_RES, HAS_OFFSET, GELU_TANH)
            part = tl.sum(a.to(tl.float32) * wf, axis=1)  # [BLOCK_N]
            acc = tl.where((rows == i)[:, None], acc + part[None, :], acc)
    else:
        a = _input_tile(x_ptr, res_ptr, nw_ptr, rows, kk, m_mask, k_mask, stride_x, stride_r, inter, rstd, offset,
                        PROLOGUE, HAS_RES, HAS_OFFSET, GELU_TANH)
        acc = _multiply_add(acc, a, w, s, USE_DOT, DOT_IEEE, SCALED)
    return acc


@triton.jit
def store_output(acc, acc_up, b_ptr, add_ptr, out_ptr, ss_ptr, rows, cols, m_mask, n_mask, M, stride_a, stride_o,
                  HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, GLU: tl.constexpr, GELU_TANH: tl.constexpr,
                  SS_OUT: tl.constexpr):
    """The float32 product acc [BLOCK_M, BLOCK_N] plus the bias, rounded, plus the epilogue's add, stored. GLU:
    acc is the gate's product and acc_up the up's, stored as act(gate) * up (act_and_mul's rounding). SS_OUT: this
    column tile's sum of squares of every stored row, float32, to ss_ptr [column tiles, M] (a norm's statistics,
    read by the next product's prologue instead of the whole row)."""
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    y = acc.to(dt)
    if GLU:
        gate = y.to(tl.float32)
        y = (_act(gate, GELU_TANH).to(dt).to(tl.float32) * acc_up.to(dt).to(tl.float32)).to(dt)
    if HAS_ADD:
        add = tl.load(add_ptr + rows[:, None] * stride_a + cols[None, :], mask=out_mask, other=0.0)
        y = (y.to(tl.float32) + add.to(tl.float32)).to(dt)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y, mask=out_mask)
    if SS_OUT:
        yf = tl.where(out_mask, y.to(tl.float32), 0.0)
        tl.store(ss_ptr + tl.program_id(0) * M + rows, tl.sum(yf * yf, axis=1), mask=m_mask)


@triton.jit
def accumulate_pair(acc, acc_up, w, w_up, s, s_up, x_ptr, res_ptr, nw_ptr, M, rows, kk, m_mask, k_mask, stride_x,
                     stride_r, inter, rstd, offset, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
                     HAS_OFFSET: tl.constexpr, GELU_TANH: tl.constexpr, USE_DOT: tl.constexpr, DOT_IEEE: tl.constexpr,
                     ROW_LOOP: tl.constexpr, BLOCK_M: tl.constexpr, GLU: tl.constexpr, SCALED: tl.constexpr):
    """_accumulate, and with GLU (DOT form) the same input tile into the gate's acc and the up's acc_up (SCALED:
    each product times its weight rows' scales, s and s_up)."""
    if GLU:
        a = _input_tile(x_ptr, res_ptr, nw_ptr, rows, kk, m_mask, k_mask, stride_x, stride_r, inter, rstd, offset,
                        PROLOGUE, HAS_RES, HAS_OFFSET, GELU_TANH)
        acc = _multiply_add(acc, a, w, s, USE_DOT, DOT_IEEE, SCALED)
        acc_up = _multiply_add(acc_up, a, w_up, s_up, USE_DOT, DOT_IEEE, SCALED)
    else:
        acc = _accumulate(acc, w, s, x_ptr, res_ptr, nw_ptr, M, rows, kk, m_mask, k_mask, stride_x, stride_r, inter,
                          rstd, offset, PROLOGUE, HAS_RES, HAS_OFFSET, GELU_TANH, USE_DOT, DOT_IEEE, ROW_LOOP, BLOCK_M,
                          SCALED)
    return acc, acc_up
