"""The loader's quantization seam: which layers of a model hold quantized weights, and how they load and run them.

A checkpoint's config.json may carry a `quantization_config` whose `quant_method` names a format; the
`quantization` engine option may ask for one a checkpoint lacks (weights quantized at load). Each format registers
a QuantizationConfig factory here under its quant_method. Before the weights load, `quantize_model` asks the
config, for every quantizable module (the tensor-parallel linears of engine/models/layers.py, or any module with a
`quant_kind` attribute naming another kind, such as a mixture of experts), which QuantizedMethod holds its weights,
or None to leave it in the model's dtype. The method replaces the module's parameters with what the checkpoint
stores (or, quantizing at load, quantizes them after they load), and the module's forward calls `method.apply`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

QUANT_ATTR = "quant_method"  # a module's QuantizedMethod, None where it holds plain weights


class QuantizedMethod:
    """How one quantized module holds its weights, takes a checkpoint's tensors and computes its forward."""

    format: str = "?"  # how /health and the start-up line name what the module holds, e.g. "fp8 block 128x128"
    # True: the checkpoint holds the model's dtype; the module loads it as is and `process_after_loading`
    # quantizes it (the `quantization` option on an unquantized checkpoint, random weights of a quantized shape).
    quantize_at_load: bool = False

    def create_weights(self, layer: nn.Module) -> None:
        """Replace the module's parameters by the quantized ones the checkpoint fills (not with quantize_at_load)."""

    def loaded_tensor(self, layer: nn.Module, param_name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        """A checkpoint tensor for the module's parameter `param_name` (not the weight or bias), as the parameter's
        rows: `rows` is the weight's unsharded row count (of this fused part); the module's loader then cuts this
        rank's rows (a column-parallel module) or column groups (row-parallel) out of it, as it does the weight's.
        The default: unchanged."""
        return tensor

    def process_after_loading(self, layer: nn.Module) -> None:
        """Anything to do once every tensor of the module is in (quantize_at_load quantizes here)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class QuantizationConfig:
    """One checkpoint's (or one option's) quantization: which modules take which method."""

    quant_method: str = "?"

    def method_for(self, prefix: str, module: nn.Module, checkpoint_names: list[str]) -> QuantizedMethod | None:
        """The method of the module at `prefix`, whose weights the checkpoint stores under `checkpoint_names`
        (several for a fused module: q_proj, k_proj, v_proj); None: the module stays in the model's dtype."""
        raise NotImplementedError

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as the model's parameter is called (a format's own scale name, say)."""
        return name


_FACTORIES: dict[str, Callable[[dict[str, Any], str | None], QuantizationConfig]] = {}


def register_quantization(quant_method: str) -> Callable:
    """Register `factory(quantization_config: dict, load_format_or_option: str | None) -> QuantizationConfig` for
    checkpoints whose quantization_config names `quant_method`."""

    def wrap(factory: Callable[[dict[str, Any], str | None], QuantizationConfig]) -> Callable:
        _FACTORIES[quant_method] = factory
        return factory

    return wrap


# The values of the `quantization` option: a format a checkpoint in the model's dtype is quantized to at load.
QUANTIZE_AT_LOAD = ("fp8",)


def quantization_config(hf_config: Any, option: str | None = None,
                        load_format: str = "auto") -> QuantizationConfig | None:
    """The quantization of a model: its checkpoint's quantization_config, or `option` (the `quantization` engine
    option) for a checkpoint without one; None: none. A config this engine cannot run is a ValueError naming what."""
    _register_builtin()
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    if option is not None and option not in QUANTIZE_AT_LOAD:
        raise ValueError(f"quantization {option!r} is not supported; choose one of {list(QUANTIZE_AT_LOAD)} "
                         "(a checkpoint's own quantization_config needs no option)")
    if raw is None:
        if option is None:
            return None
        from engine.quantization.fp8 import Fp8Config

        return Fp8Config(block=None, ignore=(), quantize_at_load=True)
    method = raw.get("quant_method")
    if method not in _FACTORIES:
        raise ValueError(f"the checkpoint's quantization_config has quant_method {method!r}, which this engine "
                         f"cannot load; supported: {sorted(_FACTORIES)}")
    if option is not None and option != method and not (option == "fp8" and method == "compressed-tensors"):
        raise ValueError(f"quantization {option!r} was asked for, but the checkpoint is already quantized with "
                         f"{method!r}; leave the option unset")
    return _FACTORIES[method](raw, load_format)


def _register_builtin() -> None:
    import engine.quantization.compressed_tensors  # noqa: F401 - registers "compressed-tensors"
    import engine.quantization.fp8  # noqa: F401 - registers "fp8"
    import engine.quantization.mxfp4  # noqa: F401 - registers "mxfp4"


def quantize_model(model: nn.Module, qcfg: QuantizationConfig | None) -> None:
    """Give every quantizable module of `model` the method `qcfg` picks for it, before the weights load; record
    the config on the model (`model.quant_config`) for the loader's checkpoint names."""
    model.quant_config = qcfg
    if qcfg is None:
        return
    packed: dict[str, list[str]] = {}
    for ckpt_part, (ours, _) in getattr(model, "packed_modules", {}).items():
        packed.setdefault(ours, []).append(ckpt_part)
    for prefix, module in model.named_modules():
        if not hasattr(module, "quant_kind"):  # the parallel linears say "linear", a mixture of experts its own
            continue
        head, _, leaf = prefix.rpartition(".")
        names = [f"{head}.{p}" if head else p for p in packed.get(leaf, [leaf])]
        method = qcfg.method_for(prefix, module, names)
        setattr(module, QUANT_ATTR, method)
        if method is not None and not method.quantize_at_load:
            method.create_weights(module)


def process_after_loading(model: nn.Module) -> None:
    """Each quantized module's step after its tensors load (quantizing at load happens here); on a GPU, the
    memory the model's dtype held is given back so the KV-cache budget, read from free memory, gets it."""
    for module in model.modules():
        method = getattr(module, QUANT_ATTR, None)
        if method is not None:
            method.process_after_loading(module)
    if any(p.is_cuda for p in model.parameters()):
        torch.cuda.empty_cache()


def is_quantized(model: nn.Module) -> bool:
    return any(getattr(m, QUANT_ATTR, None) is not None for m in model.modules())


def weights_summary(model: nn.Module) -> dict[str, Any]:
    """What the model holds: {"bytes": all parameters and buffers, "format": the formats, e.g.
    "fp8 block 128x128 + bfloat16"}: for the start-up line and /health."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    methods = [getattr(m, QUANT_ATTR, None) for m in model.modules()]
    formats = sorted({method.format for method in methods if method is not None})
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() > 1), None)
    plain = str(dtype).removeprefix("torch.") if dtype is not None else "?"
    return {"bytes": total, "format": " + ".join([*formats, plain])}


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether a checkpoint module name is among `patterns`: "re:<regex>" matches from the start (the
    compressed-tensors form); a plain name matches itself, or as a whole dotted part of the name ("lm_head",
    "mlp.down_proj", "model.layers.0")."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.endswith("." + p) or name.startswith(p + ".") or f".{p}." in f".{name}.":
            return True
    return False


def all_or_none(prefix: str, names: list[str], patterns: tuple[str, ...]) -> bool:
    """Whether the module at `prefix` is left unquantized: every checkpoint part of a fused module, or none, must
    be (a fused matmul holds one format)."""
    hits = [matches(n, patterns) for n in names]
    if any(hits) and not all(hits):
        raise ValueError(f"the quantization config leaves {[n for n, h in zip(names, hits) if h]} unquantized but "
                         f"not {[n for n, h in zip(names, hits) if not h]}, which {prefix} runs as one matmul")
    return all(hits)
