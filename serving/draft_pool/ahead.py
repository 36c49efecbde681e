"""Speculation ahead on a pooled draft group (serving/draft_pool/worker.py): one AheadProposer drafts ahead for every
target the group serves, each target's windows kept apart.

A draft step proposes for the targets that waited together (serving/draft_pool/batch.py) from their windows where they
hit, then the step is remembered as the pending pre-draft: its merged plan, its proposal (on the draft's device)
and its targets. The pre-draft runs once for all of them, in one pass of the engine's own pre-draft
(AheadProposer.speculate_ahead: every request of every target of the step in the same draft-loop run, or the same tree
forwards), when the first of those targets' `draft_speculate_ahead` calls comes (each target sends it right after its
proposal, while it verifies; the others then find nothing pending), or at the latest before the next draft step
proposes: the pre-draft reads the proposal, whose tensors may be the draft loop's buffers, which that step
overwrites. Either way it comes after the proposal left, and before any of its targets' next calls (each target's
calls run in its order: its `draft_speculate_ahead` comes before its next absorb and draft step).

Each target's windows, scratch blocks, tree slots and guesses are held under its name (AheadProposer.use_scopes:
the pool's request ids are `<target>/<id>`, so two targets' equal request ids never meet), and a draft step drops
only its own targets' windows: another target's windows wait for that target's next step, whenever it comes. A
target that leaves (detached, timed out, dead, moved) has its windows dropped and their scratch freed; a pending
pre-draft that includes it is dropped whole, since its blocks may be handed to the next target of its slot. Each
target's proposals carry its own counters (its engine's speculation-ahead metrics, which a pooled target labels
with its draft replica); the pool's stats carry the totals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from engine.speculation.ahead.proposer import AheadProposer
from engine.speculation.speculative_step import DraftSide
from engine.step.plan import StepPlan
from engine.step.proposal import DraftProposal

logger = logging.getLogger("specserve")


@dataclass
class _PendingAhead:
    plan: StepPlan  # the merged plan of a draft step (resolved, ids under their targets' names)
    proposal: DraftProposal  # its proposal, on the draft's device: [requests, k] ids (and q, runner-ups)
    tenants: set[str]  # the targets of that step


class PoolAhead:
    """A pooled draft's speculation ahead (off where `ahead` is None: every method then does what plain drafting
    does)."""

    def __init__(self, ahead: AheadProposer | None) -> None:
        self.ahead = ahead
        if ahead is not None:
            ahead.use_scopes()
        self._pending: _PendingAhead | None = None
        # Per target, the last pre-draft it was part of as (rows, seconds), until its next proposal reports it
        # (StepResult.speculation_ahead_window: its engine's ahead budget, engine/speculation/ahead/budget.py).
        self._windows: dict[str, tuple[int, float]] = {}
        self.passes: dict[int, int] = {}  # pre-draft passes run, by the targets each served: {targets: passes}

    @property
    def on(self) -> bool:
        return self.ahead is not None

    def propose(self, side: DraftSide, plan: StepPlan, tenants: list[str]) -> DraftProposal:
        """The proposal of a draft step (the merged plan of `tenants`), from their windows where they hit; the
        pending pre-draft of the step before runs first (its proposal's buffers are about to be reused)."""
        if self.ahead is None:
            return side.propose(plan)
        self.run_pending()
        scopes = set(tenants)
        proposal = self.ahead.propose(plan, scopes)
        self._pending = _PendingAhead(plan, proposal, scopes)
        return proposal

    def run_pending(self) -> None:
        """Draft ahead for the pending draft step, every target of it in one pass; nothing if none is pending. A
        failed pre-draft costs only its windows: the next proposals draft as usual."""
        pending, self._pending = self._pending, None
        if pending is None or self.ahead is None:
            return
        n = len(pending.tenants)
        self.passes[n] = self.passes.get(n, 0) + 1
        try:
            self.ahead.speculate_ahead(pending.plan, pending.proposal, pending.tenants)
            window = self.ahead.take_window()
            if window is not None:
                self._windows.update(dict.fromkeys(pending.tenants, window))
        except Exception as e:  # noqa: BLE001 - lossless without the windows; every rank fails alike
            logger.warning("draft pool: drafting ahead for targets %s failed: %s", sorted(pending.tenants), e)
            self.ahead.drop(pending.tenants)

    def forget(self, tenant: str) -> None:
        """A target left: its windows, scratch and counters go, and a pending pre-draft that includes it."""
        if self.ahead is None:
            return
        if self._pending is not None and tenant in self._pending.tenants:
            self._pending = None
        self._windows.pop(tenant, None)
        self.ahead.forget(tenant)

    def tenant_totals(self, tenant: str) -> tuple[int, ...] | None:
        """The target's speculation-ahead running totals (StepResult.speculation_ahead_totals); None when off."""
        return self.ahead.stats_of(tenant).as_tuple() if self.ahead is not None else None

    def take_window(self, tenant: str) -> tuple[int, float] | None:
        """The last pre-draft the target was part of, (rows, seconds), once; None if none ran since. Its rows and
        seconds are the whole pass's, every target of it included: the seconds a row costs, which the target's
        engine fits its own fan-out by."""
        return self._windows.pop(tenant, None)

    def tenant_stats(self, tenant: str) -> dict[str, Any]:
        """For the pool's stats: the target's lookups and hits, and the scratch its windows hold now."""
        if self.ahead is None:
            return {}
        s = self.ahead.stats_of(tenant)
        return {"ahead_lookups": s.lookups, "ahead_hits": s.hits, "ahead_scratch": self.ahead.scratch_held(tenant)}

    def totals(self) -> dict[str, int] | None:
        """The group's counters over every target it served (None when off)."""
        if self.ahead is None:
            return None
        s = self.ahead.stats
        return {"lookups": s.lookups, "hits": s.hits, "drafted_tokens": s.drafted_tokens,
                "unused_tokens": s.unused_tokens, "skipped_branches": s.skipped_branches, "trees": s.trees,
                "passes": sum(self.passes.values()), "pass_tenants": dict(self.passes)}
