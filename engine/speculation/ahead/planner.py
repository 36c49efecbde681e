"""What the engine asks speculation ahead each step: how much the plan asks the draft to draft ahead.

EngineCore plans every step; speculation ahead's share of a plan (whether the draft drafts ahead at all, how many
windows a request, how many tree nodes) comes from its on/off gate by load (engine/speculation/ahead/gate.py) and
its per-step fan-out (engine/speculation/ahead/budget.py), both fed the step's result once it is committed. This
object holds them and the draft's running totals as its last result reported them, so the engine keeps none of
speculation ahead's state.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.scheduler import ScheduledRequest
from engine.speculation.ahead.budget import AheadBudget, drafts_ahead
from engine.speculation.ahead.gate import AheadGate
from engine.speculation.ahead.totals import NUM_TOTALS
from engine.step.plan import StepPlan, StepResult


class AheadPlanner:
    def __init__(self, config: EngineConfig, on: bool, overlaps_verify: bool) -> None:
        """on: the draft drafts ahead (a draft model, and speculation ahead on in its executor). overlaps_verify: the
        draft's runs ahead overlap the target's verify (a draft on GPUs of its own), where the budget and gate
        adapt, if the configuration asks them to."""
        self.config = config
        self.on = on
        self.totals: tuple[int, ...] = (0,) * NUM_TOTALS  # the draft's, as its last result said
        self.restart(overlaps_verify)

    def restart(self, overlaps_verify: bool) -> None:
        """A new budget and gate (a new draft group's runs ahead are measured anew): adaptive only where the
        draft's runs ahead overlap the verify and the configuration asks for it."""
        adaptive = self.config.speculation_ahead_adaptive and overlaps_verify
        self.budget = AheadBudget(self.config.speculation_ahead_branches, adaptive=adaptive,
                                  tree=self.config.speculation_ahead_tree_fanout > 0)
        self.gate = AheadGate(enabled=adaptive)

    def plan(self, plan: StepPlan, scheduled: list[ScheduledRequest]) -> None:
        """Set the plan's share of speculation ahead (StepPlan.ahead_off, ahead_branches, ahead_tree_nodes)."""
        if not self.on:
            return
        # Only the requests the draft drafts ahead count (the same rule on both sides).
        tree = self.budget.tree
        ahead = [s for s in scheduled if s.num_draft_tokens
                 and drafts_ahead(s.samples, s.request.logits_params is not None, tree)]
        plan.ahead_off = not self.gate.plan(plan.step_id, len(ahead))
        if plan.ahead_off:
            if tree:
                plan.ahead_tree_nodes = 0  # no tree (a merged plan sums the parts' caps)
        else:
            plan.ahead_branches = self.budget.branches(len(ahead))
            if tree:
                plan.ahead_tree_nodes = self.budget.tree_nodes([s.num_draft_tokens for s in ahead])

    def observe(self, result: StepResult) -> None:
        """A committed step's result: the draft's totals, its last run ahead and the step's tokens."""
        if result.speculation_ahead_totals is not None:
            self.totals = result.speculation_ahead_totals
        if self.on:
            self.budget.observe(result.phase_seconds, result.speculation_ahead_window)
            self.gate.observe(result.step_id, sum(len(t) for t in result.sampled if t))

    def branches(self) -> int:
        """Windows a request the last plan asked the draft to draft ahead; 0 where the gate found drafting ahead
        slower at that load."""
        return self.budget.last if self.gate.last else 0

    def off_steps(self) -> int:
        """Steps planned without drafting ahead by the gate, since the last restart."""
        return self.gate.steps_off
