"""Benchmarks only: speculation ahead's verdicts under synthetic rejection (random-weight pairs of real shapes), where
the target's tokens are unrelated to the draft's and a window or tree branch drafted ahead would never hit: one rate
(EngineConfig.synthetic_bonus_agreement) or a measured profile (EngineConfig.synthetic_top_f_agreement, read by
engine/agreement_profile.py) says which candidate drafted ahead counts as the target's token.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeVar

from engine.agreement_profile import AgreementProfile

T = TypeVar("T")


class SyntheticAgreement:
    """Speculation ahead's verdicts under synthetic rejection (engine/speculation/ahead/proposer.py): one rate
    (synthetic_bonus_agreement: the outcome's first candidate agrees at that rate, a runner-up never) or a profile
    (synthetic_top_f_agreement: candidate r at the profile's rate for the outcome)."""

    def __init__(self, rate: float | None, profile: AgreementProfile | None, seed: int) -> None:
        if (rate is None) == (profile is None):
            raise ValueError("bonus_agreement or agreement_profile: one of them, not both")
        self.rate, self.profile = rate, profile
        # Every rank of a tensor-parallel draft draws the same numbers, so they agree on hits.
        self._rng = random.Random(seed)

    def pick(self, candidates: list[T], outcome: Callable[[], tuple[int, int]]) -> T | None:
        """The candidate drafted ahead for a lookup's outcome (in draft order) that counts as the target's token,
        or None; `outcome`: its (a, k), read only with a profile."""
        u = self._rng.random()
        if self.profile is None:
            assert self.rate is not None
            return candidates[0] if u < self.rate else None
        a, k = outcome()
        r = self.profile.hit_rank(a, k, len(candidates), u)
        return None if r is None else candidates[r]

    def guess_rates(self, a: int, k: int) -> tuple[float, float]:
        """P(the top candidate agrees), P(the runner-up does), at outcome a of a verify of k drafts."""
        if self.profile is None:
            assert self.rate is not None
            return self.rate, 0.0
        return self.profile.guess_rates(a, k)
