"""Guarded Triton import shared by the kernel modules.

CPU-only installs may lack Triton: the kernel modules must still import (their torch reference functions
serve tests and the CPU engine), so they take `triton` and `tl` from here. Without Triton, `triton.jit`
leaves the kernel a plain function that is never launched and `tl.constexpr` is a placeholder for the
kernels' annotations; the typed wrappers call `require_triton` before launching.

Triton's interpreter (TRITON_INTERPRET=1, read when triton is first imported) runs the same kernels on CPU
tensors; `interpreting()` says whether it is active.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
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

try:  # grid dependency control, for programmatic dependent launch (Hopper and later; recent Triton)
    from triton.language.extra import cuda as _tl_cuda
except ImportError:
    _tl_cuda = None

logger = logging.getLogger("specserve")
_PDL = {"enabled": True}  # switched off by set_pdl(False) or by a launch that failed with it


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



# ---- programmatic dependent launch --------------------------------------------------------------------------------
# A decode step at batch 1 is a chain of short kernels; launched as programmatic dependents (Hopper), each kernel is
# launched while the one before it finishes, instead of after, which hides most of a launch gap per kernel. Every
# kernel launched so calls wait_for_previous_kernel before it touches anything a kernel writes: after the wait the
# previous kernel has completed and its writes are visible (a kernel two back completed before the previous one could
# pass its own wait). Before the wait a kernel may read only what no kernel writes, such as a layer's weights (the
# few-row products request their first weight tile there): kernels further back may still be running then. Kernels
# launched the ordinary way (cuBLAS, torch) still wait for everything before them.


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    if USE_PDL:
        _tl_cuda.gdc_launch_dependents()  # the next kernel may launch once every program here has started
        _tl_cuda.gdc_wait()  # the previous kernel has completed; its writes are visible


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    if _tl_cuda is None or not hasattr(_tl_cuda, "gdc_wait") or torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}


@functools.lru_cache(maxsize=8)
def shared_memory(device: torch.device) -> int:
    """Shared memory a block may opt into on a CUDA device (0 where torch does not report it): what a kernel's
    pipelined tiles must fit in."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


def set_pdl(enabled: bool) -> None:
    """Launch the kernels that support it as programmatic dependents where the device allows (the default)."""
    _PDL["enabled"] = enabled


def pdl_options(device: torch.device) -> dict:
    """The launch options of a kernel that takes USE_PDL: dependent launch on CUDA devices of compute capability
    9.0 and later whose Triton supports it, unless switched off."""
    on = (HAS_TRITON and _PDL["enabled"] and device.type == "cuda" and not interpreting()
          and _pdl_supported(device.index if device.index is not None else torch.cuda.current_device()))
    return {"USE_PDL": on, "launch_pdl": on}


def launch(kernel: Callable, grid: tuple, device: torch.device, *args: object, **kwargs: object) -> None:
    """kernel[grid](*args, **kwargs) with the dependent-launch options of `device` (the kernel takes USE_PDL)."""
    opts = pdl_options(device)
    if not opts["USE_PDL"]:
        kernel[grid](*args, **kwargs, **opts)
        return
    try:
        kernel[grid](*args, **kwargs, **opts)
    except Exception:
        # A Triton or driver that rejects the dependent launch fails on a kernel's first call, which the engine makes
        # eagerly before any graph capture: from then on every kernel launches the ordinary way.
        logger.warning("programmatic dependent launch failed; launching kernels without it", exc_info=True)
        set_pdl(False)
        kernel[grid](*args, **kwargs, USE_PDL=False, launch_pdl=False)
