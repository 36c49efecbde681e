"""Bookkeeping of a pre-drafted tree's would-be hits: per verify outcome, where the target's token ranked among the
draft's candidates, and what any fan-out schedule F_a would have hit, cost and left unused.

A lookup is one verify that the request goes on from: it accepted `a` of k drafts (a = 0..k) and emitted the
target's token t_a at position a. Its `rank` is t_a's place among the draft's tokens at that position, best first,
d_{a+1} left out for a < k (engine/speculation/ahead/tree_roots.py top_f_roots: the same order), so a tree with F_a
roots for outcome a hits exactly when rank < F_a. Everything below is a function of the (a, rank) pairs alone, so one
simulation answers every schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def root_rank(logits: torch.Tensor, excluded: int | None, token: int) -> int:
    """logits: [V] the draft's logits at the outcome's position; excluded: d_{a+1} (None for the bonus position).
    t_a's 0-based rank among the other tokens, by descending logit, ties to the lower id (topk's order on CPU); V if
    t_a is the excluded token itself (no root can be it)."""
    vocab = logits.shape[-1]
    if token == excluded:
        return vocab
    masked = logits.clone()
    if excluded is not None:
        masked[excluded] = float("-inf")
    value = masked[token]
    ids = torch.arange(vocab, device=logits.device)
    ahead = (masked > value) | ((masked == value) & (ids < token))
    return int(ahead.sum())  # SYNC: offline bookkeeping


NO_RANK = 1 << 30  # t_a is not among the n-gram candidates (or a run that did not record them)


def ngram_candidates(context: Sequence[int], excluded: int | None, max_n: int = 3, limit: int = 4) -> list[int]:
    """Prompt-lookup candidates for the token after `context`: for n = max_n..1, the tokens that followed earlier
    occurrences of the context's last n tokens, most recent first, without repeats and without `excluded` (d_{a+1}:
    a root is never the token the window drafted there); at most `limit`. Costs no forward: a root source beside
    the draft's top-F."""
    out: list[int] = []
    end = len(context)
    for n in range(min(max_n, end - 1), 0, -1):
        suffix = list(context[end - n:])
        for start in range(end - n - 1, -1, -1):
            if list(context[start:start + n]) == suffix:
                nxt = context[start + n]
                if nxt != excluded and nxt not in out:
                    out.append(nxt)
                    if len(out) == limit:
                        return out
    return out


@dataclass
class Lookup:
    prompt: int  # which prompt's request (for splitting fit and evaluation sets)
    outcome: int  # a: drafts accepted, 0..k
    rank: int  # t_a's rank among the draft's candidates at position a (0: its top candidate)
    ngram_rank: int = NO_RANK  # t_a's place among the n-gram candidates there (ngram_candidates), NO_RANK if absent
    ngram_draft_ranks: tuple[int, ...] = ()  # each n-gram candidate's rank among the draft's candidates


class HitTable:
    """The lookups of one run (one k, one temperature), and what a schedule F_a = [F_0..F_k] makes of them."""

    def __init__(self, k: int, lookups: Sequence[Lookup]) -> None:
        if any(not 0 <= x.outcome <= k for x in lookups):
            raise ValueError(f"an outcome outside 0..{k}")
        self.k = k
        self.lookups = list(lookups)

    def subset(self, prompts: set[int]) -> HitTable:
        return HitTable(self.k, [x for x in self.lookups if x.prompt in prompts])

    def _check(self, schedule: Sequence[int]) -> None:
        if len(schedule) != self.k + 1 or any(f < 0 for f in schedule):
            raise ValueError(f"a schedule has k + 1 = {self.k + 1} fan-outs >= 0, got {list(schedule)}")

    def count_by_outcome(self) -> list[int]:
        counts = [0] * (self.k + 1)
        for x in self.lookups:
            counts[x.outcome] += 1
        return counts

    def outcome_distribution(self) -> list[float]:
        """P(a), a = 0..k."""
        n = max(len(self.lookups), 1)
        return [c / n for c in self.count_by_outcome()]

    def cumulative_agreement(self, max_fanout: int) -> list[list[float]]:
        """[k + 1][max_fanout]: P(rank < f | outcome a) for f = 1..max_fanout (0 where a never happened)."""
        counts = self.count_by_outcome()
        table = []
        for a in range(self.k + 1):
            ranks = [x.rank for x in self.lookups if x.outcome == a]
            table.append([sum(r < f for r in ranks) / counts[a] if counts[a] else 0.0
                          for f in range(1, max_fanout + 1)])
        return table

    def hits(self, schedule: Sequence[int]) -> int:
        self._check(schedule)
        return sum(x.rank < schedule[x.outcome] for x in self.lookups)

    def hit_rate(self, schedule: Sequence[int]) -> float:
        return self.hits(schedule) / max(len(self.lookups), 1)

    def hit_rate_by_outcome(self, schedule: Sequence[int]) -> list[float | None]:
        """P(hit | outcome a); None where a never happened."""
        self._check(schedule)
        counts = self.count_by_outcome()
        hit = [0] * (self.k + 1)
        for x in self.lookups:
            hit[x.outcome] += x.rank < schedule[x.outcome]
        return [h / c if c else None for h, c in zip(hit, counts)]

    def hit_rate_with_ngram(self, schedule: Sequence[int], extra: int) -> float:
        """Hit rate of the draft's top-F_a roots plus the first `extra` n-gram candidates of each outcome."""
        self._check(schedule)
        hits = sum(x.rank < schedule[x.outcome] or x.ngram_rank < extra for x in self.lookups)
        return hits / max(len(self.lookups), 1)

    def ngram_roots_per_lookup(self, schedule: Sequence[int], extra: int) -> float:
        """Roots the n-gram candidates add per lookup: those of the first `extra` not already among the draft's
        top-F_a (each such root is one more branch to draft)."""
        self._check(schedule)
        added = sum(sum(r >= schedule[x.outcome] for r in x.ngram_draft_ranks[:extra]) for x in self.lookups)
        return added / max(len(self.lookups), 1)

    def drafted_ahead_per_lookup(self, schedule: Sequence[int], depth: int) -> int:
        """Tokens a tree drafts per lookup: every branch `depth` deep."""
        self._check(schedule)
        return sum(schedule) * depth

    def unused_share(self, schedule: Sequence[int], depth: int) -> float:
        """Pre-drafted tokens never proposed / pre-drafted: a hit proposes its one branch's `depth` tokens."""
        drafted = self.drafted_ahead_per_lookup(schedule, depth) * len(self.lookups)
        return 1.0 - self.hits(schedule) * depth / drafted if drafted else 0.0

    def rank_percentiles(self, outcome: int, quantiles: Sequence[float]) -> list[int | None]:
        """Nearest-rank percentiles of the rank at outcome a: the fan-out F = p + 1 that covers that share of it."""
        return percentiles([x.rank for x in self.lookups if x.outcome == outcome], quantiles)

    def best_schedule(self, cap: int, max_fanout: int) -> list[int]:
        """The schedule with the most hits among those of at most `cap` branches in all and `max_fanout` per
        outcome (exact, by dynamic programming over the outcomes); ties to fewer branches."""
        return self._best_by_cap(cap, max_fanout)[cap]

    def smallest_tree(self, rate: float, max_fanout: int, max_branches: int) -> list[int] | None:
        """The best schedule of the fewest branches (at most `max_branches`) whose hit rate reaches `rate`; None if
        none does."""
        if not self.lookups:
            return None
        return next((s for s in self._best_by_cap(max_branches, max_fanout) if self.hit_rate(s) >= rate), None)

    def _best_by_cap(self, cap: int, max_fanout: int) -> list[list[int]]:
        """[cap + 1]: the best schedule of at most c branches, for every c = 0..cap (one dynamic programme)."""
        gains = []  # [k + 1][max_fanout + 1]: hits of outcome a with F_a = f
        for a in range(self.k + 1):
            ranks = [x.rank for x in self.lookups if x.outcome == a]
            gains.append([sum(r < f for r in ranks) for f in range(max_fanout + 1)])
        # best[c] = (hits, -branches, schedule) over the outcomes so far with c branches at most
        best: list[tuple[int, int, list[int]]] = [(0, 0, [])] * (cap + 1)
        for a in range(self.k + 1):
            nxt = []
            for c in range(cap + 1):
                options = [(best[c - f][0] + gains[a][f], best[c - f][1] - f, best[c - f][2] + [f])
                           for f in range(min(c, max_fanout) + 1)]
                nxt.append(max(options, key=lambda o: (o[0], o[1])))
            best = nxt
        return [b[2] for b in best]


def percentiles(values: Sequence[int], quantiles: Sequence[float]) -> list[int | None]:
    """Nearest-rank percentiles (the smallest value with at least q of the values at or below it); None if empty."""
    if any(not 0.0 < q <= 1.0 for q in quantiles):
        raise ValueError(f"quantiles must be in (0, 1], got {list(quantiles)}")
    ordered = sorted(values)
    if not ordered:
        return [None] * len(quantiles)
    out = []
    for q in quantiles:
        n = math.ceil(round(q * len(ordered), 9))  # rounded first: 0.9 * 10 is 9.000000000000002
        out.append(ordered[max(n, 1) - 1])
    return out
