"""The mixture-of-experts feed-forward layer shared by the MoE families (GPT-OSS, Qwen3-MoE): routing, the
experts' weights (in the model's dtype, or MXFP4 packed) and a plain-torch reference of the experts' forward.

Routing never syncs with the host, so a step with an MoE layer can sit in one CUDA graph: every shape below is
fixed by the number of tokens and the config (num_tokens * top_k routed rows), never by how many rows an expert
got. The routed rows are sorted by expert (a stable argsort of the flat expert ids) and each expert's run is
located by offsets made with scatter_add (bincount would read the largest id on the host to size its output), for a
grouped kernel to walk. The reference below does the same work without knowing the runs' lengths on the host: it
reads each routed row's expert weights by index (dequantizing packed ones there), so its cost per row is one
expert's weights, and it is chunked by a host-side bound of rows. On the kernel devices a step of few routed rows
(decode, a verify, the draft's steps) takes engine/kernels/moe/small_m.py instead, over the router's order, and a
step of more rows up to MAX_GRAPH_ROUTED_ROWS (or any step inside a graph capture) engine/kernels/moe/grouped.py,
over the rows grouped by expert on the device. A step of more rows outside a capture (a prefill chunk) reads the
runs' lengths on the host once and takes each touched expert's weights once for all its rows (`experts_grouped`):
the reference's cost per row would make a 2k-token prefill of gpt-oss-120b read 8192 experts' weights a layer. So
the runner captures mixed graphs of an MoE model only up to that many rows (max_graph_tokens below).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.moe.grouped import moe_experts_grouped
from engine.kernels.moe.router import route, route_ref, takes_tokens
from engine.kernels.moe.small_m import MAX_ROUTED_ROWS, moe_experts
from engine.kernels.rms_norm import use_fused_kernels
from engine.parallel import get_tp_group
from engine.quantization import mxfp4

# Gathered expert weights one chunk of the reference may hold (elements): bounds its memory on a prefill of
# thousands of tokens.
_REF_CHUNK_ELEMENTS = 1 << 24


@dataclass
class RoutedRows:
    """The step's (token, expert) pairs sorted by expert."""

    expert: torch.Tensor  # [num_tokens * top_k] int64; ascending
    token: torch.Tensor  # [num_tokens * top_k] int64; the token each row came from
    weight: torch.Tensor  # [num_tokens * top_k] float; the routing weight of the pair
    expert_offsets: torch.Tensor  # [num_experts + 1] int64; expert e's rows are expert_offsets[e]:expert_offsets[e+1]


def route_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, softmax_first: bool,
                 normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] through the router (weight [E, H], bias [E]) to (routing weights [T, top_k], expert ids [T, top_k]):
    one kernel (engine/kernels/moe/router.py) where it takes the step, else its torch reference. softmax_first:
    Qwen3-MoE's order (softmax over every expert, then top-k, renormalised with `normalize`); else GPT-OSS's."""
    if takes_tokens(x, weight.shape[0]):
        return route(x, weight, bias, top_k, softmax_first, normalize)
    return route_ref(x, weight, bias, top_k, softmax_first, normalize)


def sort_by_expert(weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> RoutedRows:
    """weights, ids [T, k] -> the T * k rows grouped by expert, without a host sync."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    offsets[1:] = counts.cumsum(0)
    return RoutedRows(expert=flat[order], token=order // ids.shape[1], weight=weights.reshape(-1)[order],
                      expert_offsets=offsets)


class FusedExperts(nn.Module):
    """Every expert's gate_up [E, 2I, H] and down [E, H, I] projections (out x in, as nn.Linear), optional biases,
    in the model's dtype or as MXFP4 blocks and scales (kept packed: `*_blocks` [E, out, in / 32, 16] uint8,
    `*_scales` [E, out, in / 32] uint8).

    activation "swiglu_oai" is GPT-OSS's: gate and up interleaved (gate the even rows of gate_up), gate clamped at
    `limit` from above, up to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate). "silu": gate the first
    I rows, up the rest, silu(gate) * up.

    Checkpoint layouts the loader hands to `weight_loader`: GPT-OSS's fused [E, H, 2I] and [E, I, H] (in x out, so
    transposed here: `in_by_out`; never guessed from the shapes, which are square where I == H as in gpt-oss), one
    expert's Linear weight at a time (Qwen3-MoE: shard (expert, 0 gate | 1 up | 2 down)), or MXFP4 blocks and
    scales as stored.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, bias: bool, activation: str,
                 packed: bool = False, in_by_out: bool = False, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        if activation not in ("swiglu_oai", "silu"):
            raise ValueError(f"unknown experts' activation {activation!r}")
        e, h = num_experts, hidden_size
        if packed and (h % mxfp4.BLOCK or intermediate_size % mxfp4.BLOCK):
            raise ValueError(f"MXFP4 experts need hidden ({h}) and intermediate ({intermediate_size}) sizes that are "
                             f"multiples of {mxfp4.BLOCK}")
        # Tensor parallelism: each rank holds every expert's slice [lo, hi) of the intermediate features (gate_up's
        # rows of those features, down's columns), so an expert's product needs no exchange and the ranks' partial
        # outputs are summed once a layer, as a dense MLP's are. Packed down weights are split along their input,
        # so at whole MXFP4 blocks: ranks may differ by a block (gpt-oss's 2880 = 90 blocks over 4 ranks).
        tp = get_tp_group()
        unit = mxfp4.BLOCK if packed else 1
        lo, hi = (intermediate_size // unit * r // tp.size * unit for r in (tp.rank, tp.rank + 1))
        if hi == lo:
            raise ValueError(f"{intermediate_size} intermediate features of the experts cannot be split over "
                             f"{tp.size} tensor-parallel ranks in blocks of {unit}")
        self.full_intermediate_size, self.shard, self.tp_rank = intermediate_size, (lo, hi), tp.rank
        i = hi - lo
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i  # intermediate: this rank's
        self.activation, self.alpha, self.limit, self.packed = activation, alpha, limit, packed
        self.in_by_out = in_by_out  # the checkpoint's unquantized weights are [E, in, out] (GPT-OSS)
        if packed:

            def u8(*shape: int) -> nn.Parameter:
                return nn.Parameter(torch.zeros(*shape, dtype=torch.uint8), requires_grad=False)

            self.gate_up_proj_blocks = u8(e, 2 * i, h // mxfp4.BLOCK, mxfp4.BLOCK // 2)
            self.gate_up_proj_scales = u8(e, 2 * i, h // mxfp4.BLOCK)
            self.down_proj_blocks = u8(e, h, i // mxfp4.BLOCK, mxfp4.BLOCK // 2)
            self.down_proj_scales = u8(e, h, i // mxfp4.BLOCK)
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i), requires_grad=False) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h), requires_grad=False) if bias else None

    def checkpoint_shards(self, param_name: str) -> list[str] | None:
        """The shard ids (as the loader records them) a parameter is loaded from where a checkpoint stores it per
        expert (Qwen3-MoE); None: one tensor. Read by the loader to tell a missing expert."""
        if self.activation != "silu":
            return None
        if param_name == "gate_up_proj":
            return [str((x, part)) for x in range(self.num_experts) for part in (0, 1)]
        if param_name == "down_proj":
            return [str((x, 2)) for x in range(self.num_experts)]
        return None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        lo, hi = self.shard
        if isinstance(shard_id, tuple):  # one expert's Linear weight: gate or up [I, H], down [H, I]
            expert, part = shard_id
            i = self.intermediate_size
            if part == 2:
                dst, loaded = param.data[expert], loaded[:, lo:hi]
            else:
                dst, loaded = param.data[expert].narrow(0, part * i, i), loaded[lo:hi]
        else:
            if self.in_by_out and param.dim() == 3 and param.dtype != torch.uint8:
                loaded = loaded.transpose(1, 2)
            dst, loaded = param.data, self._rank_part(param, loaded)
        if dst.shape != loaded.shape:
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit the model's {tuple(dst.shape)}")
        dst.copy_(loaded)

    def _rank_part(self, param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole parameter (in this module's layout): gate_up's rows of the rank's
        intermediate features (GPT-OSS's gate and up interleaved, else gate rows then up rows), down's columns
        (blocks and scales at whole MXFP4 blocks), and down's bias on rank 0 only (the ranks' outputs are summed)."""
        lo, hi = self.shard
        full_i = self.full_intermediate_size
        if (lo, hi) == (0, full_i) or full.dim() < 2:
            return full
        name = next(n for n, p in self.named_parameters(recurse=False) if p is param)
        if name.startswith("gate_up_proj"):
            if self.activation == "swiglu_oai":
                return full[:, 2 * lo:2 * hi]
            return torch.cat([full[:, lo:hi], full[:, full_i + lo:full_i + hi]], dim=1)
        if name == "down_proj_bias":
            return full if self.tp_rank == 0 else torch.zeros_like(full)
        unit = mxfp4.BLOCK if name in ("down_proj_blocks", "down_proj_scales") else 1
        return full[:, :, lo // unit:hi // unit]

    def gate_up_weight(self, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[n] expert ids -> [n, 2I, H] in `dtype` (dequantized from the packed bytes of those experts only)."""
        if self.packed:
            return mxfp4.dequantize(self.gate_up_proj_blocks[experts], self.gate_up_proj_scales[experts], dtype)
        return self.gate_up_proj[experts].to(dtype)

    def down_weight(self, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[n] expert ids -> [n, H, I] in `dtype`."""
        if self.packed:
            return mxfp4.dequantize(self.down_proj_blocks[experts], self.down_proj_scales[experts], dtype)
        return self.down_proj[experts].to(dtype)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2I] -> [n, I]."""
        if self.activation == "silu":
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights and expert ids [T, top_k] -> sum over each token's experts of
        weight * expert(x) [T, H], summed over the tensor-parallel ranks' slices. A few routed rows on the kernel
        devices take engine/kernels/moe/small_m.py, more engine/kernels/moe/grouped.py (the choice reads host shapes
        only); other steps the reference or experts_grouped, rows sorted by expert."""
        n = ids.numel()
        # In a graph capture the kernels take any count (the reference's per-row cost is worse, and the grouped path
        # reads the host); the runner keeps mixed MoE graphs to steps of a few hundred routed rows (max_graph_tokens).
        if use_fused_kernels(x) and 0 < n and (n <= MAX_GRAPH_ROUTED_ROWS or _capturing(x)):
            kernel = moe_experts if n <= MAX_ROUTED_ROWS else moe_experts_grouped
            out = kernel(x, weights, ids, self)
        else:
            rows = sort_by_expert(weights, ids, self.num_experts)
            if n > self.num_experts and not _capturing(x):
                out = experts_grouped(self, x, rows)
            else:
                out = experts_ref(self, x, rows)
        return get_tp_group().all_reduce(out)  # the ranks' slices of the intermediate features summed


def experts_ref(experts: FusedExperts, x: torch.Tensor, rows: RoutedRows) -> torch.Tensor:
    """Plain-torch reference of the experts' forward: per routed row, its expert's gate_up (+ bias), the activation,
    down (+ bias), times the routing weight, summed into the row's token. Chunks of rows are a host-side bound
    (num_tokens * top_k, never the rows an expert got): no sync."""
    n, dtype = rows.expert.shape[0], x.dtype
    out = torch.zeros_like(x)
    per_row = 3 * experts.intermediate_size * experts.hidden_size
    chunk = max(1, _REF_CHUNK_ELEMENTS // per_row)
    for start in range(0, n, chunk):
        e = rows.expert[start:start + chunk]
        tok = rows.token[start:start + chunk]
        y = _through_experts(experts, x[tok], e, experts.gate_up_weight(e, dtype), experts.down_weight(e, dtype))
        out.index_add_(0, tok, y * rows.weight[start:start + chunk, None].to(dtype))
    return out


def _through_experts(experts: FusedExperts, x: torch.Tensor,  # [n, H]
                     ids: torch.Tensor,  # [n] each row's expert, or [1] one expert for every row
                     gate_up: torch.Tensor,  # [n, 2I, H] each row's weight, or [1, 2I, H]
                     down: torch.Tensor,  # [n, H, I] or [1, H, I]
                     ) -> torch.Tensor:
    """Rows through their experts' gate_up (+ bias), activation and down (+ bias) -> [n, H]: each row its own
    expert (a batched product) or all rows one expert (one product)."""
    if ids.shape[0] == 1:
        h = x @ gate_up[0].T  # [n, 2I]
    else:
        h = torch.bmm(gate_up, x[:, :, None])[..., 0]
    if experts.gate_up_proj_bias is not None:
        h = h + experts.gate_up_proj_bias[ids].to(x.dtype)
    a = experts.act(h)  # [n, I]
    y = a @ down[0].T if ids.shape[0] == 1 else torch.bmm(down, a[:, :, None])[..., 0]
    if experts.down_proj_bias is not None:
        y = y + experts.down_proj_bias[ids].to(x.dtype)
    return y


def _capturing(x: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on x's device's current stream (never on a CPU tensor)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


# Routed rows up to which the runner captures an MoE model's mixed graphs (prefill chunks beside decodes), and the
# kernel devices take the kernels outside a capture: past them a chunk runs eagerly through experts_grouped, which
# dequantizes each touched expert once into a bf16 product.
MAX_GRAPH_ROUTED_ROWS = 256


def max_graph_tokens(model: nn.Module) -> int | None:
    """Tokens a captured forward of `model` may hold, or None where any count may (no routed experts)."""
    if not any(isinstance(m, FusedExperts) for m in model.modules()):
        return None
    return max(1, MAX_GRAPH_ROUTED_ROWS // model.config.hf_config.num_experts_per_tok)


def experts_grouped(experts: FusedExperts, x: torch.Tensor, rows: RoutedRows) -> torch.Tensor:
    """The experts' forward expert by expert: each touched expert's weights dequantized once and its rows run as one
    product. Same result as experts_ref up to summation order; for steps of many rows, never inside a graph."""
    # SYNC: the runs' lengths on the host, once a forward of a prefill-sized MoE step (never captured in a graph).
    offsets = rows.expert_offsets.tolist()
    dtype = x.dtype
    out = torch.zeros_like(x)
    for e in range(experts.num_experts):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        one = torch.tensor([e], device=x.device)
        tok = rows.token[lo:hi]
        y = _through_experts(experts, x[tok], one, experts.gate_up_weight(one, dtype),
                             experts.down_weight(one, dtype))
        out.index_add_(0, tok, y * rows.weight[lo:hi, None].to(dtype))
    return out


def moe_experts_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.Module) -> torch.Tensor:
    """Plain-torch reference of engine/kernels/moe/small_m.py's `moe_experts` (same arguments): the layer's
    reference over the rows sorted by expert."""
    return experts_ref(experts, x, sort_by_expert(weights, ids, experts.num_experts))
