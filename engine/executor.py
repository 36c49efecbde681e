"""Executors run a StepPlan on the models. The in-process one calls the draft proposer and the target
verifier directly; the Ray one (serving/) sends the same plan to worker actors."""

from __future__ import annotations

import time
from typing import Protocol

from engine.kv_cache.spec import KVCacheGroupSpec
from engine.runner.model_runner import ModelRunner
from engine.spec.proposer import DraftProposer
from engine.spec.verifier import Verifier
from engine.step_plan import StepPlan, StepResult


class Executor(Protocol):
    target_kv_groups: list[KVCacheGroupSpec]
    target_num_blocks: int
    draft_kv_groups: list[KVCacheGroupSpec] | None
    draft_num_blocks: int
    vocab_size: int

    def execute(self, plan: StepPlan) -> StepResult: ...


class LocalExecutor:
    """Target and (optional) draft in this process."""

    def __init__(self, target: ModelRunner, draft: ModelRunner | None, keep_draft_probs: bool, seed: int) -> None:
        self.target = target
        self.draft = draft
        self.verifier = Verifier(target, seed)
        self.proposer = DraftProposer(draft, keep_draft_probs, seed) if draft is not None else None
        self.target_kv_groups = target.kv_groups
        self.target_num_blocks = target.num_blocks
        self.draft_kv_groups = draft.kv_groups if draft is not None else None
        self.draft_num_blocks = draft.num_blocks if draft is not None else 0
        self.vocab_size = target.vocab_size

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        # A step without speculation (load-adaptive k = 0) leaves the draft idle: skip even the proposer's
        # bookkeeping, so such a step costs what a step of a target-only engine costs.
        draft_idle = not plan.max_draft_tokens and not any(r.draft_token_ids for r in plan.requests)
        proposal = self.proposer.propose(plan).to_host() if self.proposer is not None and not draft_idle else None
        t1 = time.perf_counter()
        result = self.verifier.verify(plan, proposal)
        result.phase_seconds["propose"] = t1 - t0
        return result
