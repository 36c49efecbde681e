"""Merging several targets' draft plans into one draft step (engine/step/plan_merge.py), as a pooled draft group
batches them: each target's part of the merged proposal equals the proposal of its plan drafted alone, greedy and
seeded, over two steps (a prefill, then a decode that reads the KV the first wrote), on a Gemma 3 hybrid draft (two
KV-cache groups), each target in its own range of block ids. No Ray: the draft's proposer in process.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.runner.model_runner import ModelRunner
from engine.speculation.proposer import DraftProposer
from engine.step.plan import PlannedRequest, StepPlan
from engine.step.plan_merge import merge_plans, split_proposal

BLOCK, K = 4, 3


@pytest.fixture(scope="module")
def proposer(tiny_drafts) -> DraftProposer:
    ec = EngineConfig(device=torch.device("cpu"), dtype=torch.float32, max_model_len=64, block_size=BLOCK,
                      num_kv_blocks=64, num_speculative_tokens=K)
    mc = ModelConfig.from_path(tiny_drafts["gemma3-2l"].path)
    mc.max_model_len = ec.max_model_len
    runner = ModelRunner(mc, ec, "draft")
    assert len(runner.kv_groups) == 2
    return DraftProposer(runner, keep_probs=True, seed=0)


def _entry(rid: str, tokens: list[int], start: int, k: int, first_block: int, outputs: int,
           **sampling: object) -> PlannedRequest:
    tables = [list(range(first_block, first_block + 8)) for _ in range(2)]  # the same ids in both KV-cache groups
    return PlannedRequest(rid, tokens, start, k, True, [], draft_token_ids=tokens, draft_start_pos=start,
                          draft_block_tables=tables, draft_runs=True, num_output_tokens=outputs, **sampling)


def _tenants(step: int, last: dict[str, list[int]] | None, sampled: bool) -> list[StepPlan]:
    """Two targets' plans: A with two requests (k = 3 and k = 1), B with one (k = 2) and a k = 0 catch-up; each
    request in blocks of its own. Step 0 prefills the prompts; step 1 feeds each request's first draft and a token
    after it, as a step whose verify accepted one draft would."""
    prompts = random_prompts([5, 9, 7, 6], seed=11)
    spec = [("A/r0", 3, 1), ("A/r1", 1, 9), ("B/r0", 2, 17), ("B/r1", 0, 25)]
    entries = []
    for n, ((rid, k, block), prompt) in enumerate(zip(spec, prompts)):
        sampling = {"temperature": 0.8, "seed": 100 + n} if sampled else {}
        if step == 0:
            entries.append(_entry(rid, prompt, 0, k, block, 0, **sampling))
        else:
            fed = [(last[rid] or [5])[0], 7 + n]
            entries.append(_entry(rid, fed, len(prompt), k, block, 2, **sampling))
    mode = "probabilistic"
    return [StepPlan(step, entries[:2], mode), StepPlan(step, entries[2:], mode, finished_ids=["B/gone"])]


def _host(proposal, plan: StepPlan) -> tuple[list[list[int]], torch.Tensor | None]:
    host = proposal.to_host([r.num_draft_tokens for r in plan.requests])
    return host.draft_token_ids, host.draft_probs


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_merged_step_proposes_what_each_plan_alone_does(proposer: DraftProposer, sampled: bool) -> None:
    alone, last = [], None
    for step in range(2):
        plans = _tenants(step, last, sampled)
        outs = [_host(proposer.propose(p), p) for p in plans]
        alone.append(outs)
        last = {r.request_id: ids for p, (rows, _) in zip(plans, outs) for r, ids in zip(p.requests, rows)}
    last = None
    for step in range(2):
        plans = _tenants(step, last, sampled)
        merged = merge_plans(plans)
        assert merged.spans == [(0, 2), (2, 4)] and merged.plan.finished_ids == ["B/gone"]
        assert [r.request_id for r in merged.plan.requests] == [r.request_id for p in plans for r in p.requests]
        whole = proposer.propose(merged.plan)
        parts = split_proposal(whole.to_host([r.num_draft_tokens for r in merged.plan.requests]), merged)
        for plan, part, (ids, probs) in zip(plans, parts, alone[step]):
            assert part.draft_token_ids == ids
            width = max(r.num_draft_tokens for r in plan.requests)
            assert part.draft_probs.shape == (len(plan.requests), width, proposer.runner.vocab_size)
            assert part.draft_probs.is_contiguous() and part.draft_probs.untyped_storage().nbytes() == \
                part.draft_probs.numel() * 4  # its own rows only: what is sent is the part's
            torch.testing.assert_close(part.draft_probs, probs[:, :width], atol=1e-5, rtol=1e-4)
        last = {r.request_id: ids for p, part in zip(plans, parts)
                for r, ids in zip(p.requests, part.draft_token_ids)}
    assert [len(r) for r in last.values()] == [3, 1, 2, 0]


def test_plans_of_different_rejection_modes_are_not_merged() -> None:
    a, b = StepPlan(0, [], "probabilistic"), StepPlan(0, [], "strict")
    with pytest.raises(ValueError, match="rejection modes"):
        merge_plans([a, b])
    one = merge_plans([a])
    assert one.plan is a and one.spans == [(0, 0)]
