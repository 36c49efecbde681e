"""act(gate) * up of a gated MLP in one kernel (Triton kernel + typed wrapper + torch reference).

The merged gate_up projection gives [n, 2 * I]; unfused, chunk + activation + multiply cost three kernels
and two intermediate tensors per layer. Rounding follows torch: the activation is computed in float32 and
rounded to the input dtype, then multiplied by `up` and rounded again.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.kernels.triton_compat import require_triton, tl, triton

__all__ = ["ACTIVATIONS", "act_and_mul", "act_and_mul_ref"]

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the activations of the supported families (Llama, Gemma 3)


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    if GELU_TANH:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))  # tanh(z) = 2 sigmoid(2z) - 1
    else:
        act = gate / (1.0 + tl.exp(-gate))
    y = act.to(up.dtype).to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(x: torch.Tensor,  # [n, 2 * I]: gate then up
                act: str) -> torch.Tensor:  # -> [n, I]
    require_triton("act_and_mul", x)
    if act not in ACTIVATIONS:
        raise ValueError(f"act_and_mul supports {ACTIVATIONS}, got {act!r}")
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [n, 2 * I], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    if n:
        block = min(1024, triton.next_power_of_2(inter))
        _act_and_mul_kernel[(n, math.ceil(inter / block))](x, out, inter, x.stride(0), out.stride(0),
                                                          GELU_TANH=act == "gelu_pytorch_tanh", BLOCK=block)
    return out


def act_and_mul_ref(x: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    a = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return a * up
