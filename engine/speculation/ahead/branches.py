"""Which windows speculation ahead drafts for a request (engine/speculation/ahead/proposer.py): the likeliest
outcomes of the verify it waits for, up to EngineConfig.speculation_ahead_branches of them.

A verify of k drafts d_1..d_k ends in one of these outcomes, each asking the next step's draft for its own input:
- all k accepted, then the target's bonus token b: the next catch-up is (d_k, b) from the position of d_k. Branch
  `accept` 1 guesses b as the draft's argmax after d_k (the only window of fan-out 1), `accept` 2 as its runner-up.
- a rejection after a accepted drafts (a = 0..k-1): the target's token t at the position of d_{a+1} differs from
  it; the next catch-up is t alone, from that position. Branch `reject` a guesses t as the draft's most likely token
  other than d_{a+1} there (recorded by the proposal's own step: no extra forward).

Ranking: P(branch) = P(outcome) x P(guess right | outcome), where
- P(outcome) follows the geometric model of acceptance with a per-token rate alpha: alpha^k for all accepted,
  alpha^a (1 - alpha) for a rejection after a;
- alpha and the three guess accuracies (bonus argmax, bonus runner-up, rejection runner-up) are running estimates
  over this proposer's own verifies: each lookup shows the outcome of the verify before it (where the next catch-up
  starts, with which tokens) and whether each guess made for it was right, whether or not its window was drafted.
  They start from priors worth ten verifies (alpha 0.7; guesses right 0.7, 0.1 and 0.3 of the time). Under the
  benchmarks' agreement setting (a synthetic pair, whose tokens are unrelated to the draft's) the guesses are scored
  as that setting's lookups credit them instead (`observe_agreement`).
The draft's own q is not used: a greedy draft's q is one-hot, and what decides a guess is the target's p, which the
draft never sees; the running rates are exactly what each branch kind's hit rate measures. The estimates are the
same for every request (only k differs), and every tensor-parallel rank sees the same plans and tokens, so all
ranks choose the same branches.
"""

from __future__ import annotations

from dataclasses import dataclass

ACCEPT, REJECT = "accept", "reject"
PRIOR_WEIGHT = 10.0  # verifies' worth of the priors below


@dataclass(frozen=True)
class Branch:
    """One outcome of a verify, and the window drafted for it."""

    kind: str  # ACCEPT | REJECT
    index: int  # ACCEPT: rank of the bonus guess (1 argmax, 2 runner-up); REJECT: a, the drafts accepted before it
    probability: float  # the estimate it was ranked by

    def accepted(self, k: int) -> int:
        """Drafts the target accepts in this outcome."""
        return k if self.kind == ACCEPT else self.index

    def start_offset(self, k: int) -> int:
        """Where the next catch-up starts, from the verify's frontier (the position of d_1)."""
        return k - 1 if self.kind == ACCEPT else self.index

    @property
    def own_blocks(self) -> bool:
        """The argmax bonus window writes the request's own blocks: only positions from d_k on, which every
        outcome rewrites before reading. Every other window would overwrite KV another outcome needs: scratch."""
        return self.kind == ACCEPT and self.index == 1


@dataclass
class BranchEstimates:
    """Running counts behind the ranking (see the module docstring), priors included."""

    accepted: float = 0.7 * PRIOR_WEIGHT  # drafts accepted, over the observed verifies
    rejected: float = 0.3 * PRIOR_WEIGHT  # verifies that ended in a rejection
    bonus_right: tuple[float, float] = (0.7 * PRIOR_WEIGHT, 0.1 * PRIOR_WEIGHT)  # argmax, runner-up guessed b
    bonus_seen: tuple[float, float] = (PRIOR_WEIGHT, PRIOR_WEIGHT)
    reject_right: float = 0.3 * PRIOR_WEIGHT  # the runner-up guessed the target's token at a rejection
    reject_seen: float = PRIOR_WEIGHT

    @property
    def alpha(self) -> float:
        """Per-token acceptance: the geometric model's maximum-likelihood estimate (accepted / (accepted +
        rejections): a verify that accepts all k ends without a rejection)."""
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, k: int, accepted: int, bonus_guesses: tuple[int | None, int | None], reject_guess: int | None,
                token: int) -> None:
        """One verify's outcome: `accepted` of k drafts, then `token` (the bonus token, or the target's at the
        rejection); the guesses that were made for that outcome (None: not known)."""
        self.accepted += accepted
        if accepted < k:
            self.rejected += 1
            if reject_guess is not None:
                self.reject_right += reject_guess == token
                self.reject_seen += 1
            return
        right, seen = list(self.bonus_right), list(self.bonus_seen)
        for r, g in enumerate(bonus_guesses):
            if g is not None:
                right[r] += g == token
                seen[r] += 1
        self.bonus_right, self.bonus_seen = (right[0], right[1]), (seen[0], seen[1])

    def observe_agreement(self, k: int, accepted: int, rate: float, second_rate: float = 0.0) -> None:
        """One verify's outcome under the benchmarks' agreement setting (AheadProposer.agreement), where a
        synthetic pair's tokens are unrelated to the draft's guesses and a lookup credits one window per outcome at
        `rate` instead: the argmax bonus guess and a rejection's guess count as right at that rate, a second bonus
        guess at `second_rate` (never with one rate; a measured profile's top-2 less top-1 rate). Scoring the real
        tokens instead would rank windows the setting never credits."""
        self.accepted += accepted
        if accepted < k:
            self.rejected += 1
            self.reject_right += rate
            self.reject_seen += 1
            return
        self.bonus_right = (self.bonus_right[0] + rate, self.bonus_right[1] + second_rate)
        self.bonus_seen = (self.bonus_seen[0] + 1, self.bonus_seen[1] + 1)

    def ranked(self, k: int, budget: int) -> list[Branch]:
        """The `budget` likeliest branches of a verify of k drafts, likeliest first. Fan-out 1 is always the argmax
        bonus window (whatever the estimates say: the window that needs no scratch blocks)."""
        alpha = self.alpha
        p_all = alpha ** k
        if budget <= 1:
            return [Branch(ACCEPT, 1, p_all * self.bonus_right[0] / self.bonus_seen[0])]
        cands = [Branch(ACCEPT, r + 1, p_all * self.bonus_right[r] / self.bonus_seen[r]) for r in range(2)]
        rate = self.reject_right / self.reject_seen
        cands += [Branch(REJECT, a, alpha ** a * (1 - alpha) * rate) for a in range(k)]
        order = {b: n for n, b in enumerate(cands)}  # ties: the argmax bonus window first, then early rejections
        return sorted(cands, key=lambda b: (-b.probability, order[b]))[:budget]
