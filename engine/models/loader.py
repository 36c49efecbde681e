"""Build a model for a ModelConfig and load its safetensors weights (sharded for tensor parallelism)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_config import ModelConfig
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.quantization import process_after_loading, quantization_config, quantize_model

logger = logging.getLogger("specserve")

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {"llama": LlamaForCausalLM, "gemma3": Gemma3ForCausalLM,
                                                    "gpt_oss": GptOssForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM}

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Prefixes that wrap the text model in some checkpoints (Gemma 3 multimodal, older exports).
_PREFIX_REWRITES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                    ("language_model.lm_head.", "lm_head."))


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def checkpoint_tensor(path: Path, name: str) -> torch.Tensor:
    """One tensor of a checkpoint directory by its name (wrapping prefixes rewritten as for loading), read alone."""
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for stored in sf.keys():
                if _rewrite_prefix(stored) == name:
                    return sf.get_tensor(stored)
    raise ValueError(f"{path} has no tensor {name!r}")


# A distilled draft (engine/distill) may leave out tensors it shares, frozen, with its target (the embedding
# table, and an untied lm_head): its config.json names the model they come from and the checkpoint names taken.
# Storing them again would cost a 135M target's draft 57 MB of its 25 MB budget.
SHARED_FROM_KEY = "specserve_shared_embeddings_from"  # bundled name, or path (relative = to the draft directory)
SHARED_TENSORS_KEY = "specserve_shared_tensors"  # checkpoint names; default: the embedding table only
DEFAULT_SHARED_TENSORS = ("model.embed_tokens.weight",)


def model_weights(cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's own safetensors, then any tensors it shares with the model its config names (see above)."""
    own: set[str] = set()
    for name, tensor in iter_safetensors(cfg.path):
        own.add(name)
        yield name, tensor
    source = getattr(cfg.hf_config, SHARED_FROM_KEY, None)
    if not source:
        return
    from engine.models.source import BUNDLED_MODELS, resolve_model  # lazy: only shared-embedding drafts need it

    source = str(source)
    if source not in BUNDLED_MODELS and not Path(source).expanduser().is_absolute():
        source = str(cfg.path / source)
    wanted = set(getattr(cfg.hf_config, SHARED_TENSORS_KEY, None) or DEFAULT_SHARED_TENSORS) - own
    found: set[str] = set()
    for f in sorted(resolve_model(source).path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                canonical = _rewrite_prefix(name)
                if canonical in wanted:
                    found.add(canonical)
                    yield canonical, sf.get_tensor(name)
    if wanted - found:
        raise ValueError(f"{cfg.path} shares {sorted(wanted - found)} with {source}, which has no such tensors; "
                         "was the draft distilled from another model?")


def _rewrite_prefix(name: str) -> str:
    for old, new in _PREFIX_REWRITES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                weights: Iterator[tuple[str, torch.Tensor]] | None = None,
                load_format: str = "auto", quantization: str | None = None) -> LlamaForCausalLM:
    """Instantiate the model on `device` in `dtype` and load every parameter; a checkpoint that leaves
    a parameter unset, or has a tensor of the wrong shape, is an error (never silently random).
    load_format "dummy" asks for random weights instead (benchmarks of model shapes: the directory needs only
    a config.json). Quantized layers (engine/quantization) follow the checkpoint's quantization_config, or
    `quantization` (a format to quantize a checkpoint in the model's dtype to, at load)."""
    cls = MODEL_CLASSES[cfg.family]
    qcfg = quantization_config(cfg.hf_config, quantization, load_format)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg)
            quantize_model(model, qcfg)
    finally:
        torch.set_default_dtype(prev)
    if load_format == "dummy":
        from engine.models.dummy_weights import dummy_weights

        # Vectors are left out of the random weights: norms and biases keep their neutral built values.
        load_weights(model, dummy_weights(cfg, device, dtype), allow_missing_vectors=True)
    elif load_format == "auto":
        load_weights(model, weights if weights is not None else model_weights(cfg))
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    process_after_loading(model)
    return model.eval()


def load_weights(model: LlamaForCausalLM, weights: Iterator[tuple[str, torch.Tensor]],
                 allow_missing_vectors: bool = False) -> None:
    """Copy checkpoint tensors into the model through each layer's weight loader (which takes this rank's
    shard). Every parameter must be set, except, with allow_missing_vectors, one-dimensional ones."""
    params = dict(model.named_parameters(remove_duplicate=False))
    owners = {name: mod for mod_name, mod in model.named_modules()
              for name in (f"{mod_name}.{p}" if mod_name else p for p, _ in mod.named_parameters(recurse=False))}
    loaded: set[str] = set()
    qcfg = getattr(model, "quant_config", None)
    for name, tensor in weights:
        name = _rewrite_prefix(name)
        if qcfg is not None:
            name = qcfg.checkpoint_name(name)
        if "rotary_emb" in name or name.endswith(".inv_freq"):
            continue
        if name == "lm_head.weight" and model.tie_word_embeddings:
            continue  # tied: the embedding provides it
        target, shard = name, None
        # MoE models: a checkpoint tensor per expert lands in one stacked parameter (the model maps the name).
        mapped = model.checkpoint_target(name) if hasattr(model, "checkpoint_target") else None
        if mapped is not None:
            target, shard = mapped
        else:
            for ckpt_part, (ours, shard_id) in model.packed_modules.items():
                if f".{ckpt_part}." in name:
                    target, shard = name.replace(f".{ckpt_part}.", f".{ours}."), shard_id
                    break
        if target not in params:
            if name.startswith("model.vision_tower") or name.startswith("model.multi_modal_projector"):
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}; "
                             "do the weights fit the config?")
        param = params[target]
        loader = getattr(owners[target], "weight_loader", None)
        if (tensor.dtype in FP8_DTYPES) != (param.dtype in FP8_DTYPES):
            # A plain cast would drop (or never apply) the scales: the config and the tensors disagree.
            raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} where the model holds {param.dtype}; "
                             "does the config's quantization_config (its ignore list) fit the weights?")
        try:
            if loader is not None:
                loader(param, tensor.to(param.dtype), shard)
            elif param.shape != tensor.shape:
                raise ValueError(f"weight shape {tuple(tensor.shape)} does not fit the model's {tuple(param.shape)}")
            else:
                param.data.copy_(tensor)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        loaded.add(target if shard is None else f"{target}#{shard}")
    expected = set()
    for name, m in owners.items():
        if hasattr(m, "out_sizes") and name.endswith(("weight", "weight_scale")):
            expected |= {f"{name}#{i}" for i in range(len(m.out_sizes))}
        elif hasattr(m, "kv_replicas") and name.endswith(("weight", "bias", "weight_scale")):
            expected |= {f"{name}#{s}" for s in "qkv"}
        elif hasattr(m, "checkpoint_shards") and m.checkpoint_shards(name.rsplit(".", 1)[1]) is not None:
            expected |= {f"{name}#{s}" for s in m.checkpoint_shards(name.rsplit(".", 1)[1])}  # MoE experts
        else:
            expected.add(name)
    if model.tie_word_embeddings:
        expected.discard("lm_head.weight")
    # A parameter loaded whole covers its shards (MoE experts stacked in the checkpoint, not stored per expert).
    missing = sorted(m for m in expected - loaded if m.split("#")[0] not in loaded)
    if allow_missing_vectors:
        missing = [m for m in missing if params[m.split("#")[0]].dim() >= 2]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors the config needs, e.g. {missing[:4]}; "
                         "do the weights fit the config?")
