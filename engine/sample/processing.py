"""Logits -> sampling probabilities: temperature, then top-k, then top-p (HF / vLLM order and semantics).

The target's p and the draft's q in speculative decoding must go through exactly this code, so that
rejection sampling reproduces the distribution the user asked for (docs/ARCHITECTURE.md, "Rejection sampling").
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.sample.metadata import SamplingMetadata


def _per_row(x: Tensor, logits: Tensor) -> Tensor:
    """A [num_rows] parameter viewed so it broadcasts over every other dimension of `logits`."""
    return x.view(x.shape[0], *([1] * (logits.dim() - 1)))


def _check_rows(logits: Tensor, md: SamplingMetadata) -> None:
    if logits.dim() not in (2, 3) or logits.shape[0] != md.num_reqs:
        raise ValueError(f"logits must be [num_rows, V] or [num_rows, n, V] with num_rows == {md.num_reqs} "
                         f"(one SamplingMetadata row each), got shape {tuple(logits.shape)}")


def apply_temperature_topk_topp(logits: Tensor, md: SamplingMetadata) -> Tensor:
    """Scaled and masked float32 logits (masked entries are -inf).

    logits: [num_rows, V] or [num_rows, n, V]; row i uses md's row i for all of its n positions (a verify
    step scores k + 1 positions of one request with the same settings).

    Greedy rows (temperature 0) are scaled by 1: their masks are computed but irrelevant, since
    `logits_to_probs` replaces them by a one-hot at the argmax, which top-k/top-p never remove.
    Top-k keeps every token >= the k-th largest value (ties kept, as HF's TopKLogitsWarper); top-p then
    drops the tokens whose ascending cumulative probability is <= 1 - top_p, always keeping the most likely
    one (HF's TopPLogitsWarper, vLLM's apply_top_k_top_p).
    """
    _check_rows(logits, md)
    logits = logits.float()
    if not md.all_greedy:
        greedy = md.temperature == 0
        temp = torch.where(greedy, torch.ones_like(md.temperature), md.temperature)
        logits = logits / _per_row(temp, logits)
    if md.no_top_k and md.no_top_p:
        return logits

    # One ascending sort serves both filters: top-k is a threshold at sorted index V - k, and top-p a
    # cumulative sum over the same order.
    vocab = logits.shape[-1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if not md.no_top_k:
        k = md.top_k.to(torch.int64)
        k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
        kth_idx = _per_row(vocab - k, logits).expand(*logits.shape[:-1], 1)
        kth_value = logits_sort.gather(-1, kth_idx)
        logits_sort = logits_sort.masked_fill(logits_sort < kth_value, float("-inf"))
    if not md.no_top_p:
        top_p = md.top_p.float()
        cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= _per_row(1 - top_p, logits)
        # Rows with top_p == 1 are off: without this, tokens whose probability underflows to 0 would be
        # dropped too (harmless, but not "off").
        drop &= _per_row(top_p < 1, logits)
        drop[..., -1] = False  # keep at least the most likely token
        logits_sort = logits_sort.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits_sort).scatter_(-1, logits_idx, logits_sort)


def logits_to_probs(logits: Tensor, md: SamplingMetadata) -> Tensor:
    """Float32 probabilities after temperature, top-k and top-p; one-hot at the argmax for greedy rows.

    logits: [num_rows, V] or [num_rows, n, V] (see `apply_temperature_topk_topp`). Returns the same shape.
    Greedy rows are the temperature -> 0 limit of the same path, so rejection sampling of a greedy row
    reduces to "accept iff the draft equals the target's argmax".
    """
    _check_rows(logits, md)
    if md.all_greedy:
        return _one_hot_argmax(logits)
    probs = apply_temperature_topk_topp(logits, md).softmax(dim=-1)
    if not md.all_random:
        greedy = _per_row(md.temperature == 0, logits)
        probs = torch.where(greedy, _one_hot_argmax(logits), probs)
    return probs


def _one_hot_argmax(logits: Tensor) -> Tensor:
    """[..., V] -> [..., V] float32 one-hot at the first maximum (torch.argmax's tie rule)."""
    out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
