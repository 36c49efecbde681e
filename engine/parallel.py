"""Tensor-parallel process group of the current model and its collectives.

One process runs one rank of one model (target or draft). With size 1 every collective is the identity,
so the single-process engine pays nothing for the sharding-ready layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise minimum over ranks, in place (ranks agreeing on a size each computed alone)."""
        if self.size == 1:
            return x
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


_TP = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _TP


def set_tp_group(group: TensorParallelGroup) -> None:
    """Called once per process by the worker that owns a rank, before the model is built."""
    global _TP
    _TP = group


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator
