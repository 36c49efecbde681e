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
def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, stride_qt, stride_qh,
                   stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos, eps, offset,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   HEADS_P: tl.constexpr, HALF_P: tl.constexpr, HAS_NORM: tl.constexpr, HAS_OFFSET: tl.constexpr):
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
    if HAS_NORM:
        # Per-head RMSNorm first (Qwen3 / Gemma 3 q_norm and k_norm), rounded as the unfused norm's output is.
        w_ptr = kw_ptr if is_k else qw_ptr
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0)[None, :]
        w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0)[None, :]
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        if HAS_OFFSET:
            x1 = (x1 * rstd * (offset + w1.to(tl.float32))).to(out_ty).to(tl.float32)
            x2 = (x2 * rstd * (offset + w2.to(tl.float32))).to(out_ty).to(tl.float32)
        else:
            x1 = ((x1 * rstd).to(out_ty).to(tl.float32) * w1.to(tl.float32)).to(out_ty).to(tl.float32)
            x2 = ((x2 * rstd).to(out_ty).to(tl.float32) * w2.to(tl.float32)).to(out_ty).to(tl.float32)
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


def rotary_embedding(positions: torch.Tensor,  # [num_tokens] int64
                     q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
                     k: torch.Tensor,  # [num_tokens, num_k_heads, head_dim]
                     cos: torch.Tensor,  # [max_positions, head_dim / 2] float32
                     sin: torch.Tensor,
                     norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([head_dim], [head_dim])
                     eps: float = 1e-6, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k; with norm_weights, RMSNorm each head of q and k (weights q_w, k_w) first, in the same
    kernel (the layout of rms_norm's plain and offset forms)."""
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
        qw, kw = norm_weights if norm_weights is not None else (cos, cos)  # unread without a norm
        _rotary_kernel[(n, 2)](q, k, q_out, k_out, positions, cos, sin, qw, kw, q.stride(0), q.stride(1),
                               k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0),
                               k_out.stride(1), cos.stride(0), eps, offset, NUM_Q_HEADS=hq, NUM_K_HEADS=hk,
                               HALF=d // 2, HEADS_P=triton.next_power_of_2(max(hq, hk)),
                               HALF_P=triton.next_power_of_2(d // 2), HAS_NORM=norm_weights is not None,
                               HAS_OFFSET=bool(offset))
    return q_out, k_out


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
                         eps: float = 1e-6, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    if norm_weights is not None:
        from engine.kernels.rms_norm import rms_norm_ref

        q, k = rms_norm_ref(q, norm_weights[0], eps, offset), rms_norm_ref(k, norm_weights[1], eps, offset)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rot(q), rot(k)
