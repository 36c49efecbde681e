"""Saguaro sampling (SSD, Kumar, Dao, May, ICLR 2026): the draft draws from q', its q with the likeliest tokens
scaled down, so that a rejection's replacement token more often lands where a window was drafted ahead.

Speculation ahead pre-drafts windows for the verify's likely outcomes; after a rejection of draft d at a position the
target's token there comes from the residual norm(max(p - q, 0)), and its window only hits if that token is one of
the roots cached for the outcome (the draft's likeliest tokens there other than d:
engine/speculation/ahead/tree_roots.py, or the runner-up of engine/speculation/ahead/branches.py). Drawing d from

    q'(x) = c q(x) / Z  for x among q's top_f tokens,   q(x) / Z  otherwise,   Z = 1 - (1 - c) sum_{top_f} q,

with a factor c in (0, 1] lowers q' on exactly those tokens, so the residual max(p - q', 0) puts more of its mass on
them and more rejections hit; acceptance changes too, and not always for the better (docs/ARCHITECTURE.md,
"Saguaro sampling"). Exact all the same: rejection sampling is lossless for any
proposal distribution provided it reads the one each token was drawn from, so the draft hands q' (not q) to the
verifier (DraftProposal.draft_probs). A verify against the unscaled q would bias the output (the tests show it).

Greedy rows (temperature 0, q one-hot) are left as they are: their drafts are argmaxes and strict equality decides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import sample_from_probs

TopF = int | Sequence[int] | Tensor  # q's likeliest tokens scaled: one count for all rows, or one per row


@dataclass(frozen=True)
class SaguaroSampling:
    """How a draft scales its q before drawing (the hook a proposer and its draft loop take; None: off)."""

    # q's likeliest tokens scaled at every drafted position: the roots cached for a rejection there and the drawn
    # token they exclude (top-F roots other than the draft: F + 1).
    top_f: int
    factor: float  # c in (0, 1): their probabilities are multiplied by it before renormalising

    def __post_init__(self) -> None:
        if isinstance(self.top_f, bool) or not isinstance(self.top_f, int) or self.top_f < 1:
            raise ValueError(f"Saguaro sampling's top_f must be an integer >= 1, got {self.top_f!r}")
        _check_factor(self.factor)
        if self.factor == 1.0:
            raise ValueError("a Saguaro factor of 1 scales nothing: leave Saguaro sampling off (None) instead")


def _check_factor(factor: float) -> None:
    if (isinstance(factor, bool) or not isinstance(factor, (int, float)) or math.isnan(factor)
            or not 0.0 < factor <= 1.0):
        raise ValueError(f"the Saguaro factor c must be a number in (0, 1], got {factor!r}")


def _check_q(q: Tensor, name: str = "q") -> None:
    if q.dim() != 2 or q.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 [rows, V] probabilities, got {q.dtype} {tuple(q.shape)}")


def top_mask(q: Tensor,  # [rows, V] float32
             top_f: TopF) -> Tensor:
    """[rows, V] bool: each row's top_f likeliest tokens (torch.topk's order and tie rule, as the tree's roots)."""
    _check_q(q)
    rows, vocab = q.shape
    if isinstance(top_f, int) and not isinstance(top_f, bool):
        if not 0 <= top_f <= vocab:
            raise ValueError(f"top_f must be an integer in [0, V = {vocab}], got {top_f!r}")
        return torch.zeros_like(q, dtype=torch.bool).scatter_(-1, q.topk(top_f, dim=-1).indices, True)
    if isinstance(top_f, Tensor):
        if top_f.dtype.is_floating_point or top_f.dtype == torch.bool:
            raise ValueError(f"top_f per row must be integers, got a {top_f.dtype} tensor")
        counts = top_f.to(device=q.device, dtype=torch.int64)
        # SYNC: the largest count sizes the topk; callers on the step path pass an int.
        lo, hi = (int(counts.min()), int(counts.max())) if counts.numel() else (0, 0)
    elif isinstance(top_f, Sequence) and all(isinstance(f, int) and not isinstance(f, bool) for f in top_f):
        counts = torch.tensor(list(top_f), dtype=torch.int64).to(q.device)
        lo, hi = min(top_f, default=0), max(top_f, default=0)
    else:
        raise ValueError(f"top_f must be an integer, or one integer per row, got {top_f!r}")
    if tuple(counts.shape) != (rows,):
        raise ValueError(f"top_f per row must have one count per row ({rows}), got shape {tuple(counts.shape)}")
    if lo < 0 or hi > vocab:
        raise ValueError(f"top_f must be in [0, V = {vocab}], got counts in [{lo}, {hi}]")
    idx = q.topk(hi, dim=-1).indices  # [rows, hi]
    keep = torch.arange(hi, device=q.device)[None, :] < counts[:, None]
    return torch.zeros_like(q, dtype=torch.bool).scatter_(-1, idx, keep)


def saguaro_probs(q: Tensor,  # [rows, V] float32, each row a distribution (after temperature/top-k/top-p)
                  top_f: TopF, factor: float,
                  greedy: Tensor | None = None,  # [rows] bool; True: the row is returned as it is
                  ) -> Tensor:
    """q' [rows, V] float32: each row's top_f tokens of q multiplied by `factor`, then renormalised to sum 1.
    Tokens outside q's support stay at 0; a one-hot row stays one-hot."""
    _check_factor(factor)
    mask = top_mask(q, top_f)
    scaled = torch.where(mask, q * factor, q)
    scaled = scaled / scaled.sum(dim=-1, keepdim=True)
    if greedy is not None:
        if tuple(greedy.shape) != (q.shape[0],) or greedy.dtype != torch.bool:
            raise ValueError(f"greedy must be [rows] bool, got {greedy.dtype} {tuple(greedy.shape)}")
        scaled = torch.where(greedy[:, None], q, scaled)
    return scaled


def sample_saguaro(q: Tensor,  # [rows, V] float32 processed q (logits_to_probs)
                   md: SamplingMetadata, top_f: TopF, factor: float) -> tuple[Tensor, Tensor]:
    """Draw one token a row from q' (greedy rows: their argmax, q untouched). Returns (tokens [rows] int64, q'
    [rows, V] float32): q' is what the verifier must read for these tokens. Random numbers as `sample_from_probs`
    (same count and generators as drawing from q)."""
    _check_q(q)
    if q.shape[0] != md.num_reqs:
        raise ValueError(f"q has {q.shape[0]} rows, SamplingMetadata {md.num_reqs}")
    if md.all_greedy:
        return q.argmax(dim=-1), q
    greedy = None if md.all_random else md.temperature == 0
    scaled = saguaro_probs(q, top_f, factor, greedy)
    return sample_from_probs(scaled, md), scaled


def replacement_hit_probability(p: Tensor,  # [rows, V] float32 target distribution at the position
                                q: Tensor,  # [rows, V] float32 draft distribution there (unscaled)
                                fanout: int, factor: float, top_f: int | None = None) -> Tensor:
    """[rows] float64: P(the verify rejects the draft at this position and its replacement token is a cached root),
    for a draft d drawn from q' (q's top_f tokens scaled by `factor`; top_f = fanout + 1 by default) and roots = q's
    top-`fanout` tokens other than d (engine/speculation/ahead/tree_roots.py). factor = 1 gives plain sampling's figure.

    With w(d) = max(q'(d) - p(d), 0) (d drawn and rejected), r(x) = max(p(x) - q'(x), 0) (the residual) and
    Z = sum r = sum w: P = sum_d w(d) r(S(d)) / Z, where S(d) = top-(fanout + 1) minus d when d is among the
    top-fanout, else the top-fanout."""
    _check_q(p, "p")
    _check_q(q)
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    vocab = q.shape[1]
    if isinstance(fanout, bool) or not isinstance(fanout, int) or not 0 <= fanout < vocab:
        raise ValueError(f"fanout must be an integer in [0, V - 1 = {vocab - 1}], got {fanout!r}")
    top_f = fanout + 1 if top_f is None else top_f
    scaled = saguaro_probs(q, top_f, factor).double()
    p64 = p.double()
    w = (scaled - p64).clamp(min=0)  # [rows, V]
    r = (p64 - scaled).clamp(min=0)  # [rows, V]
    in_f = top_mask(q, fanout)
    r_f = (r * in_f).sum(-1, keepdim=True)  # [rows, 1] residual mass on the top-fanout
    r_f1 = (r * top_mask(q, fanout + 1)).sum(-1, keepdim=True)  # ... on the top-(fanout + 1)
    r_roots = torch.where(in_f, r_f1 - r, r_f)  # [rows, V]: r(S(d)) for each d
    z = r.sum(-1)
    hit = (w * r_roots).sum(-1)
    return torch.where(z > 0, hit / z.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(z))
