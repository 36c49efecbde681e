"""Building blocks shared by the model families: tensor-parallel linears with weight loaders,
vocab-parallel embedding and head, RMSNorm, rotary embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.kernels.attention.rotary import rotary_embedding, rotary_embedding_ref
from engine.kernels.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref, use_fused_kernels
from engine.parallel import divide, get_tp_group
from engine.quantization import QuantizedMethod


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks; the output stays sharded."""

    quant_kind = "linear"  # what engine/quantization asks a method for

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.out_per_rank = divide(out_features, self.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None
        # How quantized weights are held and multiplied (engine/quantization); None: plain weights.
        self.quant_method: QuantizedMethod | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        loaded = _as_rows(self, param, loaded, self.out_per_rank * self.tp_size)
        _check_unsharded(loaded, (self.out_per_rank * self.tp_size, *param.shape[1:]))
        shard = loaded.narrow(0, self.tp_rank * self.out_per_rank, self.out_per_rank)
        _copy_checked(param, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = [divide(s, self.tp_size, "output features") for s in out_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        idx = int(shard_id)  # type: ignore[arg-type]
        offset = sum(self.out_sizes[:idx])
        size = self.out_sizes[idx]
        loaded = _as_rows(self, param, loaded, size * self.tp_size)
        _check_unsharded(loaded, (size * self.tp_size, *param.shape[1:]))
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; heads are split across ranks (KV heads replicated if fewer)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp_size = get_tp_group().size
        self.num_heads = divide(num_heads, tp_size, "attention heads")
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        self.head_dim = head_dim
        total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, total, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q, self.tp_rank * q
        elif shard_id in ("k", "v"):
            offset = q if shard_id == "k" else q + kv
            size, start = kv, (self.tp_rank // self.kv_replicas) * kv
        else:
            raise ValueError(f"QKV shard must be q, k or v, got {shard_id!r}")
        full = q * self.tp_size if shard_id == "q" else kv * self.tp_size // self.kv_replicas
        loaded = _as_rows(self, param, loaded, full)
        _check_unsharded(loaded, (full, *param.shape[1:]))
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks; partial sums are all-reduced."""

    quant_kind = "linear"  # what engine/quantization asks a method for

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.in_per_rank = divide(in_features, self.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quant_method: QuantizedMethod | None = None  # as ColumnParallelLinear's

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if param.dim() == 1:  # bias is added once, after the reduction
            _copy_checked(param, loaded)
            return
        if param is getattr(self, "weight_scale", None):
            # Scale rows [N, G] over column groups: this rank's groups (whole ones, fp8.Fp8LinearMethod checks).
            loaded = _as_rows(self, param, loaded, param.shape[0])
            groups = param.shape[1]
            if loaded.shape[1] != 1:
                _check_unsharded(loaded, (param.shape[0], groups * self.tp_size))
                loaded = loaded.narrow(1, self.tp_rank * groups, groups)
            _copy_checked(param, loaded)
            return
        _check_unsharded(loaded, (param.shape[0], self.in_per_rank * self.tp_size))
        _copy_checked(param, loaded.narrow(1, self.tp_rank * self.in_per_rank, self.in_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            y = get_tp_group().all_reduce(self.quant_method.apply(self, x, None))
        else:
            y = get_tp_group().all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across ranks; each rank looks up its own range."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        _check_unsharded(loaded, (self.vocab_size, param.shape[1]))
        rows = loaded[self.start:self.start + self.per_rank]
        param.data.zero_()
        _copy_checked(param.data.narrow(0, 0, rows.shape[0]), rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        return get_tp_group().all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, sharded like the embedding; logits are gathered."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = F.linear(hidden, self.weight)
        logits = get_tp_group().all_gather_last_dim(logits)
        return logits[..., :self.vocab_size]


class RMSNorm(nn.Module):
    """RMSNorm in float32. Gemma stores (w - 1) and multiplies by (1 + w): `offset=1.0`."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x):
            return rms_norm(x, self.weight, self.eps, self.offset)
        return rms_norm_ref(x, self.weight, self.eps, self.offset)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): one kernel on the fused path."""
        if use_fused_kernels(x):
            return add_rms_norm(x, residual, self.weight, self.eps, self.offset)
        return add_rms_norm_ref(x, residual, self.weight, self.eps, self.offset)


def _check_unsharded(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """A checkpoint tensor must have the full (unsharded) shape the config implies, before slicing."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit the model's {tuple(expected)}")


def _as_rows(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, rows: int) -> torch.Tensor:
    """A quantized module's checkpoint tensor as its parameter's rows (scales a block -> a row, engine/quantization),
    so that the module's loader cuts and packs it as it does the weight; other tensors unchanged."""
    method = layer.quant_method
    if method is None or param is layer.weight or param is layer.bias:
        return loaded
    name = next(n for n, p in layer.named_parameters(recurse=False) if p is param)
    return method.loaded_tensor(layer, name, loaded, rows)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight shape {tuple(src.shape)} does not fit the model's {tuple(dst.shape)}")
    dst.data.copy_(src)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout, as HF) with cos/sin tables for all positions.

    inv_freq comes from transformers' own RoPE initialisers, so every scaling type it supports
    (linear, dynamic-free llama3, yarn, ...) matches the reference exactly.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int,
                 layer_type: str | None = None) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        if layer_type is not None and layer_type in params:
            params = params[layer_type]
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        else:
            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unsupported rope_type {rope_type!r}")
            if rope_type == "dynamic":
                raise ValueError("dynamic NTK RoPE depends on the sequence length; not supported")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        self.register_buffer("cos", (freqs.cos() * scaling), persistent=False)  # [max_positions, head_dim / 2]
        self.register_buffer("sin", (freqs.sin() * scaling), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, heads, head_dim], k: [num_tokens, kv_heads, head_dim]."""
        if use_fused_kernels(q):
            return rotary_embedding(positions, q, k, self.cos, self.sin)
        return rotary_embedding_ref(positions, q, k, self.cos, self.sin)
