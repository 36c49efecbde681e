"""What speculation ahead keeps between a pre-draft and the proposal after it (engine/speculation/ahead/proposer.py):
the windows drafted ahead (or, in tree mode, the tree's branches: engine/speculation/ahead/tree.py), by request, and
the counters the engine reports."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.speculation.ahead.branches import ACCEPT
from engine.speculation.ahead.scratch_blocks import ScratchFork
from engine.speculation.ahead.totals import MAX_OUTCOMES, NUM_TOTALS  # noqa: F401 - NUM_TOTALS is public here too


@dataclass
class AheadEntry:
    """One pre-drafted window of a request (one branch)."""

    position: int  # where the next step's draft input must start: the position of d_k, or of the rejected draft
    tokens: tuple[int, ...]  # that input: (d_k, g) after all accepted, (t,) after a rejection
    token_ids: torch.Tensor  # [k'] int64 on the draft's device: e_1..e_k'
    probs: torch.Tensor | None  # [k', V] float32 q of each e_j (None: drafted greedily, q is one-hot)
    alt: torch.Tensor | None = None  # [k'] int64: each e_j's runner-up (None without branches)
    kind: str = ACCEPT  # the branch's kind (engine/speculation/ahead/branches.py)
    fork: ScratchFork | None = None  # its KV's scratch blocks; None: written in the request's own blocks
    # Tree mode: [n] flat scratch slots (the same in every KV-cache group) holding the KV of positions position ..
    # position + n - 1 as the next proposal would write them (the catch-up, then e_1..e_{n - len(tokens)}).
    slots: list[int] | None = None
    outcome: int | None = None  # tree mode: the drafts accepted in the outcome this branch is for (a)
    # Only a proposal of exactly this k may take it (None: any k up to len(token_ids)): a seeded sampled branch
    # whose noise was drawn up front as the draft loop draws it, [k, V] at once, which a proposal of another k
    # would draw differently.
    exact_k: int | None = None


@dataclass
class AheadStats:
    """Counters since the proposer began (monotonic; the engine reports their increase per step)."""

    lookups: int = 0  # speculating requests whose proposal was looked up in the cache
    hits: int = 0  # ... and served from it
    drafted_tokens: int = 0  # tokens drafted ahead (e_1..e_k' of every entry; the guesses not counted)
    unused_tokens: int = 0  # of those, dropped unproposed (a miss, or beyond the k of a hit)
    # Branches chosen but not drafted: the draft loop's rows (max_num_seqs, or its largest graph batch) or the
    # scratch reserve were full, or the request's tables too short. Reported, so a fan-out that the engine's sizes
    # cut short shows on the dashboard rather than only as a lower hit rate.
    skipped_branches: int = 0
    # Tree mode (engine/speculation/ahead/tree.py): trees drafted (one a request and pre-draft), and their nodes (the
    # rows fed: the window, every branch's root and drafts but the last): tree_nodes / trees is nodes per tree.
    trees: int = 0
    tree_nodes: int = 0
    # Not in the tuple the engine reports (in process only): tree mode, requests left without a tree because the
    # engine's ahead budget (StepPlan.ahead_tree_nodes) had no room for one branch each.
    skipped_trees: int = 0
    # Tree mode: hits by outcome, index a = drafts accepted before the target's token (k: the bonus after all k).
    hits_by_outcome: list[int] = field(default_factory=lambda: [0] * MAX_OUTCOMES)
    # Not in the tuple the engine reports (in process only): hits by branch kind.
    hits_accept: int = 0
    hits_reject: int = 0

    def as_tuple(self) -> tuple[int, ...]:
        """What the engine reports (StepResult.speculation_ahead_totals), laid out as engine/speculation/ahead/totals.py
        says: the counters, then hits_by_outcome."""
        return (self.lookups, self.hits, self.drafted_tokens, self.unused_tokens, self.skipped_branches, self.trees,
                self.tree_nodes, *self.hits_by_outcome)


@dataclass
class SpeculationCache:
    """The windows of the last pre-draft, by request id, likeliest first. Only the last pre-draft's entries are kept:
    a window is for the step right after the one it was drafted in, and the next proposal consumes or drops every
    entry."""

    entries: dict[str, list[AheadEntry]] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(v) for v in self.entries.values())

    def clear(self) -> None:
        self.entries.clear()


def request_scope(request_id: str) -> str:
    """The scope of a request id under a pooled draft: its target's name, before the first "/" (the pool puts every
    target's request ids under its name, serving/draft_pool/worker.py)."""
    return request_id.split("/", 1)[0]


class AheadCounters:
    """Where speculation ahead counts: `stats`, the proposer's totals, and under a pooled draft (scoped) each target's
    own as well, so that each target reports its own hits (its engine's metrics) while the pool reports them all."""

    def __init__(self, stats: AheadStats) -> None:
        self.stats = stats
        self.scoped = False
        self.by_scope: dict[str, AheadStats] = {}

    def _each(self, request_id: str) -> tuple[AheadStats, ...]:
        if not self.scoped:
            return (self.stats,)
        return self.stats, self.by_scope.setdefault(request_scope(request_id), AheadStats())

    def add(self, request_id: str, name: str, n: int = 1) -> None:
        """Counter `name` of AheadStats up by n, for the request's scope too."""
        for s in self._each(request_id):
            setattr(s, name, getattr(s, name) + n)

    def add_outcome(self, request_id: str, accepted: int) -> None:
        for s in self._each(request_id):
            s.hits_by_outcome[accepted] += 1

    def of(self, scope: str) -> AheadStats:
        """A scope's counters (zeros for one that never counted)."""
        return self.by_scope.get(scope) or AheadStats()

    def forget(self, scopes: set[str]) -> None:
        for s in scopes:
            self.by_scope.pop(s, None)
