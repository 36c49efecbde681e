"""One speculation step's two sides, and both composed in one process. The order of their calls is written once,
in engine/speculation/step_order.py.

A step is: the draft proposes k tokens per request (from its speculation cache where a window drafted ahead hits,
else by drafting), the target verifies them in one forward and rejection-samples, and, with speculation ahead, the
draft drafts the next window. Every side resolves the plan's open entries from its request table before running it
and records the step's result in it (engine/step/request_table.py).

- `DraftSide`: the draft's proposer (and AheadProposer) over its runner, with the side's table.
- `TargetSide`: the target's verifier, with the side's table and the counters of inputs built during the draft.
- `SpeculativeStep`: both sides in one process, sharing one table (the result is recorded once, for both models):
  the in-process executor runs it, and so does a target worker rank with a colocated draft.

Served with the draft in processes of its own, each worker rank runs one side and the graph's nodes are thin
wrappers over it (serving/workers/worker.py): what crosses processes (the proposal as host lists, its handoff's timing,
the target's result back to the draft's table) is added there. Phases are booked through engine/step/phases.py.
"""

from __future__ import annotations

import time

from engine.agreement_profile import AgreementProfile
from engine.runner.model_runner import ModelRunner
from engine.speculation.ahead.proposer import AheadProposer
from engine.speculation.ahead.saguaro import ahead_saguaro
from engine.speculation.eagle3_proposer import Eagle3Proposer
from engine.speculation.proposer import DraftProposer
from engine.speculation.step_order import DRAFT, TARGET, Call, StepMode, run_in_process
from engine.speculation.verifier import Verifier, VerifyInput
from engine.step.phases import (
    GpuMarks,
    book_local_proposal,
    book_no_proposal,
    book_speculation_ahead,
)
from engine.step.plan import StepPlan, StepResult
from engine.step.proposal import DraftProposal
from engine.step.request_table import RequestTable


class DraftSide:
    """The draft's half of a step. Plans given to its methods are resolved (`resolve`) by the caller: in one
    process both sides share one table, which the step resolves once."""

    def __init__(self, runner: ModelRunner, keep_probs: bool, seed: int, speculation_ahead: bool = False,
                 table: RequestTable | None = None, proposer: DraftProposer | Eagle3Proposer | None = None) -> None:
        """keep_probs: keep q (probabilistic rejection reads it). speculation_ahead: draft the next window after each
        proposal (`speculate_ahead`) and serve hits from it (engine/speculation/ahead/proposer.py). proposer: another
        kind of drafter over `runner` (an EAGLE-3 head's); None: a draft model's DraftProposer."""
        self.runner = runner
        self.table = table if table is not None else RequestTable()
        if proposer is not None and speculation_ahead:
            raise ValueError("speculation ahead drafts with a draft model's proposer only")
        self.proposer = proposer if proposer is not None else DraftProposer(
            runner, keep_probs, seed, ahead=speculation_ahead,
            saguaro=ahead_saguaro(runner.config) if speculation_ahead else None)
        profile = runner.config.synthetic_top_f_agreement
        self.ahead = (AheadProposer(self.proposer, runner.config.synthetic_bonus_agreement, seed,
                                    AgreementProfile.from_table(profile) if profile is not None else None)
                      if speculation_ahead else None)
        # The last proposal and its plan, for `speculate_ahead`: the window ahead follows the proposal that went out.
        self._proposed: tuple[StepPlan, DraftProposal] | None = None
        # An EAGLE-3 head on workers of its own reads each target forward's states from its result (`absorb`),
        # with the plan it proposed for.
        self.reads_target_states = isinstance(self.proposer, Eagle3Proposer) and self.proposer.target is None
        self._last_plan: StepPlan | None = None

    @property
    def sits_out_queued_steps(self) -> bool:
        """Whether the target's steps without drafts may be queued ahead without this side (engine/decode_pipeline.py):
        a draft model sits them out and catches up at its next proposal; an EAGLE-3 head reads every target
        forward's states on the host's schedule, and speculation ahead drafts after every verify."""
        return self.ahead is None and not isinstance(self.proposer, Eagle3Proposer)

    def resolve(self, plan: StepPlan) -> StepPlan:
        return self.table.resolve(plan)

    def propose(self, plan: StepPlan) -> DraftProposal:
        """The proposal of a resolved plan: from the speculation cache where it hits, else drafted now."""
        if self.ahead is None:
            self._last_plan = plan
            return self.proposer.propose(plan)
        proposal = self.ahead.propose(plan)
        self._proposed = (plan, proposal)
        return proposal

    def sit_out(self) -> None:
        """A step without drafts in which the draft does not run (in one process): windows drafted ahead are for
        the next step that speculates, and none follows them now."""
        if self.ahead is not None:
            self.ahead.drop_all()

    def speculate_ahead(self) -> None:
        """Draft the next windows of the last proposal (speculation ahead; nothing otherwise)."""
        last, self._proposed = self._proposed, None
        if self.ahead is not None and last is not None:
            self.ahead.speculate_ahead(*last)

    def absorb(self, result: StepResult) -> None:
        """The target's result of the step this side proposed for (a table of its own: served); a head on workers of
        its own also takes the target's states of the step's forward."""
        self.table.record(result)
        if self.reads_target_states:
            plan = self._last_plan
            if plan is None or plan.step_id != result.step_id:
                raise RuntimeError(f"the head proposed for step {plan.step_id if plan else None}, not the result's "
                                   f"{result.step_id}")
            counts = result.num_draft_tokens or [r.num_draft_tokens for r in plan.requests]
            self.proposer.absorb_target(plan, counts, result)

    @property
    def speculation_ahead_totals(self) -> tuple[int, ...] | None:
        """Speculation ahead's running totals (StepResult.speculation_ahead_totals); None without it."""
        return self.ahead.stats.as_tuple() if self.ahead is not None else None

    def take_speculation_ahead_window(self) -> tuple[int, float] | None:
        """The last run of speculation ahead as (rows, seconds), once (StepResult.speculation_ahead_window); None if
        none ran since."""
        return self.ahead.take_window() if self.ahead is not None else None


class TargetSide:
    """The target's half of a step: `prepare` builds the verify input from the plan alone, `verify` runs it with
    the proposal and records the result. Plans are resolved by the caller, as for DraftSide."""

    def __init__(self, runner: ModelRunner, seed: int, table: RequestTable | None = None,
                 gated_launch: bool = False) -> None:
        """gated_launch: inputs prepared during the draft are also queued on the GPU before the ids come, where the
        verifier can (Verifier.enable_gated_launch: graphs on CUDA; for a remote draft only)."""
        self.runner = runner
        self.table = table if table is not None else RequestTable()
        self.verifier = Verifier(runner, seed)
        self.gated_launch = bool(gated_launch and self.verifier.enable_gated_launch())
        self.num_prepared_during_draft = 0  # verify steps whose input was built while the draft proposed
        self.num_gated_launches = 0  # ... and whose forward was queued on the GPU before the ids came

    def resolve(self, plan: StepPlan) -> StepPlan:
        return self.table.resolve(plan)

    def prepare(self, plan: StepPlan, with_drafts: bool, gated_launch: bool = False) -> VerifyInput:
        """The verify input of a resolved plan, placeholders where a proposal's drafts will go (with_drafts);
        gated_launch: queue its forward too (only where `gated_launch` was enabled)."""
        return self.verifier.prepare(plan, with_drafts, gated_launch=gated_launch and self.gated_launch)

    def verify(self, step: StepPlan | VerifyInput, proposal: DraftProposal | None) -> StepResult:
        """Verify `proposal` (None: no drafts) for `step`, a resolved plan or its input prepared during the draft (built
        while the draft proposed: its time is not the step's); records the result in the table."""
        if isinstance(step, VerifyInput):
            result = self.verifier.run(step, proposal, prepared_during_draft=True)
            self.num_prepared_during_draft += 1
            self.num_gated_launches += step.launched is not None
        else:
            result = self.verifier.verify(step, proposal)
        self.table.record(result)
        return result


class SpeculativeStep:
    """Both sides in one process, on one table: `run(plan)` resolves the plan once and runs the step's calls in
    their order (step_order.py): proposes, verifies (the proposal stays on the device, the verify queued behind the
    draft's kernels) and, with speculation ahead, drafts the next window after the verify; the one table needs no
    `absorb`, and the verify builds its input itself. `draft` None: target-only steps."""

    def __init__(self, target: TargetSide, draft: DraftSide | None) -> None:
        if draft is not None and draft.table is not target.table:
            raise ValueError("the sides of one process share one request table")
        self.target = target
        self.draft = draft

    @staticmethod
    def build(target: ModelRunner, draft: ModelRunner | None, keep_probs: bool, seed: int,
              speculation_ahead: bool = False) -> SpeculativeStep:
        """Both sides over two runners of one process (draft None: the target alone)."""
        table = RequestTable()
        eagle3 = draft is not None and draft.model_config.family == "eagle3"
        if eagle3:
            if speculation_ahead:
                raise ValueError("speculation ahead cannot be used with an EAGLE-3 head: the head drafts from the "
                                 "verify's hidden states, which do not exist before the verify has run")
            # Before the target's graphs are captured: they keep these states as a side output.
            Eagle3Proposer.keep_target_states(target, draft.model_config.aux_layer_ids)
        # The target's side first: its verifier captures the target's CUDA graphs before the draft loop's.
        target_side = TargetSide(target, seed, table)
        proposer = None
        if eagle3:
            proposer = Eagle3Proposer(draft, target, keep_probs, seed)
            # Every target forward's states go to the head, whether the head drafted in its step or not.
            target_side.verifier.on_forward = proposer.absorb_target
        draft_side = (DraftSide(draft, keep_probs, seed, speculation_ahead, table, proposer=proposer)
                      if draft is not None else None)
        return SpeculativeStep(target_side, draft_side)

    @property
    def table(self) -> RequestTable:
        return self.target.table

    def run(self, plan: StepPlan) -> StepResult:
        """Run a plan as sent (open entries resolved here); the result is recorded in the table."""
        return self.run_resolved(self.target.resolve(plan))

    def run_resolved(self, plan: StepPlan) -> StepResult:
        """Run a plan the table has resolved (`target.resolve`); the result is recorded in the table."""
        t0 = time.perf_counter()
        draft = self.draft
        # A step without speculation (load-adaptive k = 0) leaves the draft idle: skip even the proposer's
        # bookkeeping, so such a step costs what a step of a target-only engine costs.
        if draft is None or (not plan.max_draft_tokens and not any(r.draft_token_ids for r in plan.requests)):
            if draft is not None:
                draft.sit_out()
            result = self.target.verify(plan, None)
            book_no_proposal(result.phase_seconds)
            return result
        # Same process, same device: the proposal stays on the device and the verify forward is queued behind
        # the draft's kernels, so the host never waits for the draft. CUDA events time the draft's GPU work.
        marks = GpuMarks.start(draft.runner.device)
        ended: dict[str, float] = {}

        def timed(call: Call) -> None:
            if marks is not None and call.method == "propose":
                marks.mark()
            ended[call.method] = time.perf_counter()

        mode = StepMode(prepares_verify=False, speculation_ahead=draft.ahead is not None, draft_has_own_table=False)
        result = run_in_process({DRAFT: draft, TARGET: self.target}, mode, plan, timed)
        phases = result.phase_seconds
        if mode.speculation_ahead:
            book_speculation_ahead(phases, ended["speculate_ahead"] - ended["verify"])
            result.speculation_ahead_totals = draft.speculation_ahead_totals
            result.speculation_ahead_window = draft.take_speculation_ahead_window()
        book_local_proposal(phases, marks, ended["propose"] - t0, time.perf_counter() - t0)
        return result
