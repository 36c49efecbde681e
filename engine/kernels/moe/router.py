"""An MoE layer's router in one kernel: the router's product (with its bias), the top-k experts of each token and
their routing weights (Triton kernel + typed wrapper + the torch references the model files use).

Unfused, a step's routing was a cuBLAS product and its split-K reduction, torch.topk's two kernels and a softmax:
five launches a layer, about 17 us of a gpt-oss-20b decode layer on an H100 for 184 KB of router weights
(benchmarks/RESULTS.md), none of them able to start before the last had ended. Here the grid is (tokens, blocks of
experts): each program computes BLOCK_E experts' logits for one token over the whole hidden size, rounds them as
F.linear's output is rounded (float32 sum, the bias added in float32, one rounding to the activations' dtype) and
writes them to a float32 workspace; the program that arrives last at the token's arrival counter
(engine/kernels/small_m/arrival_counters.py: zero between launches, so the launch replays in a CUDA graph) reads the
token's logits and picks its experts:

- GPT-OSS (`softmax_first` False): the top_k logits, then a float32 softmax over those k, rounded to the dtype;
- Qwen3-MoE (`softmax_first` True): a float32 softmax over every expert, its top_k, renormalised to sum 1 with
  `normalize` (norm_topk_prob), rounded to the dtype.

The experts come in descending order, as torch.topk's (sorted); among equal values the lowest expert id first (torch
leaves ties unordered); NaN counts as the largest value, as in torch.topk, so that a padding row of a captured step
(whatever its buffer held) still routes to experts that exist. A token's arithmetic does not depend on the other
tokens of the step, so a verify of k + 1 tokens routes each exactly as a decode of one would. A token's last program
holds every expert's value at once, so the number of experts is bounded (MAX_EXPERTS); the layers take this kernel
up to MAX_ROUTER_TOKENS tokens (each token's programs read the router's weights again, from L2) and the torch path
past that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.rms_norm import use_fused_kernels
from engine.kernels.small_m.arrival_counters import arrival_counters
from engine.kernels.triton_compat import launch, require_triton, tl, triton, wait_for_previous_kernel

__all__ = ["MAX_EXPERTS", "MAX_ROUTER_TOKENS", "route", "route_ref", "route_softmax_then_topk",
           "route_topk_then_softmax", "takes_tokens"]

MAX_EXPERTS = 256  # experts the last program of a token holds in registers at once
MAX_ROUTER_TOKENS = 256  # tokens of a step up to which the layers route here (a verify of 64 requests x 4 drafts)
# The launch's tiles: experts a program computes (BLOCK_E), hidden features it reads at a time (BLOCK_H), warps;
# `route(tiles=...)` overrides them. Measured on an H100 (benchmarks/gpu_router.py, benchmarks/RESULTS.md): up to
# FEW_TOKENS tokens the grid is little more than a token's programs, so each program takes two experts and the whole
# hidden size in one load (gpt-oss-20b, one token: 3.6 us against 9.3 with 8 experts in loads of 256); more tokens
# fill the GPU anyway and share the router's weights through L2, so eight experts a program.
FEW_TOKENS = 16
TILES_FEW = {"BLOCK_E": 2, "BLOCK_H": 4096, "num_warps": 2}
TILES_MANY = {"BLOCK_E": 8, "BLOCK_H": 512, "num_warps": 2}


def tiles_for(tokens: int) -> dict:
    """The default tiles for a step of `tokens` tokens."""
    return TILES_FEW if tokens <= FEW_TOKENS else TILES_MANY


def route_topk_then_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS: the top-k logits, a softmax over those k. logits [T, E] -> (weights [T, k], ids [T, k])."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return values.softmax(dim=-1), ids


def route_softmax_then_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE: a float32 softmax over every expert, its top k, renormalised to sum 1 with `normalize`
    (norm_topk_prob). logits [T, E] -> (weights [T, k] in logits' dtype, ids [T, k])."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    values, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(logits.dtype), ids


def route_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, softmax_first: bool,
              normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `route` (same arguments): the router's product, then the family's routing."""
    logits = F.linear(x, weight, bias)
    if softmax_first:
        return route_softmax_then_topk(logits, top_k, normalize)
    return route_topk_then_softmax(logits, top_k)


@triton.jit
def _router_kernel(x_ptr, w_ptr, b_ptr, logits_ptr, count_ptr, weights_ptr, ids_ptr,
                   H, E, stride_x, stride_w,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, NUM_BLOCKS: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, NORMALIZE: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    eb = tl.program_id(1)
    wait_for_previous_kernel(USE_PDL)  # x is the last kernel's output; the counters are shared with other launches
    experts = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = experts < E
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_mask = hs < H
        xv = tl.load(x_ptr + t * stride_x + hs, mask=h_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + experts[:, None].to(tl.int64) * stride_w + hs[None, :],
                    mask=e_mask[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
        acc += w * xv[None, :]
    logit = tl.sum(acc, axis=1)
    if HAS_BIAS:
        logit += tl.load(b_ptr + experts, mask=e_mask, other=0.0).to(tl.float32)
    logit = logit.to(x_ptr.dtype.element_ty).to(tl.float32)  # F.linear's output dtype
    row = logits_ptr + t * E
    tl.store(row + experts, logit, mask=e_mask)
    if NUM_BLOCKS > 1:
        # The token's last program to arrive picks its experts (the others' logits are in L2 by then).
        tl.debug_barrier()  # every thread's logits stored before the (one-thread) release below
        arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel", scope="gpu")
        last = arrived == NUM_BLOCKS - 1
    else:
        tl.debug_barrier()  # the logits stored before they are read back
        last = True
    if last:
        all_e = tl.arange(0, E_PAD)
        v = tl.load(row + all_e, mask=all_e < E, other=float("-inf"), cache_modifier=".cg")
        if SOFTMAX_FIRST:
            p = tl.exp(v - tl.max(v, axis=0))
            v = p / tl.sum(p, axis=0)
        # NaN first, as torch.topk takes it: a padding row of a captured step holds whatever its buffer held, and
        # its ids must still name experts (the experts' kernels read their weights by them).
        v = tl.where(all_e < E, tl.where(v != v, float("inf"), v), float("-inf"))
        slots = tl.arange(0, K_PAD)
        top = tl.zeros([K_PAD], dtype=tl.float32)
        ids = tl.zeros([K_PAD], dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(v, axis=0)
            idx = tl.minimum(tl.min(tl.where(v == best, all_e, E_PAD), axis=0), E - 1)  # in range whatever v holds
            top = tl.where(slots == j, best, top)
            ids = tl.where(slots == j, idx.to(tl.int64), ids)
            v = tl.where(all_e == idx, float("-inf"), v)
        k_mask = slots < TOP_K
        if SOFTMAX_FIRST:
            wts = top
            if NORMALIZE:
                wts = wts / tl.sum(tl.where(k_mask, wts, 0.0), axis=0)
        else:
            p = tl.where(k_mask, tl.exp(top - tl.max(tl.where(k_mask, top, float("-inf")), axis=0)), 0.0)
            wts = p / tl.sum(p, axis=0)
        tl.store(weights_ptr + t * TOP_K + slots, wts.to(weights_ptr.dtype.element_ty), mask=k_mask)
        tl.store(ids_ptr + t * TOP_K + slots, ids, mask=k_mask)
        if NUM_BLOCKS > 1:
            tl.atomic_xchg(count_ptr + t, 0)


def takes_tokens(x: torch.Tensor, num_experts: int) -> bool:
    """Whether a layer routes x ([tokens, H]) here: a device the kernels run on, at most MAX_ROUTER_TOKENS tokens and
    MAX_EXPERTS experts."""
    return 0 < x.shape[0] <= MAX_ROUTER_TOKENS and num_experts <= MAX_EXPERTS and use_fused_kernels(x)


def route(x: torch.Tensor,  # [T, H]
          weight: torch.Tensor,  # [E, H] the router's
          bias: torch.Tensor | None,  # [E]
          top_k: int, softmax_first: bool, normalize: bool = False, tiles: dict | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (routing weights [T, top_k] in x's dtype, expert ids [T, top_k] int64), as route_ref. tiles: keys of
    tiles_for(T) to override."""
    require_triton("route", x)
    t, h = x.shape
    e = weight.shape[0]
    if weight.shape[1] != h or (bias is not None and bias.shape != (e,)):
        raise ValueError(f"route: router weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit x {tuple(x.shape)}")
    if not 0 < top_k <= e or e > MAX_EXPERTS:
        raise ValueError(f"route: top_k {top_k} of {e} experts (at most {MAX_EXPERTS})")
    x = x.contiguous()
    weight = weight.contiguous()
    weights = torch.empty(t, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    if t == 0:
        return weights, ids
    cfg = {**tiles_for(t), **(tiles or {})}
    block_e, block_h = cfg["BLOCK_E"], min(cfg["BLOCK_H"], triton.next_power_of_2(h))
    if block_e & (block_e - 1) or block_h & (block_h - 1):
        raise ValueError(f"route: BLOCK_E and BLOCK_H powers of two, got {block_e} and {block_h}")
    blocks = triton.cdiv(e, block_e)
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    counts = arrival_counters(x.device, t) if blocks > 1 else logits
    launch(_router_kernel, (t, blocks), x.device,
           x, weight, bias if bias is not None else weight, logits, counts, weights, ids,
           h, e, x.stride(0), weight.stride(0),
           TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e), NUM_BLOCKS=blocks,
           HAS_BIAS=bias is not None, SOFTMAX_FIRST=softmax_first, NORMALIZE=normalize,
           BLOCK_E=block_e, BLOCK_H=block_h, num_warps=cfg["num_warps"])
    return weights, ids
