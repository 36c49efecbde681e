"""Guarded Triton import shared by the kernel modules.

CPU-only installs may lack Triton: the kernel modules must still import (their torch reference functions
serve tests and the CPU engine), so they take `triton` and `tl` from here. Without Triton, `triton.jit`
leaves the kernel a plain function that is never launched and `tl.constexpr` is a placeholder for the
kernels' annotations; the typed wrappers call `require_triton` before launching.

Triton's interpreter (TRITON_INTERPRET=1, read when triton is first imported) runs the same kernels on CPU
tensors; `interpreting()` says whether it is active.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: only the torch references are usable
    HAS_TRITON = False
    triton = SimpleNamespace(jit=lambda fn=None, **_: fn if fn is not None else (lambda f: f),
                             cdiv=lambda a, b: -(-a // b), next_power_of_2=lambda n: 1 << max(0, n - 1).bit_length())
    tl = SimpleNamespace(constexpr=object)


def interpreting() -> bool:
    """True when kernels run under Triton's interpreter (on CPU tensors)."""
    if not HAS_TRITON:
        return False
    # The standard library's @jit functions were built when triton was imported; they are interpreter
    # objects only if TRITON_INTERPRET=1 was set by then, which is what makes interpreted kernels work.
    return type(tl.zeros).__name__ == "InterpretedFunction"


def require_triton(name: str, *tensors: torch.Tensor) -> None:
    """Raise an actionable error when `name` cannot launch on these tensors."""
    if not HAS_TRITON:
        raise RuntimeError(f"{name} needs triton, which is not installed: install it (pip install triton) or use "
                           f"{name}_ref, the torch reference")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{name}: tensors are on {device}; the Triton kernel needs CUDA tensors (or Triton's "
                         f"interpreter: set TRITON_INTERPRET=1 before triton is imported). Use {name}_ref on CPU.")

