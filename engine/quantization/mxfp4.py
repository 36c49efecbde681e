"""MXFP4 weights in the gpt-oss release format (OCP microscaling: blocks of 32 e2m1 values sharing one e8m0 scale).

A checkpoint stores a quantized [..., out, in] weight as two tensors:
- `*_blocks` [..., out, in / 32, 16] uint8: the 32 values of a block two a byte, the low nibble first
  (value 2j in bits 0-3 of byte j, value 2j + 1 in bits 4-7); a nibble is sign (bit 3), exponent (bits 1-2) and
  mantissa (bit 0) of an e2m1 number: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives;
- `*_scales` [..., out, in / 32] uint8: e8m0, the block's scale 2 ** (byte - 127).
Its config.json says so with quantization_config {"quant_method": "mxfp4", "modules_to_not_convert": [...]}: in the
gpt-oss release only the experts' gate_up and down projections are quantized.

The engine keeps these bytes as they are (a 120b model is 60.8 GiB packed) and dequantizes only what a step reads
(the MoE layer, engine/models/moe.py). Plain torch here: the format itself, for the reference path and for tests.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.quantization import QuantizationConfig, QuantizedMethod, register_quantization

QUANT_METHOD = "mxfp4"
BLOCK = 32  # values sharing one scale
SCALE_BIAS = 127  # e8m0 exponent bias

# e2m1 value of each nibble 0..15 (bit 3 the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] in `dtype` (exact in float32 and bfloat16:
    every e2m1 value times a power of two is representable, within bfloat16's exponent range)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks must be [..., G, {BLOCK // 2}] and scales [..., G], got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    lo, hi = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., G, 32], low nibble first
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - SCALE_BIAS)
    return values.flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., in] float (in a multiple of 32) -> (blocks [..., in / 32, 16] uint8, scales [..., in / 32] uint8).

    Each block's scale is 2 ** (floor(log2(max |w|)) - 2), so its largest value lands in [4, 8) before e2m1's
    ceiling of 6 clips it, and every value rounds to the nearest e2m1 number (OCP MX's rule). For writing test
    checkpoints and for models quantized here; dequantize(quantize(dequantize(b, s))) == dequantize(b, s)."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 quantizes rows of a multiple of {BLOCK} values, got {weight.shape[-1]}")
    w = weight.float().unflatten(-1, (-1, BLOCK))  # [..., G, 32]
    amax = w.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2, torch.zeros_like(amax))
    exp = exp.clamp(-SCALE_BIAS, 255 - SCALE_BIAS)
    scaled = torch.ldexp(w, -exp.to(torch.int32)[..., None])
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=w.device)
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # [..., G, 32] nearest magnitude
    code = code | ((scaled < 0).long() << 3)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp + SCALE_BIAS).to(torch.uint8)


def is_mxfp4(hf_config: PretrainedConfig) -> bool:
    """Whether the config declares MXFP4 weights (quantization_config's quant_method); any other quantization
    method is not this file's."""
    q = _quantization_config(hf_config)
    return q is not None and q.get("quant_method") == QUANT_METHOD


def quantized(hf_config: PretrainedConfig, module_name: str) -> bool:
    """Whether the module of this checkpoint name (e.g. "model.layers.3.mlp.experts") holds MXFP4 weights: the
    config declares MXFP4 and no pattern of modules_to_not_convert covers the module (patterns name a module or a
    prefix of it, with * wildcards, as the gpt-oss release writes them)."""
    if not is_mxfp4(hf_config):
        return False
    skipped = _quantization_config(hf_config).get("modules_to_not_convert") or []
    parts = module_name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return not any(fnmatch.fnmatchcase(p, pat) for pat in skipped for p in prefixes)


def _quantization_config(hf_config: PretrainedConfig) -> dict | None:
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    return q if isinstance(q, dict) else q.to_dict()


class Mxfp4Config(QuantizationConfig):
    """The loader's view of an MXFP4 checkpoint: in the gpt-oss release only the experts are MXFP4, and the MoE
    layer holds them packed itself (engine/models/moe.py, by `quantized` above), so every linear module (attention,
    router, unembedding) stays in the model's dtype."""

    quant_method = QUANT_METHOD

    def method_for(self, prefix: str, module: nn.Module, checkpoint_names: list[str]) -> QuantizedMethod | None:
        return None


@register_quantization(QUANT_METHOD)
def _mxfp4_config(raw: dict, load_format: str | None) -> Mxfp4Config:
    return Mxfp4Config()
