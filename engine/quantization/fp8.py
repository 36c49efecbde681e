"""FP8 (float8_e4m3fn) linear weights: quant_method "fp8" checkpoints (a float32 weight_scale_inv a 128 x 128 block,
the Qwen3-*-FP8 and DeepSeek format; or one weight_scale a tensor), the per-channel and per-tensor schemes
compressed-tensors describes (engine/quantization/compressed_tensors.py), and per-channel quantization at load.

Every scheme is held the same way: the weight in FP8 [N, K] and its scales as one row per weight row, float32
[N, G], each covering `scale_group_k` columns (128 for blocks, K for one scale a row). A block's scale repeats in
each of its 128 rows (3% of the FP8 bytes), so the scales of a fused module (q, k and v) and of a tensor-parallel
shard are cut out exactly as the weight's rows are, whatever a part's size (a 64-row k of two heads, a block split
between ranks). A row-parallel shard splits K, and must keep whole blocks. Activations stay in the model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.quantization import QuantizationConfig, QuantizedMethod, all_or_none, register_quantization
from engine.quantization.fp8_linear import fp8_linear, steps_within_groups

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (FP8 weight [N, K], float32 scales as a checkpoint stores them: [ceil(N/bn), ceil(K/bk)] for
    blocks (partial edge blocks included), [N, 1] one a row), with w ~= weight * scale."""
    n, k = w.shape
    w = w.float()
    if block is None:
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX  # [N, 1]
    else:
        bn, bk = block
        nb, kb = -(-n // bn), -(-k // bk)
        padded = torch.zeros(nb * bn, kb * bk, device=w.device)
        padded[:n, :k] = w.abs()
        scale = padded.view(nb, bn, kb, bk).amax(dim=(1, 3)) / FP8_MAX  # [nb, kb]
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / expand_scale(scale, n, k, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def expand_scale(scale: torch.Tensor, n: int, k: int, block: tuple[int, int] | None) -> torch.Tensor:
    """Checkpoint scales -> one a weight element [N, K]."""
    if block is None:
        return scale.reshape(-1, 1).expand(n, k) if scale.numel() > 1 else scale.reshape(1, 1).expand(n, k)
    bn, bk = block
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequantize_rows(weight: torch.Tensor, scale_rows: torch.Tensor, group_k: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 [N, K] and its held scales [N, G] (each over group_k columns) -> [N, K] in `dtype`."""
    s = scale_rows.repeat_interleave(group_k, dim=1)[:, :weight.shape[1]]
    return (weight.float() * s).to(dtype)


class Fp8LinearMethod(QuantizedMethod):
    """A tensor-parallel linear with an FP8 weight [N, K] and float32 scale rows [N, G] (module docstring)."""

    def __init__(self, block: tuple[int, int] | None, quantize_at_load: bool = False,
                 per_tensor: bool = False) -> None:
        self.block = block
        self.quantize_at_load = quantize_at_load
        # per_tensor: the checkpoint's one scale a tensor, held as a scale a row like a per-channel one.
        scheme = "per-tensor" if per_tensor and not quantize_at_load else "per-channel"
        self.format = f"fp8 block {block[0]}x{block[1]}" if block else f"fp8 {scheme}"

    def create_weights(self, layer: nn.Module) -> None:
        n, k = layer.weight.shape
        group_k = self._group_k(layer, k)
        dev = layer.weight.device
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE, device=dev), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(n, -(-k // group_k), dtype=torch.float32, device=dev),
                                          requires_grad=False)
        layer.scale_group_k = group_k

    def _group_k(self, layer: nn.Module, k: int) -> int:
        if self.block is None:
            return k
        bk = self.block[1]
        if getattr(layer, "in_per_rank", None) is not None and layer.tp_size > 1 and k % bk:
            raise ValueError(f"a tensor-parallel shard of {k} input features splits a {bk}-wide FP8 scale block; "
                             f"choose a tensor-parallel size that keeps {bk}-column blocks whole")
        return bk

    def loaded_tensor(self, layer: nn.Module, param_name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        if param_name != "weight_scale":
            return tensor
        tensor = tensor.float()
        if self.block is not None:
            bn = self.block[0]
            if tensor.dim() != 2 or tensor.shape[0] != -(-rows // bn):
                raise ValueError(f"block scales of shape {tuple(tensor.shape)} do not fit a weight of {rows} rows in "
                                 f"{bn}-row blocks")
            return tensor.repeat_interleave(bn, 0)[:rows]
        if tensor.numel() == rows:  # one scale a row (compressed-tensors "channel": [N, 1])
            return tensor.reshape(rows, 1)
        if tensor.numel() == 1:  # one a tensor: each row of it takes that scale (q, k, v keep their own)
            return tensor.reshape(1, 1).expand(rows, 1)
        raise ValueError(f"weight scales of shape {tuple(tensor.shape)} fit neither a scale a row ({rows}) nor one "
                         "a tensor")

    def process_after_loading(self, layer: nn.Module) -> None:
        if not self.quantize_at_load:
            return
        w = layer.weight.data
        q, scale = quantize_fp8(w, self.block)
        n, k = w.shape
        group_k = self._group_k(layer, k)
        rows = scale if self.block is None else scale.repeat_interleave(self.block[0], 0)[:n]
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(rows.contiguous(), requires_grad=False)
        layer.scale_group_k = group_k

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, layer.scale_group_k, bias)


def folded_scales(layer: nn.Module) -> dict[str, Any]:
    """What the few-row products (engine/kernels/small_m/linear.py) take besides a linear's weight: an FP8 weight's
    scale rows and their group width, nothing for a weight in the model's dtype."""
    if isinstance(getattr(layer, "quant_method", None), Fp8LinearMethod):
        return {"scale": layer.weight_scale, "group_k": layer.scale_group_k}
    return {}


def folds_quantized(model: nn.Module) -> bool:
    """Whether the few-row products can read every quantized weight of `model`: FP8 linears whose scale groups the
    kernel steps through (a scale a row, or groups of a multiple of 16 columns). Other formats (none today) run
    through their own kernels, the model's layers unfolded."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if not isinstance(method, Fp8LinearMethod):
            return False
        if not steps_within_groups(module.weight_scale, module.scale_group_k):
            return False
    return True


class Fp8Config(QuantizationConfig):
    """FP8 weights for every linear but those the config leaves out."""

    quant_method = "fp8"

    def __init__(self, block: tuple[int, int] | None, ignore: tuple[str, ...], quantize_at_load: bool = False,
                 scale_name: str = "weight_scale_inv", per_tensor: bool = False) -> None:
        self.block = block
        self.ignore = ignore
        self.quantize_at_load = quantize_at_load
        self.scale_name = scale_name
        self.per_tensor = per_tensor

    def method_for(self, prefix: str, module: nn.Module, checkpoint_names: list[str]) -> QuantizedMethod | None:
        if getattr(module, "quant_kind", "linear") != "linear" or all_or_none(prefix, checkpoint_names, self.ignore):
            return None
        return Fp8LinearMethod(self.block, self.quantize_at_load, self.per_tensor)

    def checkpoint_name(self, name: str) -> str:
        suffix = "." + self.scale_name
        return name[:-len(suffix)] + ".weight_scale" if name.endswith(suffix) else name


@register_quantization("fp8")
def fp8_config(raw: dict[str, Any], load_format: str | None) -> Fp8Config:
    """quant_method "fp8": weight_block_size [bn, bk] (scales weight_scale_inv a block), or none (one weight_scale a
    tensor); activation_scheme dynamic; modules_to_not_convert / ignored_layers stay in the model's dtype."""
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 quantization_config fmt {fmt!r} is not supported (only e4m3: float8_e4m3fn)")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"fp8 activation_scheme {raw.get('activation_scheme')!r} is not supported: static "
                         "activation scales are not read (only activation_scheme dynamic)")
    block = raw.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"fp8 weight_block_size must be two positive integers [rows, columns], got {block!r}")
        block = (int(block[0]), int(block[1]))
    ignore = tuple(raw.get("modules_to_not_convert") or ()) + tuple(raw.get("ignored_layers") or ())
    return Fp8Config(block, ignore, quantize_at_load=load_format == "dummy",
                     scale_name="weight_scale_inv" if block is not None else "weight_scale", per_tensor=block is None)
