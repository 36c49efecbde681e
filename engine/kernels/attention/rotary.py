"""Rotary position embedding of q and k in one kernel (Triton kernel + typed wrapper + torch reference).

Rotate-half layout (as HF): for x = [x1, x2], out = [x1 cos - x2 sin, x2 cos + x1 sin], in float32, rounded to
the input dtype. cos/sin are the model's tables [max_positions, head_dim / 2], indexed by each token's position
on the device (so the kernel reads positions a CUDA graph's buffers hold). Unfused this is ten small kernels
for q and ten for k in every layer.
"""

from __future__ import annotations

import torch

from engine.kernels.triton_compat import require_triton, tl, triton

__all__ = ["rotary_embedding", "rotary_embedding_ref"]


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   HEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    is_k = tl.program_id(1)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, HALF_P)
    h = tl.arange(0, HEADS_P)
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0)[None, :]
    if is_k == 0:
        mask = (h[:, None] < NUM_Q_HEADS) & (d[None, :] < HALF)
        src = q_ptr + tok * stride_qt + h[:, None] * stride_qh + d[None, :]
        dst = qo_ptr + tok * stride_qot + h[:, None] * stride_qoh + d[None, :]
    else:
        mask = (h[:, None] < NUM_K_HEADS) & (d[None, :] < HALF)
        src = k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :]
        dst = ko_ptr + tok * stride_kot + h[:, None] * stride_koh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    out_ty = x1.dtype
    x1 = x1.to(tl.float32)
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


def rotary_embedding(positions: torch.Tensor,  # [num_tokens] int64
                     q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
                     k: torch.Tensor,  # [num_tokens, num_k_heads, head_dim]
                     cos: torch.Tensor,  # [max_positions, head_dim / 2] float32
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton("rotary_embedding", positions, q, k, cos, sin)
    n, hq, d = q.shape
    hk = k.shape[1]
    if k.shape[0] != n or k.shape[2] != d or cos.shape[-1] * 2 != d or cos.stride(-1) != 1 or sin.shape != cos.shape:
        raise ValueError(f"rotary_embedding: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} "
                         "do not fit [n, heads, head_dim] / [max_positions, head_dim / 2]")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_embedding needs q and k contiguous in their last dimension")
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if n:
        _rotary_kernel[(n, 2)](q, k, q_out, k_out, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0),
                               k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
                               cos.stride(0), NUM_Q_HEADS=hq, NUM_K_HEADS=hk, HALF=d // 2,
                               HEADS_P=triton.next_power_of_2(max(hq, hk)), HALF_P=triton.next_power_of_2(d // 2))
    return q_out, k_out


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rot(q), rot(k)
