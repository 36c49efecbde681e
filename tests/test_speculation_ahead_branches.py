"""Speculation ahead with fan-out (EngineConfig.speculation_ahead_branches > 1, engine/speculation/ahead/branches.py):
up to
B windows per request, for the likeliest outcomes of its verify, every window but the argmax bonus one in scratch KV
blocks (engine/speculation/ahead/scratch_blocks.py). Everything a user sees must still be what plain speculation gives,
and the draft's KV after a hit on a scratch window must be what the ordinary path writes.
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
from engine.speculation.ahead import proposer as ahead_proposer
from engine.speculation.ahead.branches import ACCEPT, REJECT, BranchEstimates
from engine.speculation.ahead.cache import AheadStats
from engine.speculation.ahead.scratch_blocks import ScratchBlocks, copy_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

# A fixed k (the draft length rule off): windows drafted ahead for k hit, and are counted, at that k.
AHEAD = dict(ENGINE_KW, speculation_ahead=True, adaptive_draft_length=False)


def test_scratch_blocks_release_one_scope_and_keep_the_others() -> None:
    """A pooled draft's targets hold scratch blocks under their names (ScratchReserve): releasing one target's frees
    its blocks alone, for any scope to take again; the other's stay held and are never handed out twice; once none is
    held the reserve starts over in order, as an engine's own draft (unscoped) takes it at every pre-draft."""
    scratch = ScratchBlocks([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])  # two KV-cache groups, the same slots
    tables = [[1, 2, 3, 4], [5, 6, 7, 8]]
    a, _ = scratch.fork(tables, 4, 11, 4, "a")  # positions 4..11: blocks 1..2 of the request's tables
    b, b_tables = scratch.fork(tables, 8, 8, 4, "b")
    assert (a.first_block, a.blocks, b.blocks) == (1, [[10, 11], [20, 21]], [[12], [22]])
    assert b_tables == [[1, 2, 12], [5, 6, 22]] and scratch.num_used == 3
    assert scratch.fork(tables, 0, 11, 4, "c") is None  # three blocks wanted, two left
    scratch.release({"a"})
    assert scratch.num_used == 1 and scratch.reserve.held("a") == 0 and scratch.reserve.held("b") == 1
    c, _ = scratch.fork(tables, 0, 11, 4, "c")
    assert sorted(c.blocks[0]) == [10, 11, 13] and 12 not in c.blocks[0]  # b's block is still b's
    scratch.release({"b", "c"})
    assert scratch.num_used == 0
    assert scratch.fork(tables, 0, 3, 4)[0].blocks == [[10], [20]]  # in order again, unscoped


def _assert_all_released(llm: LLM) -> None:
    """As fan-out 1, and the scratch blocks in use are exactly those of windows still cached (for requests the next
    plan drops); emptying the cache frees them all."""
    _assert_released(llm)
    ahead = _ahead(llm)
    held = sum(len(e.fork.blocks[0]) for v in ahead.cache.entries.values() for e in v if e.fork is not None)
    assert ahead.scratch.num_used == held
    ahead.drop_all()
    assert ahead.scratch.num_used == 0 and not ahead.cache.entries


@pytest.mark.parametrize("target,draft,k,mode,async_,branches", [
    ("llama", "near", 3, "probabilistic", False, 2), ("qwen3", "near", 5, "strict", True, 4),
    ("gemma3", "gemma3-2l", 3, "probabilistic", True, 4), ("gemma3", "near", 4, "strict", False, 4),
    ("gemma3", "near", 3, "probabilistic", True, 2), ("mistral", "near", 2, "probabilistic", True, 4),
])
def test_branches_greedy_is_lossless(tiny_models, tiny_drafts, near_drafts, target_greedy, target, draft, k, mode,
                                     async_, branches):
    llm = LLM(tiny_models[target].path, draft_model=_draft(tiny_drafts, near_drafts, target, draft),
              num_speculative_tokens=k, rejection_sampling=mode, async_scheduling=async_,
              speculation_ahead_branches=branches, **AHEAD)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy(target)
    assert all(o.finish_reason == "length" and len(o.token_ids) == NEW_TOKENS for o in outs)
    stats = _ahead(llm).stats
    assert stats.lookups > 0 and stats.drafted_tokens > 0 and stats.unused_tokens <= stats.drafted_tokens
    assert stats.hits == stats.hits_accept + stats.hits_reject and stats.hits_reject > 0, stats
    _assert_all_released(llm)


def _window_positions(p, block_size: int) -> list[int]:
    """What a proposal writes for this draft input (its catch-up, then k - 1 drafts), and the earlier positions of
    the block it starts in (the fork copied them)."""
    start = p.draft_start_pos
    return list(range(start // block_size * block_size, start + len(p.draft_token_ids) + p.num_draft_tokens - 1))


def _scratch_hit_kv(llm: LLM, skip_copy_back: bool = False) -> dict[tuple[int, str], list[torch.Tensor]]:
    """Run PROMPTS greedily; after each proposal that took a window from scratch blocks, the draft's KV there."""
    ahead = _ahead(llm)
    hit_inputs: list = []
    lookup, propose = ahead._lookup, ahead.propose

    def rec_lookup(entries, p, plan):
        e = lookup(entries, p, plan)
        if e is not None and e.fork is not None:
            hit_inputs.append(p)
        return e

    def rec_propose(plan):
        hit_inputs.clear()
        out = propose(plan)
        for p in hit_inputs:
            seen[(plan.step_id, p.request_id)] = _kv_at(llm, p.draft_block_tables, _window_positions(p, 4))
        return out

    seen: dict[tuple[int, str], list[torch.Tensor]] = {}
    ahead._lookup, ahead.propose = rec_lookup, rec_propose
    if skip_copy_back:
        copy = ahead_proposer.copy_blocks
        scratch = set(ahead.scratch.ids[0])

        def fork_only(kv, src, dst):  # the forks still copy; the copy back of a hit does not
            if not set(src[0]) <= scratch:
                copy(kv, src, dst)

        ahead_proposer.copy_blocks = fork_only
    try:
        llm.generate(PROMPTS, GREEDY)
    finally:
        ahead_proposer.copy_blocks = copy_blocks
    return seen


def test_scratch_window_hit_leaves_the_kv_of_the_ordinary_path(tiny_models, tiny_drafts):
    # The Gemma 3 hybrid draft: a sliding-window and a full KV-cache group. After a hit on a window drafted in scratch
    # blocks, the draft's KV for the window's positions (and the earlier positions of its first block) must equal
    # what drafting afresh writes: a run without speculation ahead, at the same step (greedy: same schedule).
    target, draft = tiny_models["gemma3"].path, tiny_drafts["gemma3-2l"].path
    # The same schedule in both runs: a fixed k (the draft length rule's choices follow measured time).
    kw = dict(draft_model=draft, num_speculative_tokens=3, adaptive_draft_length=False, **ENGINE_KW)
    ahead_kv = _scratch_hit_kv(LLM(target, speculation_ahead=True, speculation_ahead_branches=4, **kw))
    assert len(ahead_kv) >= 3
    plain = LLM(target, **kw)
    propose = plain.engine.executor.proposer.propose
    plain_kv: dict[tuple[int, str], list[torch.Tensor]] = {}

    def rec_propose(plan, **kwargs):
        out = propose(plan, **kwargs)
        for p in plan.requests:
            if (plan.step_id, p.request_id) in ahead_kv:
                plain_kv[(plan.step_id, p.request_id)] = _kv_at(plain, p.draft_block_tables, _window_positions(p, 4))
        return out

    plain.engine.executor.proposer.propose = rec_propose
    plain.generate(PROMPTS, GREEDY)
    assert plain_kv.keys() == ahead_kv.keys()
    assert len(plain.engine.executor.draft.kv_caches) == 2  # both groups compared
    for key, groups in ahead_kv.items():
        for a, b in zip(groups, plain_kv[key], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Negative control: without the copy back, the request's own blocks keep what the argmax window or the
    # rejected drafts wrote there. (Compared at the first such hit: the drafts, and so the schedule, may differ
    # after it.)
    broken = _scratch_hit_kv(LLM(target, speculation_ahead=True, speculation_ahead_branches=4, **kw),
                             skip_copy_back=True)
    first = min(broken)
    assert first == min(ahead_kv)
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(broken[first], plain_kv[first]))


SEEDED_PROMPTS = random_prompts([5] * 6, seed=9)
# A low temperature: the target's token at a rejection is then often the draft's runner-up, so rejection windows hit.
SEEDED = [SamplingParams(max_tokens=24, temperature=0.2, seed=s, ignore_eos=True) for s in range(6)]


@pytest.fixture(scope="module")
def seeded_near(tiny_models, near_drafts) -> list[list[int]]:
    """Seeded sampled outputs of plain speculation with the near Llama draft (k=3): it rejects often enough for
    rejection windows to hit."""
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3, **ENGINE_KW)
    ref = [o.token_ids for o in llm.generate(SEEDED_PROMPTS, SEEDED)]
    assert len(set(map(tuple, ref))) > 3  # really sampled
    return ref


def _seeded_branches(tiny_models, near_drafts, stale: bool = False) -> tuple[list[list[int]], AheadStats]:
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
              speculation_ahead_branches=4, **AHEAD)
    ahead = _ahead(llm)
    if stale:  # each rejection window's q is the one drafted for the position before
        speculate_ahead = ahead.speculate_ahead

        def stale_speculate_ahead(plan, proposal):
            n = speculate_ahead(plan, proposal)
            for e in (e for v in ahead.cache.entries.values() for e in v):
                if e.probs is not None and e.kind == REJECT:
                    e.probs = torch.roll(e.probs, 1, dims=0)
            return n

        ahead.speculate_ahead = stale_speculate_ahead
    return [o.token_ids for o in llm.generate(SEEDED_PROMPTS, SEEDED)], ahead.stats


def test_branches_seeded_sampling_equals_plain_speculation(tiny_models, near_drafts, seeded_near):
    # A rejection window's drafts come from the generator the proposal after that rejection would use (seeded at
    # num_output_tokens + a + 1) and are verified with their own q: seeded outputs equal plain speculation's.
    outs, stats = _seeded_branches(tiny_models, near_drafts)
    assert outs == seeded_near
    assert stats.hits_reject > 5 and stats.hits_accept > 5, stats


def test_branches_stale_probabilities_are_caught(tiny_models, near_drafts, seeded_near):
    # Negative control of the test above, on rejection windows only: a q that is not their tokens' own changes
    # probabilistic acceptance, and the seeded outputs no longer match.
    outs, stats = _seeded_branches(tiny_models, near_drafts, stale=True)
    assert stats.hits_reject > 5
    assert outs != seeded_near


@pytest.mark.parametrize("mode,async_,draft", [("probabilistic", False, "draft"), ("strict", True, "self")])
def test_branches_sampling_follows_target_distribution(small_vocab_pair, mode, async_, draft):  # noqa: F811
    # As the fan-out 1 test: k = 1 with a one-token prompt, so windows drafted ahead propose token 3, inside the
    # three tokens whose joint law is enumerated; B = 3 (every branch of k = 1) adds the rejection window. The
    # pair's draft rarely guesses the target's token at a rejection; the target as its own draft under strict
    # acceptance (a rejection: the target's own sample differs from the draft's) often does.
    target_path, target_hf, draft_path, draft_hf = small_vocab_pair
    llm = LLM(target_path, draft_model=draft_path if draft == "draft" else target_path, num_speculative_tokens=1,
              rejection_sampling=mode, seed=4321, block_size=4, max_model_len=16, max_num_seqs=DIST_SAMPLES,
              max_num_batched_tokens=3 * DIST_SAMPLES, async_scheduling=async_, speculation_ahead=True,
              speculation_ahead_branches=3, adaptive_draft_length=False)
    outs = llm.generate([DIST_PROMPT] * DIST_SAMPLES, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))
    stats = _ahead(llm).stats
    # Ten thousand requests outgrow the scratch reserve (a quarter of the draft's blocks): some windows are skipped.
    assert stats.skipped_branches > 0 and stats.hits_reject > (DIST_SAMPLES // 10 if draft == "self" else 10), stats
    assert llm.engine.speculation_ahead_stats()[4] == stats.skipped_branches  # reported with the other counters
    # With the target as its own draft there is no other law to tell apart.
    assert_first_three_follow_target(outs, target_hf, draft_hf if draft == "draft" else None)


@pytest.mark.parametrize("async_", [False, True])
def test_branches_stop_token_and_max_tokens_inside_a_window(tiny_models, near_drafts, target_greedy, async_):
    # With the near draft both kinds of window hit, so stops and max_tokens land inside proposals that came from
    # the cache (the all-accepted ones and the rejection ones): the tokens after them are dropped.
    ref = target_greedy("llama")
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=4,
              async_scheduling=async_, speculation_ahead_branches=4, **AHEAD)
    stops_and_max_tokens_inside(llm, ref, past=5, max_tokens=9)
    assert _ahead(llm).stats.hits_reject > 0
    _assert_all_released(llm)


def test_branches_max_model_len(tiny_models, near_drafts):
    # Each window's k' is shrunk from its own outcome's token count: none reaches past max_model_len (no KV there;
    # a scratch fork beyond the request's tables is refused).
    llm = _exact_at_max_model_len(tiny_models["llama"].path, near_drafts["llama"].path, speculation_ahead_branches=4)
    assert _ahead(llm).stats.hits > 0
    _assert_all_released(llm)


@pytest.mark.parametrize("target,draft,k,async_,branches", [("llama", "near", 3, False, 2),
                                                            ("gemma3", "gemma3-2l", 4, True, 4)])
def test_branches_preemption(tiny_models, tiny_drafts, near_drafts, target_greedy, target, draft, k, async_,
                             branches):
    # 16 blocks per model, of which the draft keeps the few it can spare for scratch windows: preemptions happen
    # with branch windows cached; a preempted request resumes from position 0, so its windows miss and are dropped.
    llm = LLM(tiny_models[target].path, draft_model=_draft(tiny_drafts, near_drafts, target, draft),
              num_speculative_tokens=k, block_size=4, max_model_len=48, num_kv_blocks=16, async_scheduling=async_,
              speculation_ahead=True, speculation_ahead_branches=branches)
    assert 0 < _ahead(llm).scratch.capacity and llm.engine.draft_kv.pools[0].num_blocks == 16 - _ahead(
        llm).scratch.capacity
    outs = llm.generate(PROMPTS, GREEDY)
    assert any(o.num_preemptions > 0 for o in outs)
    assert [o.token_ids for o in outs] == target_greedy(target)
    _assert_all_released(llm)


def test_branches_abort_drops_the_windows(tiny_models, near_drafts, target_greedy):
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
              async_scheduling=True, speculation_ahead_branches=4, **AHEAD)

    def drafted(entries: list) -> None:  # its windows drafted ahead, three of them in scratch blocks
        assert len(entries) == 4 and sum(e.fork is not None for e in entries) == 3

    _abort_after_four_steps(llm, target_greedy, drafted)
    _assert_all_released(llm)


def test_branches_config_is_validated(tiny_models, tiny_drafts):
    path, draft = tiny_models["llama"].path, tiny_drafts["llama-1l"].path
    for bad in (0, 6, 2.0, True, "2"):  # k = 3: at most 5 distinct outcomes
        with pytest.raises(ValueError, match="speculation_ahead_branches"):
            LLM(path, draft_model=draft, num_speculative_tokens=3, speculation_ahead_branches=bad, **AHEAD)
    llm = LLM(path, draft_model=draft, num_speculative_tokens=3, speculation_ahead_branches=5, **AHEAD)
    assert _ahead(llm).num_branches == 5 and _ahead(llm).scratch.capacity > 0
    one = LLM(path, draft_model=draft, num_speculative_tokens=3, **AHEAD)
    assert _ahead(one).num_branches == 1 and _ahead(one).scratch.capacity == 0  # fan-out 1 reserves nothing
    assert one.engine.draft_kv.pools[0].num_blocks == llm.engine.draft_kv.pools[0].num_blocks + _ahead(
        llm).scratch.capacity


def test_synthetic_agreement_counts_rejection_windows(tiny_models, tiny_drafts):
    # Benchmark setting: under synthetic rejection a rejection window's guess counts as right at the agreement rate
    # too, so at rate 1 rejection windows hit wherever one was drafted for the outcome.
    path, draft = tiny_models["llama"].path, tiny_drafts["llama-1l"].path
    llm = LLM(path, draft_model=draft, num_speculative_tokens=3, rejection_sampling="synthetic",
              synthetic_acceptance_rate=0.5, synthetic_bonus_agreement=1.0, speculation_ahead_branches=5, **AHEAD)
    llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    stats = _ahead(llm).stats
    # Every outcome has a window (B = k + 2): every lookup after a request's first proposal hits.
    assert stats.hits_reject > 0 and stats.hits_accept > 0 and stats.hits >= stats.lookups - 2 * len(PROMPTS), stats


def test_agreement_setting_ranks_the_windows_it_credits():
    """Under the benchmarks' agreement setting the estimates score what a lookup credits (the argmax bonus guess
    and a rejection's guess at the rate, a second bonus guess never), not the synthetic pair's unrelated tokens:
    the second window is then the likeliest rejection's, which the setting can credit."""
    scored, real = BranchEstimates(), BranchEstimates()
    for n in range(200):  # a per-token rate of 0.9 at k=4: about 2 in 3 verifies accept all
        accepted = 4 if n % 3 else n % 4
        scored.observe_agreement(4, accepted, 0.7)
        # The same outcomes scored on unrelated tokens: no guess is ever right.
        real.observe(4, accepted, (1, 2) if accepted == 4 else (None, None), None if accepted == 4 else 5, 9)
    first, second = scored.ranked(4, 2)
    assert (first.kind, first.index) == (ACCEPT, 1) and (second.kind, second.index) == (REJECT, 0), (first, second)
    assert first.probability == pytest.approx(scored.alpha ** 4 * 0.7)  # the prior's 0.7 and the setting's
    assert [(b.kind, b.index) for b in real.ranked(4, 2)] == [(ACCEPT, 1), (ACCEPT, 2)]


def test_synthetic_agreement_two_windows_take_a_rejection(tiny_models, tiny_drafts):
    # With two windows a request, the second goes to the likeliest rejection (the setting credits it), not to a
    # second bonus guess (the setting never does): rejection windows hit.
    path, draft = tiny_models["llama"].path, tiny_drafts["llama-1l"].path
    llm = LLM(path, draft_model=draft, num_speculative_tokens=3, rejection_sampling="synthetic",
              synthetic_acceptance_rate=0.6, synthetic_bonus_agreement=1.0, speculation_ahead_branches=2, **AHEAD)
    llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    ahead = _ahead(llm)
    assert ahead.stats.hits_reject > 0 and ahead.stats.hits_accept > 0, ahead.stats
    # The estimates scored the setting's verdicts (every credited guess right at rate 1, over the priors' ten
    # verifies), not the unrelated tokens (where the rejection guesses were right 0 of 13 times in this run).
    est = ahead.estimates
    assert est.reject_right / est.reject_seen > 0.6 and est.bonus_right[0] / est.bonus_seen[0] > 0.8, est
    assert est.bonus_right[1] == 1.0, est  # the prior alone: a second bonus guess is never credited
