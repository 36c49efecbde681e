"""Small host values to the device without waiting for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes the stream, so on the
step path it waits for every kernel queued before it: a draft loop still running, or the verify forward. The
step then pays the host's remaining work with the GPU idle. Staging the values in pinned memory and copying
with non_blocking=True queues the copy behind those kernels instead; PyTorch's pinned-memory allocator keeps the
staging buffer alive until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
    """A tensor of `values` on `device`, queued on the current stream (no host sync on CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def tensor_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, queued on the current stream (no host sync on CUDA): `to_device` for a tensor
    already built on the host."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":  # a device tensor (a tree's drafts fed back) stays put
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
