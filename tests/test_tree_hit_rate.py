"""benchmarks/tree_hit_rate.py: the hit bookkeeping and schedule fit on a hand-computed case, and the script's
simulation on tiny random models (greedy output equal to HF's, every number consistent with its own lookups)."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from tree_hit_rate import kept_tokens, load_model, main, simulate  # noqa: E402
from tree_hit_stats import HitTable, Lookup, ngram_candidates, percentiles, root_rank  # noqa: E402

from engine.speculation.ahead.tree_roots import top_f_roots  # noqa: E402

# k = 2. Outcome 0: ranks 0, 2, 4; outcome 1: rank 1; outcome 2: ranks 0, 5. Prompt 1 holds the last two.
HAND = [Lookup(0, 0, 0), Lookup(0, 0, 2), Lookup(0, 1, 1), Lookup(0, 2, 0), Lookup(1, 2, 5), Lookup(1, 0, 4)]


def test_root_rank_is_the_place_in_top_f_roots():
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0, -1.0, 2.5],  # outcome 0, d_1 = 1 excluded: 5, 3, 2, 0, 4
                           [1.0, 0.0, 2.0, 2.0, 3.0, -2.0]])  # the bonus: 4, then the tie 2 before 3, 0, 1, 5
    assert root_rank(logits[0], 1, 5) == 0
    assert root_rank(logits[0], 1, 0) == 3
    assert root_rank(logits[0], 1, 1) == 6  # the excluded draft itself: no root is it
    assert [root_rank(logits[1], None, t) for t in range(6)] == [3, 4, 1, 2, 0, 5]
    roots = top_f_roots(logits, [1], [5, 6])  # outcome 0 has 5 candidates besides d_1
    for a, excluded in ((0, 1), (1, None)):
        for place, token in enumerate(roots[a]):
            assert root_rank(logits[a], excluded, token) == place


def test_ngram_candidates_follow_earlier_occurrences():
    ctx = [5, 6, 7, 5, 6, 8, 9, 5, 6]
    # the suffix (5, 6) was followed by 8 (most recent) and 7; then the suffix (6,) adds nothing new, nor (5, 6, ...)
    assert ngram_candidates(ctx, None) == [8, 7]
    assert ngram_candidates(ctx, 8) == [7]  # d_{a+1} is never a root
    assert ngram_candidates(ctx, None, limit=1) == [8]
    assert ngram_candidates([1, 2, 3], None) == []  # nothing repeats
    # a longer match first: (9, 5, 6) occurs nowhere earlier, (5, 6) twice
    assert ngram_candidates([5, 6, 1, 9, 5, 6, 2, 5, 6], None, max_n=3) == [2, 1]


def test_ngram_roots_add_hits_and_count_their_branches():
    # k = 1; the draft misses both lookups with F = 1; the n-gram's first candidate is t_a in the first, and its
    # candidates rank 0 (already a root) and 3 (a new branch) among the draft's
    t = HitTable(1, [Lookup(0, 0, 2, 0, (3, 0)), Lookup(0, 1, 5, 1, (0, 3))])
    assert t.hit_rate([1, 1]) == 0
    assert t.hit_rate_with_ngram([1, 1], 1) == 0.5
    assert t.hit_rate_with_ngram([1, 1], 2) == 1.0
    assert t.ngram_roots_per_lookup([1, 1], 1) == 0.5  # 3 >= 1 is new; 0 < 1 is already a root
    assert t.ngram_roots_per_lookup([1, 1], 2) == 1.0
    assert t.hit_rate_with_ngram([1, 1], 0) == t.hit_rate([1, 1])


def test_hand_computed_table():
    t = HitTable(2, HAND)
    assert t.count_by_outcome() == [3, 1, 2]
    assert t.outcome_distribution() == pytest.approx([1 / 2, 1 / 6, 1 / 3])
    assert t.hit_rate([1, 1, 1]) == pytest.approx(2 / 6)
    assert t.hit_rate_by_outcome([1, 1, 1]) == pytest.approx([1 / 3, 0, 1 / 2])
    assert t.hit_rate([2, 2, 1]) == pytest.approx(3 / 6)
    assert t.hit_rate_by_outcome([0, 2, 0]) == pytest.approx([0, 1, 0])
    assert t.drafted_ahead_per_lookup([2, 2, 1], depth=2) == 10
    # 6 lookups x 10 tokens drafted, 3 hits x 2 tokens proposed
    assert t.unused_share([2, 2, 1], depth=2) == pytest.approx(1 - 6 / 60)
    want = [[1 / 3, 1 / 3, 2 / 3], [0, 1, 1], [1 / 2, 1 / 2, 1 / 2]]
    for row, expected in zip(t.cumulative_agreement(3), want, strict=True):
        assert row == pytest.approx(expected)
    assert t.rank_percentiles(0, [0.5, 0.9, 1.0]) == [2, 4, 4]
    assert t.subset({1}).outcome_distribution() == pytest.approx([1 / 2, 0, 1 / 2])
    assert HitTable(2, []).hit_rate_by_outcome([1, 1, 1]) == [None, None, None]
    with pytest.raises(ValueError, match="k \\+ 1 = 3"):
        t.hit_rate([1, 1])


def test_best_schedule_by_hand_and_against_every_schedule():
    t = HitTable(2, HAND)
    assert t.best_schedule(2, 8) == [1, 0, 1]  # 2 hits; every other pair of branches hits 1
    assert t.best_schedule(8, 8) == [5, 2, 1]  # 5 hits; the sixth needs 5 more branches at outcome 2
    assert t.best_schedule(20, 4) == [3, 2, 1]  # at most 4 an outcome: rank 4 stays out, and 3 covers 0 and 2
    for cap in range(0, 14):
        best = t.hits(t.best_schedule(cap, 6))
        every = max(t.hits(s) for s in itertools.product(range(7), repeat=3) if sum(s) <= cap)
        assert best == every, cap


def test_smallest_tree_reaching_a_rate():
    t = HitTable(2, HAND)
    half = t.smallest_tree(0.5, 8, 20)  # 3 hits: no 3 branches do, [3, 0, 1] and [1, 2, 1] do
    assert sum(half) == 4 and t.hit_rate(half) == 0.5
    assert t.smallest_tree(1.0, 8, 20) == [5, 2, 6]
    assert t.smallest_tree(1.0, 4, 20) is None  # ranks 4 and 5 need more than 4 roots
    assert t.smallest_tree(1.0, 8, 12) is None


def test_kept_tokens_stop_at_eos_and_length():
    assert kept_tokens([5, 6, 7], {2}, 10) == (3, False)
    assert kept_tokens([5, 6, 2], {2}, 10) == (3, True)  # a stop token as the step's last token ends it too
    assert kept_tokens([2, 6, 7], {2}, 10) == (1, True)
    assert kept_tokens([5, 6, 7], {2}, 2) == (2, True)
    assert kept_tokens([5, 6, 7], {2}, 3) == (3, True)
    assert kept_tokens([5, 2, 7], set(), 10) == (3, False)


def test_percentiles_nearest_rank():
    assert percentiles(list(range(1, 11)), [0.1, 0.5, 0.9, 1.0]) == [1, 5, 9, 10]
    assert percentiles([7], [0.5]) == [7]
    assert percentiles([], [0.5]) == [None]
    with pytest.raises(ValueError):
        percentiles([1], [0.0])


def test_script_on_tiny_models(tiny_models, near_drafts, tmp_path, one_thread):
    target, draft = tiny_models["llama"], near_drafts["llama"]
    out = tmp_path / "hits.json"
    payload = main(["--target", target.path, "--draft", draft.path, "--prompts", "3", "--max-new-tokens", "16",
                    "--ignore-eos", "--temperature", "0", "0.7", "--fanout", "1,2", "--caps", "3,12",
                    "--json", str(out)])
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(payload["results"]))
    for res in payload["results"]:
        table = HitTable(4, [Lookup(*x) for x in res["lookup_ranks"]])
        assert res["lookups"] == len(table.lookups) > 0 and 1 <= res["acceptance_length"] <= 5
        assert sum(p["P(a)"] for p in res["positions"]) == pytest.approx(1)
        f1, f2 = res["uniform"]
        assert (f1["F"], f1["branches"], f1["drafted_ahead_per_lookup"]) == (1, 5, 20)
        assert f1["hit_rate"] == table.hit_rate([1] * 5) <= f2["hit_rate"] == table.hit_rate([2] * 5)
        assert f2["hit_rate"] == pytest.approx(sum(p["P(a)"] * p["top_f_agreement"][1] for p in res["positions"]))
        for capped in res["capped"]:
            assert sum(capped["schedule"]) <= capped["cap"]
            assert capped["hit_rate"] == table.hit_rate(capped["schedule"])
    # the draft agrees often enough for more than one outcome to happen
    assert sum(p["lookups"] > 0 for p in payload["results"][0]["positions"]) >= 2
    for res in payload["results"]:
        reach = res["reach"]
        assert reach["schedule"] is None or HitTable(4, [Lookup(*x) for x in res["lookup_ranks"]]).hit_rate(
            reach["schedule"]) >= 0.8
    # An earlier run's lookups, scored under other fan-outs without simulating.
    profile = tmp_path / "profile.json"
    again = main(["--from-json", str(out), "--fanout", "3", "--caps", "6", "--reach", "0.5", "--profile", str(profile)])
    # The profile the synthetic benchmarks read: per temperature, the per-outcome top-f agreement of the lookups.
    from agreement_profile import load_agreement

    for res in payload["results"]:
        table = HitTable(4, [Lookup(*x) for x in res["lookup_ranks"]])
        assert load_agreement(profile, res["T"]) == table.cumulative_agreement(8)
    with pytest.raises(ValueError, match="no top-f agreement profile at T=1.0"):
        load_agreement(profile, 1.0)
    for old, res in zip(payload["results"], again["results"], strict=True):
        table = HitTable(4, [Lookup(*x) for x in old["lookup_ranks"]])
        assert res["uniform"][0]["hit_rate"] == table.hit_rate([3] * 5)
        assert res["capped"][0]["schedule"] == table.best_schedule(6, 8)
        assert res["reach"]["schedule"] == table.smallest_tree(0.5, 64, 320)


def test_greedy_simulation_is_the_target_greedy(tiny_models, near_drafts, one_thread):
    target, draft = tiny_models["llama"], near_drafts["llama"]
    prompts = [[5, 9, 17, 3], [40, 41]]
    sim = simulate(load_model(target.path, "cpu"), load_model(draft.path, "cpu"), prompts, 3, 0.0, 10, "cpu",
                   ignore_eos=True)
    assert sim["outputs"] == [hf_greedy(target.hf, p, 10) for p in prompts]
