"""Each row's argmax of a few wide rows (a greedy draft step's token), in two small kernels (Triton kernels + typed
wrapper + torch reference).

torch's argmax reduces a row in one thread block: one row of 32000 bfloat16 logits took 9-11 us of an EAGLE-3 head's
graphed step on an H100 (of 210-300 us), about four memory round trips in a row. Here slices of the row reduce in
parallel (one program each, a (max, column) pair out), then one program a row picks among them. Ties go to the
smallest column, as torch's do, so the kernel and the reference agree exactly. A NaN wins, as in torch (random
weights overflow to NaN logits; the first NaN's column, where the row holds no +inf before it).
"""

from __future__ import annotations

import torch

from engine.kernels.rms_norm import use_fused_kernels
from engine.kernels.triton_compat import require_triton, tl, triton

__all__ = ["argmax_rows", "argmax_rows_ref", "greedy_tokens"]

SLICE = 2048  # columns a program of the first kernel reduces
_NONE = 2 ** 31 - 1  # a column index past any row's


@triton.jit
def _slice_argmax_kernel(x_ptr, val_ptr, idx_ptr, n_cols, stride_x, num_slices, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    cols = s * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("inf"))  # a NaN (x != x) as the largest value, so it wins as in torch
    m = tl.max(x, axis=0)
    # The slice's first column holding its max (a slice of -inf only: its first column).
    first = tl.min(tl.where(x == m, cols, 2147483647), axis=0)
    tl.store(val_ptr + row * num_slices + s, m)
    tl.store(idx_ptr + row * num_slices + s, first)


@triton.jit
def _pick_kernel(val_ptr, idx_ptr, out_ptr, num_slices, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    mask = s < num_slices
    v = tl.load(val_ptr + row * num_slices + s, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_slices + s, mask=mask, other=2147483647)
    m = tl.max(v, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(v == m, i, 2147483647), axis=0).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # x: [rows, n] float -> [rows] int64
    """torch.argmax(x, dim=-1) of a 2-D float tensor."""
    require_triton("argmax_rows", x)
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"x must be [rows, n > 0], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows:
        num_slices = triton.cdiv(n, SLICE)
        vals = torch.empty(rows, num_slices, dtype=torch.float32, device=x.device)
        idx = torch.empty(rows, num_slices, dtype=torch.int32, device=x.device)
        _slice_argmax_kernel[(rows, num_slices)](x, vals, idx, n, x.stride(0), num_slices,
                                                 BLOCK=min(SLICE, triton.next_power_of_2(n)))
        _pick_kernel[(rows,)](vals, idx, out, num_slices, BLOCK_S=triton.next_power_of_2(num_slices))
    return out


def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[rows] int64 argmax of [rows, n] logits: the kernels where the fused kernels run, else torch."""
    return argmax_rows(logits) if use_fused_kernels(logits) and logits.dim() == 2 else argmax_rows_ref(logits)
