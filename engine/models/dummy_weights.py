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

from engine.model_config import ModelConfig
from engine.quantization import mxfp4


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
        if _mxfp4_experts(cfg, name):
            yield from _packed_experts(name, shape, device, std, gen)
            continue
        yield name, torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)


def _mxfp4_experts(cfg: ModelConfig, name: str) -> bool:
    """Whether `name` is a fused expert projection (transformers' [E, in, out]) that the config declares MXFP4."""
    module, _, param = name.rpartition(".")
    return param in ("gate_up_proj", "down_proj") and mxfp4.quantized(cfg.hf_config, module)


def _packed_experts(name: str, shape: torch.Size, device: torch.device, std: float, gen: torch.Generator
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """An MXFP4 checkpoint's `*_blocks` [E, out, in / 32, 16] and `*_scales` [E, out, in / 32] of random [E, in, out]
    weights, quantized one expert at a time (a 120b layer's experts in float32 at once would take 8.5 GB), so a
    benchmark of a packed model's shape holds and reads the packed bytes a real checkpoint gives it."""
    experts, fan_in, fan_out = shape
    blocks = torch.empty(experts, fan_out, fan_in // mxfp4.BLOCK, mxfp4.BLOCK // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(experts, fan_out, fan_in // mxfp4.BLOCK, dtype=torch.uint8, device=device)
    for e in range(experts):
        w = torch.empty(fan_out, fan_in, device=device).normal_(0.0, std, generator=gen)
        blocks[e], scales[e] = mxfp4.quantize(w)
    yield name + "_blocks", blocks
    yield name + "_scales", scales
