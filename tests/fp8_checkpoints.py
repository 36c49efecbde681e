"""FP8 checkpoints of tiny random HF models, in each format a release ships, and the float32 models they hold.

`write_fp8_checkpoint` quantizes a model's linear weights (every q/k/v/o/gate/up/down projection, unless a pattern
of `ignore` names it) into one format, writes the safetensors and a config.json whose quantization_config says so,
and returns the HF transformers model of the dequantized float32 weights: the oracle an engine loading the
checkpoint must equal. The dequantization here is written out block by block, apart from the engine's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PretrainedConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = ("fp8-block", "ct-channel", "ct-tensor")


def quantize_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> FP8 [N, K] and a float32 scale per bn x bk block [ceil(N/bn), ceil(K/bk)] (edge blocks partial)."""
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    q = torch.empty(n, k, dtype=FP8)
    s = torch.empty(nb, kb)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s[i, j] = blk.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / s[i, j]).to(FP8)
    return q, s


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            out[rows, cols] = q[rows, cols].float() * s[i, j]
    return out


def quantize_rows(w: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> FP8 and a scale a row [N, 1] (or one [1] for the tensor)."""
    w = w.float()
    s = (w.abs().max().reshape(1) if per_tensor else w.abs().amax(dim=1, keepdim=True)).clamp(min=1e-12) / FP8_MAX
    return (w / s).to(FP8), s


def quantization_config(fmt: str, block: tuple[int, int], ignore: list[str]) -> dict:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block), "modules_to_not_convert": ignore}
    strategy = "channel" if fmt == "ct-channel" else "tensor"
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ignore, "config_groups": {"group_0": {
                "targets": ["Linear"], "output_activations": None,
                "weights": {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True,
                            "dynamic": False},
                "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True,
                                      "dynamic": True}}}}


def is_ignored(name: str, ignore: list[str]) -> bool:
    import re

    return any(re.match(p[3:], name) if p.startswith("re:")
               else (name == p or name.endswith("." + p) or name.startswith(p + ".")) for p in ignore)


def write_fp8_checkpoint(model: torch.nn.Module, config: PretrainedConfig, path: Path, fmt: str,
                         block: tuple[int, int] = (32, 32), ignore: list[str] | None = None,
                         plain_dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Write `model` quantized into `fmt` (FORMATS) at `path`; the tensors left unquantized are stored in
    `plain_dtype` (as releases store them). Returns the HF model of exactly the values written, in float32."""
    ignore = list(ignore or [])
    tensors: dict[str, torch.Tensor] = {}
    oracle: dict[str, torch.Tensor] = {}
    for name, w in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS and not is_ignored(module, ignore):
            if fmt == "fp8-block":
                q, s = quantize_blocks(w, *block)
                tensors[f"{module}.weight_scale_inv"] = s
                oracle[name] = dequantize_blocks(q, s, *block)
            else:
                q, s = quantize_rows(w, per_tensor=fmt == "ct-tensor")
                tensors[f"{module}.weight_scale"] = s
                oracle[name] = q.float() * s
            tensors[name] = q
        else:
            if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
                continue
            tensors[name] = w.to(plain_dtype).contiguous()
            oracle[name] = tensors[name].float()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    cfg = config.to_dict()
    cfg["quantization_config"] = quantization_config(fmt, block, ignore)
    cfg["architectures"] = [type(model).__name__]
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    hf = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    hf.load_state_dict(oracle, strict=False)
    hf.generation_config.eos_token_id = None
    return hf
