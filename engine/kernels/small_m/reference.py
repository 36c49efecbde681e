"""The few-row products (engine/kernels/small_m/linear.py) in plain torch: their references, and the cuBLAS form the
engine takes where a GPU model's measured table says CUBLAS (small_m_tiles.CUBLAS): the product through cuBLAS, its
prologue or epilogue a kernel of its own (the engine's norm and activation kernels, a plain add). Both round as the
unfused layers do."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.activation import act_and_mul, act_and_mul_ref
from engine.kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_ref

__all__ = ["PROLOGUE_NONE", "PROLOGUE_NORM", "PROLOGUE_ACT", "unfused_product", "norm_linear_ref", "act_linear_ref",
           "linear_add_ref", "linear_add_ss_ref"]

PROLOGUE_NONE, PROLOGUE_NORM, PROLOGUE_ACT = 0, 1, 2  # the kernel's PROLOGUE


def unfused_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: int,
                    residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float, offset: float,
                    act: str, add: torch.Tensor | None, glu: bool = False, ss_out: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """small_m_linear's _launch through cuBLAS: (output, residual sum or None, sums of squares [1, rows] or None).
    A norm given its row statistics (row_ss) recomputes them here: the same values up to float32 summation order."""
    res_out = None
    if prologue == PROLOGUE_NORM:
        if residual is not None:
            x, res_out = add_rms_norm(x, residual, norm_weight, eps, offset)
        else:
            x = rms_norm(x, norm_weight, eps, offset)
    elif prologue == PROLOGUE_ACT:
        x = act_and_mul(x, act)
    out = F.linear(x, weight, bias)
    if glu:
        out = act_and_mul(out, act)
    if add is not None:
        out = out + add
    ss = out.float().square().sum(-1)[None] if ss_out else None
    return out, res_out, ss


def norm_linear_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    offset: float, weight: torch.Tensor, bias: torch.Tensor | None = None, glu: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual if residual is not None else x
    out = F.linear(rms_norm_ref(s, norm_weight, eps, offset), weight, bias)
    return (act_and_mul_ref(out, glu) if glu is not None else out), s


def act_linear_ref(gate_up: torch.Tensor, act: str, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(act_and_mul_ref(gate_up, act), weight)


def linear_add_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   add: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight, bias) + add


def linear_add_ss_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      add: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear_add's output, its rows' sums of squares [1, rows] float32: one column tile)."""
    out = linear_add_ref(x, weight, bias, add)
    return out, out.float().square().sum(-1)[None]
