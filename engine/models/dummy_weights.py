"""Random weights for a model shape (load_format "dummy"), the same at every tensor-parallel size.

Each checkpoint tensor is drawn whole from a generator seeded by its name, on the device, and then goes through
the same weight loaders as a real checkpoint, which cut each rank's shard out of it. So rank r of a model split
over two GPUs holds exactly the rows or columns that a single GPU holds of the same tensor, and greedy outputs at
tensor-parallel size 2 can be checked against size 1 with shapes like Qwen3-8B that have no checkpoint here.
Drawing per shard instead (as a plain `normal_()` on each rank's parameters would) gives every size a different
model.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch
from transformers import AutoModelForCausalLM

from engine.config import ModelConfig


def checkpoint_shapes(cfg: ModelConfig) -> list[tuple[str, torch.Size]]:
    """(name, shape) of every tensor a checkpoint of `cfg` holds, read off the transformers model built on the
    meta device (no memory), in the checkpoint's own names (q_proj, not a fused qkv)."""
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(cfg.hf_config)
    # named_parameters drops tied duplicates: a tied lm_head is not listed, as it is not in a checkpoint.
    return [(name, p.shape) for name, p in hf_model.named_parameters()]


def dummy_weights(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, std: float = 0.02,
                  seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Random matrices (normal, `std`) for every tensor of two or more dimensions. Vectors (norm weights,
    biases) are not yielded: the model keeps the neutral values it was built with."""
    gen = torch.Generator(device=device)
    for name, shape in checkpoint_shapes(cfg):
        if len(shape) < 2:
            continue
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        yield name, torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
