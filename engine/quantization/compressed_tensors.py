"""compressed-tensors checkpoints (quant_method "compressed-tensors", format "float-quantized": the *-FP8-dynamic
releases): FP8 weights with a weight_scale a row (strategy "channel") or a tensor ("tensor"), activations quantized
per token at run time ("dynamic": true), the modules in `ignore` left in the model's dtype.

Read from the config: `config_groups` (each a `weights` and `input_activations` scheme and the `targets` it covers:
"Linear", a module name, or "re:<regex>"), `ignore`, `format`. Activations stay in the model's dtype here (no
per-token quantization: more exact than the checkpoint asks, and the dequantizing reference matches it); a static
activation scale (`input_activations.dynamic` false), integer weights and group strategies are refused by name.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.quantization import QuantizedMethod, all_or_none, matches, register_quantization
from engine.quantization.fp8 import Fp8Config, Fp8LinearMethod

_FORMATS = ("float-quantized", "naive-quantized")
_STRATEGIES = ("channel", "tensor")


class CompressedTensorsConfig(Fp8Config):
    quant_method = "compressed-tensors"

    def __init__(self, targets: tuple[str, ...], ignore: tuple[str, ...], quantize_at_load: bool,
                 per_tensor: bool) -> None:
        super().__init__(None, ignore, quantize_at_load, scale_name="weight_scale", per_tensor=per_tensor)
        self.targets = targets

    def method_for(self, prefix: str, module: nn.Module, checkpoint_names: list[str]) -> QuantizedMethod | None:
        if getattr(module, "quant_kind", "linear") != "linear" or all_or_none(prefix, checkpoint_names, self.ignore):
            return None
        method = Fp8LinearMethod(None, self.quantize_at_load, self.per_tensor)
        if "Linear" in self.targets:
            return method
        hits = [matches(n, self.targets) for n in checkpoint_names]
        if any(hits) and not all(hits):
            raise ValueError(f"compressed-tensors targets quantize part of {prefix} ({checkpoint_names}), which runs "
                             "as one matmul")
        return method if all(hits) else None


@register_quantization("compressed-tensors")
def compressed_tensors_config(raw: dict[str, Any], load_format: str | None) -> CompressedTensorsConfig:
    fmt = raw.get("format")
    if fmt not in _FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported; this engine loads {list(_FORMATS)} "
                         "FP8 weights")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    targets: list[str] = []
    strategies: set[str] = set()
    for name, group in groups.items():
        where = f"compressed-tensors config_groups.{name}"
        if not isinstance(group, dict):
            raise ValueError(f"{where} must be a mapping, got {group!r}")
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ValueError(f"{where}.weights: only 8-bit float weights (FP8) are supported, got type "
                             f"{w.get('type')!r} num_bits {w.get('num_bits')!r}")
        if w.get("strategy") not in _STRATEGIES:
            raise ValueError(f"{where}.weights.strategy {w.get('strategy')!r} is not supported; use one of "
                             f"{list(_STRATEGIES)}")
        if w.get("symmetric") is False or w.get("dynamic"):
            raise ValueError(f"{where}.weights must be symmetric and static (a stored weight_scale)")
        act = group.get("input_activations")
        if act is not None and not act.get("dynamic", False):
            raise ValueError(f"{where}.input_activations: static activation scales (input_scale) are not supported; "
                             "only dynamic activations")
        if group.get("output_activations") is not None:
            raise ValueError(f"{where}.output_activations are not supported")
        targets += list(group.get("targets") or [])
        strategies.add(w["strategy"])
    if not targets:
        raise ValueError("compressed-tensors config_groups name no targets")
    return CompressedTensorsConfig(tuple(targets), tuple(raw.get("ignore") or ()), load_format == "dummy",
                                   per_tensor=strategies == {"tensor"})
