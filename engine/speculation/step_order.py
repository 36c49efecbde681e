"""The order of one speculation step, written once: which side calls what, fed by which earlier outputs.

Both ways of running a step read `SPECULATION_STEP`: in one process `SpeculativeStep` (speculative_step.py) calls
the sides' methods in this order, passing outputs along; served with the draft on ranks of its own, the Ray
executor binds each call to the worker method of every rank of its side (serving/workers/step_topology.py), as
nodes of a compiled graph or as ordered actor calls.

    proposal = draft.propose(plan)                 # k tokens a request, from its speculation cache or drafted now
    prepared = target.prepare(plan)                # the verify input, built while the draft proposes (served)
    result   = target.verify(prepared, proposal)   # one forward over k + 1 positions, then rejection sampling
    draft.speculate_ahead()                        # speculation ahead: the next window, while the target verifies
    draft.absorb(result)                           # the draft's own request table learns the step's outcome

A call that does not run in a way of running a step (`Call.runs`) hands its first input on as its output: without
`prepare` the verify builds its input from the plan itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DRAFT = "draft"
TARGET = "target"
PLAN = "plan"  # the step's input: the plan, resolved by each side's request table


@dataclass(frozen=True)
class StepMode:
    """What a way of running a step has, which decides the calls that run in it."""

    prepares_verify: bool  # the target builds its verify input from the plan while the draft proposes
    speculation_ahead: bool  # the draft drafts the next window after each proposal
    draft_has_own_table: bool  # the draft keeps a request table of its own, which must learn each result


@dataclass(frozen=True)
class Call:
    side: str  # DRAFT | TARGET: whose method (DraftSide / TargetSide, speculative_step.py)
    method: str  # the side's method; its output is named after it
    inputs: tuple[str, ...] = ()  # outputs of earlier calls it reads, by method name, or PLAN
    after: tuple[str, ...] = ()  # earlier calls it must follow without reading their outputs
    needs: str | None = None  # the StepMode field that must be true for it to run; None: it always runs

    def runs(self, mode: StepMode) -> bool:
        return self.needs is None or getattr(mode, self.needs)


SPECULATION_STEP: tuple[Call, ...] = (
    Call(DRAFT, "propose", (PLAN,)),
    Call(TARGET, "prepare", (PLAN,), needs="prepares_verify"),
    Call(TARGET, "verify", ("prepare", "propose")),
    Call(DRAFT, "speculate_ahead", after=("propose",), needs="speculation_ahead"),
    Call(DRAFT, "absorb", ("verify",), after=("speculate_ahead",), needs="draft_has_own_table"),
)
RESULT = "verify"  # the call whose output is the step's result


def run_in_process(sides: dict[str, Any], mode: StepMode, plan: Any,
                   ended: Callable[[Call], None] = lambda call: None) -> Any:
    """Call the sides of one process in the step's order (`sides`: DRAFT and TARGET -> their side), passing outputs
    along; returns the step's result. ended(call): told as each call returns (the caller's timing)."""
    outputs: dict[str, Any] = {PLAN: plan}
    for call in SPECULATION_STEP:
        if call.runs(mode):
            outputs[call.method] = getattr(sides[call.side], call.method)(*(outputs[i] for i in call.inputs))
            ended(call)
        else:
            outputs[call.method] = outputs[call.inputs[0]] if call.inputs else None
    return outputs[RESULT]
