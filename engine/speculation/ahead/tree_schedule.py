"""How many candidates speculation ahead's tree (engine/speculation/ahead/tree.py) drafts for each verify outcome.

A verify of k drafts ends after a = 0..k accepted drafts with one token of the target's at position frontier + a.
The tree gives outcome a F_a branches, rooted at the draft's top-F_a tokens there
(engine/speculation/ahead/tree_roots.py). What one branch is worth is P(outcome a) x P(the target's token is among the
roots); the rows it costs are its depth, whatever a is. So the schedule follows P(outcome), a capped geometric in the
per-token acceptance alpha (a running estimate over the proposer's own verifies, engine/speculation/ahead/branches.py):

    P(a) = alpha^a (1 - alpha) for a < k,  alpha^k for a = k  (the bonus token after all k accepted)
    F_a  = clamp(round(F x P(a) / max_a P(a)), 1, F)

with F = EngineConfig.speculation_ahead_tree_fanout. Outcome 0 and outcome k are the likeliest at the alphas seen in
practice (0.5-0.8), so they get the most. The branches of a request are then cut to a row budget (what the step's
scratch and forward rows leave it, or the engine's ahead budget: engine/speculation/ahead/budget.py), the candidate
worth least first (the last one of the outcome with the least P(a) a candidate).

`measured`: per-outcome counts set from measured statistics instead (a benchmark that found, say, where hits happen
by outcome); entry a is F_a, the last entry stands for every later a. Cut to the budget the same way.

Exactness does not depend on any of this: a branch is what the next proposal would draft after its outcome, and the
schedule changes only which outcomes and tokens have one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TreeSchedule:
    """F_a per outcome (see the module docstring)."""

    max_fanout: int  # F: candidates per outcome at most
    vocab_size: int  # a rejection's candidates exclude the rejected draft: at most vocab_size - 1 of them
    measured: list[int] | None = None  # [n] F_a set from measurements (the last entry for every later a)

    def fanout(self, k: int, alpha: float, budget: int) -> list[int]:
        """[k + 1] F_a for a window of k drafts, at most `budget` branches in all."""
        cap = max(0, min(self.max_fanout, self.vocab_size - 1))
        if self.measured:
            fan = [min(cap, max(0, self.measured[min(a, len(self.measured) - 1)])) for a in range(k + 1)]
        else:
            alpha = min(max(alpha, 1e-3), 1 - 1e-3)
            prob = [alpha ** a * (1 - alpha) for a in range(k)] + [alpha ** k]
            top = max(prob)
            fan = [min(cap, max(1, round(cap * p / top))) for p in prob]
            weight = prob
        # Over budget: take back, one at a time, the candidate worth least: the last one of the outcome whose
        # weight a candidate (P(a) / F_a; measured: F_a stands for P(a)) is smallest, the largest a on ties. So a
        # tight budget keeps the likeliest outcomes whole: at 2 branches, F = 1 and alpha 0.7, outcome 0 and the bonus.
        if self.measured:
            weight = [float(f) for f in fan]
        excess = sum(fan) - max(budget, 0)
        while excess > 0:
            a = min((a for a in range(k + 1) if fan[a] > 0), key=lambda a: (weight[a] / fan[a], -a))
            fan[a] -= 1
            excess -= 1
        return fan
