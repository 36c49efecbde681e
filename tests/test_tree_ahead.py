"""Speculation ahead's tree mode (EngineConfig.speculation_ahead_tree_fanout > 0, engine/speculation/ahead/tree.py):
one tree per request over every outcome of its verify, drafted one batched forward per depth into scratch slots; a
hit proposes a branch and copies its KV into the request's blocks. Everything a user sees must be what plain
speculation gives, and the draft's KV after a hit must be what the ordinary path writes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from spec_support import ENGINE_KW, GREEDY, NEW_TOKENS, PROMPTS
from test_async_scheduling import _draft, stops_and_max_tokens_inside
from test_spec_distribution import (
    DIST_PROMPT,
    DIST_SAMPLES,
    assert_first_three_follow_target,
    small_vocab_pair,  # noqa: F401 - the distribution test's fixture
)
from test_speculation_ahead import (
    _abort_after_four_steps,
    _ahead,
    _assert_released,
    _exact_at_max_model_len,
    _kv_at,
)

from engine import LLM, SamplingParams
from engine.speculation.ahead import tree as ahead_tree
from engine.speculation.ahead.cache import NUM_TOTALS
from engine.speculation.ahead.tree_schedule import TreeSchedule

pytestmark = pytest.mark.usefixtures("one_thread")

# A fixed k (the draft length rule off): windows drafted ahead for k hit, and are counted, at that k.
TREE = dict(ENGINE_KW, speculation_ahead=True, speculation_ahead_tree_fanout=3, adaptive_draft_length=False)


def _assert_tree_stats(llm: LLM) -> None:
    stats = _ahead(llm).stats
    assert stats.lookups > 0 and stats.trees > 0 and stats.drafted_tokens > 0, stats
    assert stats.unused_tokens <= stats.drafted_tokens
    assert stats.hits == sum(stats.hits_by_outcome) == stats.hits_accept + stats.hits_reject, stats
    totals = llm.engine.speculation_ahead_stats()
    assert len(totals) == NUM_TOTALS and totals == stats.as_tuple()


@pytest.mark.parametrize("target,draft,k,mode,async_,block_size", [
    ("llama", "near", 3, "probabilistic", False, 4), ("qwen3", "near", 4, "strict", True, 4),
    ("gemma3", "gemma3-2l", 3, "probabilistic", True, 4), ("gemma3", "near", 4, "strict", False, 4),
    # The hybrid draft's sliding window (5) smaller than a block: prefix blocks wholly outside it are released.
    ("gemma3", "gemma3-2l", 3, "strict", False, 8),
])
def test_tree_greedy_is_lossless(tiny_models, tiny_drafts, near_drafts, target_greedy, target, draft, k, mode,
                                 async_, block_size):
    llm = LLM(tiny_models[target].path, draft_model=_draft(tiny_drafts, near_drafts, target, draft),
              num_speculative_tokens=k, rejection_sampling=mode, async_scheduling=async_,
              **dict(TREE, block_size=block_size))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy(target)
    assert all(o.finish_reason == "length" and len(o.token_ids) == NEW_TOKENS for o in outs)
    _assert_tree_stats(llm)
    stats = _ahead(llm).stats
    if draft == "near":  # a near draft's top-3 holds the target's token often: rejection outcomes hit too
        assert stats.hits_reject > 0, stats
    _assert_released(llm)


def test_tree_identical_draft_hits_almost_every_lookup(tiny_models, target_greedy):
    path = tiny_models["llama"].path
    llm = LLM(path, draft_model=path, num_speculative_tokens=3, **TREE)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == target_greedy("llama")
    stats = _ahead(llm).stats
    assert stats.hits >= stats.lookups - 2 * len(PROMPTS) and stats.hits_by_outcome[3] == stats.hits_accept > 0, stats


def _written(p) -> list[int]:
    """The positions a proposal writes for this draft input: its catch-up, then k - 1 drafts."""
    return list(range(p.draft_start_pos, p.draft_start_pos + len(p.draft_token_ids) + p.num_draft_tokens - 1))


def _hit_kv(llm: LLM, skip_copy: bool = False) -> dict[tuple[int, str], list[torch.Tensor]]:
    """Run PROMPTS greedily; after each proposal that took a tree branch, the draft's KV where it wrote."""
    ahead = _ahead(llm)
    hit_inputs: list = []
    lookup, propose = ahead._lookup, ahead.propose

    def rec_lookup(entries, p, plan):
        e = lookup(entries, p, plan)
        if e is not None and e.slots is not None:
            hit_inputs.append(p)
        return e

    def rec_propose(plan):
        hit_inputs.clear()
        out = propose(plan)
        for p in hit_inputs:
            seen[(plan.step_id, p.request_id)] = _kv_at(llm, p.draft_block_tables, _written(p))
        return out

    seen: dict[tuple[int, str], list[torch.Tensor]] = {}
    ahead._lookup, ahead.propose = rec_lookup, rec_propose
    copy = ahead_tree.copy_slots
    if skip_copy:
        ahead_tree.copy_slots = lambda *args: None
    try:
        llm.generate(PROMPTS, GREEDY)
    finally:
        ahead_tree.copy_slots = copy
    return seen


@pytest.mark.parametrize("block_size", [4, 8])
def test_tree_hit_leaves_the_kv_of_the_ordinary_path(tiny_models, near_drafts, block_size):
    # The near Gemma 3 draft: sliding-window layers (window 6; block 4, or 8: a window smaller than a block) and
    # full ones, two KV-cache groups. After a hit, the draft's KV at the positions the proposal stands for must equal
    # what drafting afresh writes: a run without speculation ahead, at the same step (greedy: the same schedule).
    target, draft = tiny_models["gemma3"].path, near_drafts["gemma3"].path
    kw = dict(draft_model=draft, num_speculative_tokens=3, adaptive_draft_length=False,  # one k: the same schedule
              **dict(ENGINE_KW, block_size=block_size))
    tree_kv = _hit_kv(LLM(target, speculation_ahead=True, speculation_ahead_tree_fanout=3, **kw))
    assert len(tree_kv) >= 3
    plain = LLM(target, **kw)
    assert len(plain.engine.executor.draft.kv_caches) == 2  # both groups compared
    propose = plain.engine.executor.proposer.propose
    plain_kv: dict[tuple[int, str], list[torch.Tensor]] = {}

    def rec_propose(plan, **kwargs):
        out = propose(plan, **kwargs)
        for p in plan.requests:
            if (plan.step_id, p.request_id) in tree_kv:
                plain_kv[(plan.step_id, p.request_id)] = _kv_at(plain, p.draft_block_tables, _written(p))
        return out

    plain.engine.executor.proposer.propose = rec_propose
    plain.generate(PROMPTS, GREEDY)
    assert plain_kv.keys() == tree_kv.keys()
    for key, groups in tree_kv.items():
        for a, b in zip(groups, plain_kv[key], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Negative control: without the copy, the request's blocks keep what the window's drafts or nothing wrote there.
    broken = _hit_kv(LLM(target, speculation_ahead=True, speculation_ahead_tree_fanout=3, **kw), skip_copy=True)
    first = min(broken)
    assert first == min(tree_kv)
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(broken[first], plain_kv[first]))


@pytest.mark.parametrize("async_", [False, True])
def test_tree_stop_token_and_max_tokens_inside_a_branch(tiny_models, near_drafts, target_greedy, async_):
    ref = target_greedy("llama")
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=4,
              async_scheduling=async_, **TREE)
    stops_and_max_tokens_inside(llm, ref, past=5, max_tokens=9)
    assert _ahead(llm).stats.hits > 0
    _assert_released(llm)


def test_tree_max_model_len(tiny_models):
    # No branch runs past max_model_len (the draft's position tables end there): outcomes too close get none.
    path = tiny_models["llama"].path
    llm = _exact_at_max_model_len(path, path, speculation_ahead_tree_fanout=2)
    assert _ahead(llm).stats.hits > 0
    _assert_released(llm)


@pytest.mark.parametrize("target,draft,k,async_", [("llama", "near", 3, False), ("gemma3", "gemma3-2l", 4, True)])
def test_tree_preemption(tiny_models, tiny_drafts, near_drafts, target_greedy, target, draft, k, async_):
    # 16 blocks per model (the draft keeps a quarter for the trees' scratch slots) force preemptions with branches
    # cached: a preempted request resumes from position 0, so its branches miss and are dropped.
    llm = LLM(tiny_models[target].path, draft_model=_draft(tiny_drafts, near_drafts, target, draft),
              num_speculative_tokens=k, block_size=4, max_model_len=48, num_kv_blocks=16, async_scheduling=async_,
              speculation_ahead=True, speculation_ahead_tree_fanout=2)
    reserved = len(_ahead(llm).tree.slots) // 4
    assert reserved > 0 and llm.engine.draft_kv.pools[0].num_blocks == 16 - reserved
    outs = llm.generate(PROMPTS, GREEDY)
    assert any(o.num_preemptions > 0 for o in outs)
    assert [o.token_ids for o in outs] == target_greedy(target)
    _assert_released(llm)


def test_tree_abort_drops_the_branches(tiny_models, near_drafts, target_greedy):
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
              async_scheduling=True, **TREE)

    def drafted(entries: list) -> None:
        # One tree: branches for the outcomes of its verify, the likeliest (a rejection at d_1, all accepted) first,
        # within the step's row budget (20 rows, three requests).
        outcomes = [e.outcome for e in entries]
        assert {0, 3} <= set(outcomes) and len(set(outcomes)) >= 3 and len(outcomes) <= 20 // 3, outcomes

    _abort_after_four_steps(llm, target_greedy, drafted)
    _assert_released(llm)


@pytest.mark.parametrize("mode,async_,saguaro", [("probabilistic", False, None), ("probabilistic", False, 0.25)])
def test_tree_sampling_follows_target_distribution(small_vocab_pair, mode, async_, saguaro):  # noqa: F811
    # As the window mode's test: k = 1 with a one-token prompt, so branches drafted ahead propose token 3, inside
    # the three tokens whose joint law is enumerated; the tree covers both outcomes (rejection and bonus).
    target_path, target_hf, draft_path, draft_hf = small_vocab_pair
    llm = LLM(target_path, draft_model=draft_path, num_speculative_tokens=1, rejection_sampling=mode, seed=4321,
              block_size=4, max_model_len=16, max_num_seqs=DIST_SAMPLES, max_num_batched_tokens=3 * DIST_SAMPLES,
              async_scheduling=async_, speculation_ahead=True, speculation_ahead_tree_fanout=2,
              adaptive_draft_length=False,
              speculation_ahead_saguaro=saguaro)  # Saguaro: drafts drawn from q' (top 3 scaled), verified with q'
    outs = llm.generate([DIST_PROMPT] * DIST_SAMPLES, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))
    stats = _ahead(llm).stats
    assert stats.hits_reject > 10 and stats.hits_accept > 10, stats
    assert_first_three_follow_target(outs, target_hf, draft_hf)


def test_tree_seeded_sampling_equals_plain_speculation(tiny_models):
    # Seeded sampled requests get trees: a branch of outcome a draws from the generator the proposal after that
    # outcome would (the seed at output position num_output_tokens + a + 1), so a hit proposes exactly what that
    # proposal would have drawn, q included, and outputs equal plain speculation's token for token.
    path = tiny_models["llama"].path
    prompts = random_prompts([5] * 3, seed=9)
    params = [SamplingParams(max_tokens=12, temperature=0.5, seed=s, ignore_eos=True) for s in range(3)]
    plain = LLM(path, draft_model=path, num_speculative_tokens=3, **ENGINE_KW).generate(prompts, params)
    llm = LLM(path, draft_model=path, num_speculative_tokens=3, **TREE)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    stats = _ahead(llm).stats
    assert stats.trees > 0 and stats.hits > 0, stats


def test_tree_schedule():
    sched = TreeSchedule(max_fanout=4, vocab_size=100)
    fan = sched.fanout(4, 0.7, budget=100)
    assert len(fan) == 5 and max(fan) == 4 and min(fan) >= 1
    assert fan[0] == 4 and fan[4] >= fan[3]  # a rejection at the first draft and the bonus are the likeliest
    cut = sched.fanout(4, 0.7, budget=5)
    assert sum(cut) == 5 and cut[0] >= cut[3]
    assert TreeSchedule(4, 3).fanout(2, 0.5, 100) == [2, 1, 1]  # never more candidates than the vocabulary leaves
    measured = TreeSchedule(4, 100, measured=[3, 1, 0])
    assert measured.fanout(4, 0.7, 100) == [3, 1, 0, 0, 0]


def test_tree_config_is_validated(tiny_models, tiny_drafts):
    path, draft = tiny_models["llama"].path, tiny_drafts["llama-1l"].path
    for bad in (-1, 65, 2.0, True, "2"):
        with pytest.raises(ValueError, match="speculation_ahead_tree_fanout"):
            LLM(path, draft_model=draft, num_speculative_tokens=3, **dict(TREE, speculation_ahead_tree_fanout=bad))
    with pytest.raises(ValueError, match="speculation_ahead_branches"):
        LLM(path, draft_model=draft, num_speculative_tokens=3, speculation_ahead_branches=2, **TREE)
    off = LLM(path, draft_model=draft, num_speculative_tokens=3, speculation_ahead=True, **ENGINE_KW)
    assert _ahead(off).tree is None
