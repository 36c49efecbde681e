"""RMSNorm, optionally fused with the residual add before it (Triton kernel + typed wrapper + torch reference).

At batch 1 a decoder layer's matmuls take a few microseconds each, and an unfused float32 RMSNorm is seven
small kernels of about a microsecond each: one kernel per norm (and one add+norm after attention) is what
brings a graph-replayed step close to the weight-bandwidth floor. The arithmetic follows engine/models'
RMSNorm exactly: float32 statistics; for the plain form the normalised row is cast to the input dtype
before the (input-dtype) weight multiplies it; Gemma's offset form multiplies by (offset + w) in float32.
"""

from __future__ import annotations

import torch

from engine.kernels.triton_compat import (
    HAS_TRITON,
    interpreting,
    launch,
    require_triton,
    tl,
    triton,
    wait_for_previous_kernel,
)

__all__ = ["rms_norm", "rms_norm_ref", "add_rms_norm", "add_rms_norm_ref", "use_fused_kernels"]


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Whether the fused kernels can run on x (CUDA, or CPU under Triton's interpreter)."""
    return HAS_TRITON and (x.is_cuda or interpreting())


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, stride_r, stride_o, stride_ro,
                     eps, offset, HAS_RESIDUAL: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)  # first: see triton_compat (programmatic dependent launch)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype first, as `x + residual` in torch would be.
        x = (x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if HAS_OFFSET:
        y = xf * rstd * (offset + w.to(tl.float32))
    else:
        y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            offset: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    require_triton("rms_norm", x, weight)
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"weight must be [{n_cols}], got {tuple(weight.shape)}")
    x2 = x.reshape(-1, n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res2 = res_out = None
    if residual is not None:
        res2 = residual.reshape(-1, n_cols)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty_like(out)
    if x2.shape[0]:
        block = triton.next_power_of_2(n_cols)
        launch(
            _rms_norm_kernel, (x2.shape[0],), x.device,
            x2, res2 if res2 is not None else x2, weight, out, res_out if res_out is not None else out, n_cols,
            x2.stride(0), res2.stride(0) if res2 is not None else 0, out.stride(0),
            res_out.stride(0) if res_out is not None else 0, eps, offset,
            HAS_RESIDUAL=residual is not None, HAS_OFFSET=bool(offset), BLOCK=block,
            num_warps=4 if block <= 2048 else 8)
    return out.view(x.shape), (res_out.view(x.shape) if res_out is not None else None)


def rms_norm(x: torch.Tensor,  # [..., dim] bf16/fp16/fp32
             weight: torch.Tensor,  # [dim]
             eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm of the last dimension; a new tensor of x's shape and dtype."""
    return _launch(x, None, weight, eps, offset)[0]


def add_rms_norm(x: torch.Tensor,  # [..., dim]
                 residual: torch.Tensor,  # [..., dim], same dtype
                 weight: torch.Tensor, eps: float, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), in one pass."""
    out, res = _launch(x, residual, weight, eps, offset)
    return out, res


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * (offset + weight.float())).to(dtype)
    return weight * xf.to(dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return rms_norm_ref(s, weight, eps, offset), s
