"""Speculation ahead's tree mode under the ahead budget (engine/speculation/ahead/budget.py): the engine caps each
step's tree nodes at what the measured seconds a node fit in the verify's shadow, the draft cuts its trees to the
cap (the unlikeliest outcomes' candidates first, down to one branch a request, or no tree at all), and outputs stay
exact whatever the cap. The rule is checked on synthetic timings; the engine is checked with a budget fed synthetic
timings too (a tree's seconds = its nodes x a fixed rate), so what the draft then drafts is deterministic."""

from __future__ import annotations

import pytest
from spec_support import ENGINE_KW, GREEDY, PROMPTS
from test_speculation_ahead import _ahead

from engine import LLM
from engine.speculation.ahead.budget import MAX_TREE_RETRY_STEPS, RETRY_STEPS, SMOOTHING, AheadBudget
from engine.speculation.ahead.tree_schedule import TreeSchedule
from engine.step.phases import VERIFY

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tree_budget_caps_nodes_at_what_fits_in_the_shadow():
    b = AheadBudget(1, tree=True)
    ks = [4] * 16  # c=16, k=4
    smallest = 16 * 5 + 16 * 4  # every chain (k + 1 nodes) and one branch of depth 4 a request
    assert b.tree_nodes(ks) == smallest  # nothing measured yet: the smallest tree, to measure it
    b.observe({VERIFY: 0.010}, (smallest, 0.0036))  # 25 us a node, a 10 ms shadow
    assert b.tree_nodes(ks) == 400
    b.observe({VERIFY: 0.010}, (400, 0.012))  # the larger tree outlasted the shadow (30 us a node): the cap comes down
    rate = 25e-6 + SMOOTHING * (30e-6 - 25e-6)
    assert b.tree_nodes(ks) == int(0.010 / rate) < 400
    assert b.tree_nodes([0, 4, 0]) == int(0.010 / rate)  # requests that draft nothing are not counted
    assert b.tree_nodes([]) is None and b.skipped_tree_steps == 0
    assert b.branches(16) == 1  # the window count stays one in tree mode


def test_tree_budget_skips_trees_that_do_not_fit_and_retries_later():
    b = AheadBudget(1, tree=True)
    ks = [3] * 4
    smallest = 4 * 4 + 4 * 3
    b.observe({VERIFY: 0.001}, (smallest, 0.004))  # even the smallest tree takes 4x the shadow
    assert b.tree_nodes(ks) == 0 and b.skipped_tree_steps == 1
    for _ in range(RETRY_STEPS):
        b.observe({VERIFY: 0.001}, None)  # no tree drafted: nothing measured
    assert b.tree_nodes(ks) == 0 and b.skipped_tree_steps == 2
    b.observe({VERIFY: 0.001}, None)
    assert b.tree_nodes(ks) == smallest  # the rate is stale: the smallest tree is measured again
    b.observe({VERIFY: 0.001}, (smallest, 0.0005))
    assert b.tree_nodes(ks) == int(0.001 / (0.0005 / smallest))  # a stale rate is replaced, not averaged in


def test_tree_budget_waits_twice_as_long_after_each_failed_retry_and_resets_on_a_fit():
    b = AheadBudget(1, tree=True)
    ks = [3] * 4
    smallest = 4 * 4 + 4 * 3

    def steps_until_retry() -> int:
        """Skipped steps until the budget asks for the smallest tree again; then that tree is measured (too slow)."""
        n = 0
        while b.tree_nodes(ks) == 0:
            b.observe({VERIFY: 0.001}, None)
            n += 1
        assert b.tree_nodes(ks) == smallest
        return n

    b.observe({VERIFY: 0.001}, (smallest, 0.004))  # the first measurement: 4x the shadow
    waits = []
    for _ in range(7):
        waits.append(steps_until_retry())
        b.observe({VERIFY: 0.001}, (smallest, 0.004))  # each retry: still 4x the shadow
    assert waits == [RETRY_STEPS + 1, 2 * RETRY_STEPS + 1, 4 * RETRY_STEPS + 1, 8 * RETRY_STEPS + 1,
                     MAX_TREE_RETRY_STEPS + 1, MAX_TREE_RETRY_STEPS + 1, MAX_TREE_RETRY_STEPS + 1]
    steps_until_retry()
    b.observe({VERIFY: 0.001}, (smallest, 0.0005))  # the verify's shadow now holds the tree
    assert b.tree_nodes(ks) > 0 and b.tree_retry_steps == RETRY_STEPS


def test_tree_budget_not_adaptive_leaves_the_draft_its_own_cap():
    b = AheadBudget(1, adaptive=False, tree=True)
    b.observe({VERIFY: 0.001}, (100, 1.0))
    assert b.tree_nodes([4] * 8) is None


def test_tree_schedule_cut_keeps_the_likeliest_outcomes():
    sched = TreeSchedule(max_fanout=1, vocab_size=100)
    # alpha 0.7, k = 4: P(a) = 0.3, 0.21, 0.147, 0.103 and 0.24 for the bonus.
    assert sched.fanout(4, 0.7, budget=2) == [1, 0, 0, 0, 1]  # outcome 0 and the bonus
    assert sched.fanout(4, 0.7, budget=1) == [1, 0, 0, 0, 0]
    assert sched.fanout(4, 0.7, budget=0) == [0] * 5
    wide = TreeSchedule(max_fanout=4, vocab_size=100)
    assert wide.fanout(4, 0.7, budget=100) == [4, 3, 2, 1, 3]
    assert wide.fanout(4, 0.7, budget=5) == [2, 1, 1, 0, 1]


class _Synthetic(AheadBudget):
    """An adaptive tree budget fed synthetic timings: a `verify`-second shadow, `rate` seconds a tree node."""

    def __init__(self, verify: float, rate: float) -> None:
        super().__init__(1, adaptive=True, tree=True)
        self.verify, self.rate = verify, rate

    def observe(self, phase_seconds, window) -> None:  # noqa: ANN001 - as AheadBudget.observe
        fake = (window[0], window[0] * self.rate) if window is not None else None
        super().observe({VERIFY: self.verify}, fake)


def _record_trees(llm: LLM) -> list[tuple[int | None, int]]:
    """For every pre-draft: (the plan's node cap, the nodes the draft then fed)."""
    ahead, seen = _ahead(llm), []
    speculate_ahead = ahead.speculate_ahead

    def recording(plan, proposal):  # noqa: ANN001, ANN202 - wraps AheadProposer.speculate_ahead
        before = ahead.stats.tree_nodes
        n = speculate_ahead(plan, proposal)
        seen.append((plan.ahead_tree_nodes, ahead.stats.tree_nodes - before))
        return n

    ahead.speculate_ahead = recording
    return seen


@pytest.mark.parametrize("verify,fits", [(0.040, 40), (0.016, 16)])
def test_engine_shrinks_the_tree_to_the_budget_and_greedy_stays_exact(tiny_models, near_drafts, target_greedy,
                                                                     verify, fits):
    # 1 ms a node: the cap is `fits` nodes. Three requests with k = 3: the smallest tree is 3 x 4 chain nodes and
    # 3 x 3 for one branch each (21 nodes); the draft's own cap (max_num_batched_tokens 20: 6 branches a request)
    # would feed up to 3 x (4 + 6 x 3) = 66. At 40 nodes the trees shrink; at 16 no tree fits while all three
    # requests decode, so those steps draft none (counted), and a tree comes back as requests finish.
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
              speculation_ahead=True, speculation_ahead_tree_fanout=3, **ENGINE_KW)
    llm.engine.speculation_ahead.budget = _Synthetic(verify, 0.001)
    seen = _record_trees(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == target_greedy("llama")
    capped = [(cap, nodes) for cap, nodes in seen if cap is not None]
    assert capped and all(nodes <= cap for cap, nodes in capped), seen
    measured = [(cap, nodes) for cap, nodes in capped[1:] if cap > 0]
    assert all(cap == fits for cap, _ in measured), seen  # after the first tree, the cap is what fits
    stats = _ahead(llm).stats
    if fits == 40:
        assert stats.hits > 0 and max(nodes for _, nodes in seen) > 21, (seen, stats)  # wider than the smallest
        assert stats.skipped_branches > 0 and stats.skipped_trees == 0
    else:
        assert llm.engine.speculation_ahead.budget.skipped_tree_steps > 0 and stats.skipped_trees > 0, (seen, stats)
        assert any(cap == 0 and nodes == 0 for cap, nodes in seen), seen


def test_tree_rows_are_bounded_by_the_q_they_keep(tiny_models, tiny_drafts, monkeypatch):
    """Sampled branches keep [branches, k, V] float32 q outside the KV cache's sizing: the row cap keeps it within
    TREE_Q_BYTES whatever max_num_batched_tokens allows."""
    from engine.speculation.ahead import tree as ahead_tree

    path, draft = tiny_models["llama"].path, tiny_drafts["llama-1l"].path
    monkeypatch.setattr(ahead_tree, "TREE_Q_BYTES", 4 * 3 * 1000 * 7)  # 7 branches of k=3 at a 1000-token vocab
    llm = LLM(path, draft_model=draft, num_speculative_tokens=3, speculation_ahead=True,
              speculation_ahead_tree_fanout=3, **dict(ENGINE_KW, max_num_batched_tokens=64))
    tree = _ahead(llm).tree
    vocab = tree.proposer.runner.vocab_size
    assert tree.max_rows == max(1, min(64, (4 * 3 * 1000 * 7) // (4 * vocab * 3)))
