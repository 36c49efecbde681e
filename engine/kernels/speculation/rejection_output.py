"""What rejection sampling returns and the modes it takes, shared by the reference
(engine/speculation/rejection_sampler.py, whose module docstring defines the modes and terms) and its Triton kernel
(engine/kernels/speculation/rejection.py), which the reference calls on CUDA: a module of its own so that the kernel
need not import the reference."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import Tensor

MODES = ("strict", "probabilistic", "synthetic")


@dataclass
class RejectionOutput:
    output_token_ids: Tensor  # [num_reqs, max_k + 1] int64; accepted drafts, then recovered/bonus; -1 padding
    num_accepted: Tensor  # [num_reqs] int64; accepted draft tokens, 0 .. num_draft_tokens[i]
    num_output: Tensor  # [num_reqs] int64; num_accepted + 1 (valid tokens in output_token_ids)


@functools.lru_cache(maxsize=1024)  # the same (rate, k) every step: solved once
def synthetic_position_rate(rate: float, k: int) -> float:
    """The per-position acceptance probability a for which accepted / drafted averages `rate` at draft
    length k: solves (a + a^2 + ... + a^k) / k = rate by bisection (the left side increases with a)."""
    if k <= 1 or rate in (0.0, 1.0):
        return float(rate)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        mean = sum(a ** i for i in range(1, k + 1)) / k
        lo, hi = (a, hi) if mean < rate else (lo, a)
    return (lo + hi) / 2
