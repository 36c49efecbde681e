"""Speculation ahead's per-step fan-out (engine/speculation/ahead/budget.py): the engine caps each step's windows a
request
at the largest count whose run ahead fits in the verify, and the plan carries the cap to the draft. The rule is
checked on measurements given to it; the engine is checked to obey whatever count each plan carries (at most that
many windows a request, exact outputs whatever the counts), and to adapt only where runs ahead overlap the verify.
The same across processes: tests/test_ray_executor.py."""

from __future__ import annotations

import pytest
from spec_support import ENGINE_KW, GREEDY, PROMPTS
from test_speculation_ahead import _ahead
from test_speculation_ahead_branches import SEEDED, SEEDED_PROMPTS, seeded_near  # noqa: F401 - fixture

from engine import LLM
from engine.speculation.ahead import budget as budget_module
from engine.speculation.ahead.budget import HEADROOM, RETRY_STEPS, AheadBudget
from engine.step.phases import HANDOFF, SAMPLE, VERIFY

pytestmark = pytest.mark.usefixtures("one_thread")

# A fixed k (the draft length rule off): windows drafted ahead for k hit, and are counted, at that k.
AHEAD = dict(ENGINE_KW, speculation_ahead=True, adaptive_draft_length=False)


def _phases(verify: float, handoff: float = 0.0, sample: float = 0.0) -> dict[str, float]:
    return {VERIFY: verify, HANDOFF: handoff, SAMPLE: sample, "propose": 5.0}  # propose is not the shadow


def test_budget_climbs_while_runs_fit_and_stops_where_they_do_not():
    b = AheadBudget(4)
    assert b.branches(1) == 1  # no shadow measured yet
    b.observe(_phases(0.008, 0.001, 0.001), (1, 0.004))  # shadow 10 ms (handoff + verify + sample)
    assert b.branches(1) == 2  # one row ran in 4 ms, well under the shadow: two are tried
    b.observe(_phases(0.008, 0.001, 0.001), (2, 0.0084))
    assert b.branches(1) == 3  # two rows in 8.4 ms: under HEADROOM x 10 ms, so three are tried
    b.observe(_phases(0.008, 0.001, 0.001), (3, 0.0105))
    assert b.branches(1) == 2  # three rows outlast the shadow: back to two, which fit
    assert b.last == 2
    # Two rows fit, but not with room enough to try three again before their figure is stale.
    b.observe(_phases(0.008, 0.001, 0.001), (2, 0.0095))
    assert b.windows[2].value > HEADROOM * b.shadow.value
    assert b.branches(1) == 2


def test_budget_counts_rows_across_requests_and_comes_back_down():
    b = AheadBudget(3)
    b.observe(_phases(0.010), (4, 0.003))  # four requests, one window each: 3 ms
    b.observe(_phases(0.010), (8, 0.006))
    assert b.branches(4) == 3  # 8 rows (2 a request) in 6 ms fit with room: 12 rows are tried
    assert b.branches(2) == 3  # two requests: 4 rows (2 a request) ran in 3 ms, so 6 rows are tried
    # Runs grow (a longer context): the 8-row figure drifts past the shadow, and the budget follows it down.
    for _ in range(20):
        b.observe(_phases(0.010), (8, 0.013))
    assert b.windows[8].value > b.shadow.value
    assert b.branches(4) == 1


def test_budget_retries_a_count_whose_figure_went_stale():
    b = AheadBudget(2)
    b.observe(_phases(0.010), (1, 0.002))
    b.observe(_phases(0.010), (2, 0.020))  # two windows outlast the verify
    assert b.branches(1) == 1
    for _ in range(RETRY_STEPS):
        b.observe(_phases(0.010), (1, 0.002))
    assert b.branches(1) == 1  # still fresh
    b.observe(_phases(0.010), (1, 0.002))
    assert b.branches(1) == 2  # long enough ago that the machine may have changed: tried again
    b.observe(_phases(0.010), (2, 0.004))
    assert b.windows[2].value == pytest.approx(0.004)  # a stale figure is replaced, not averaged in
    assert b.branches(1) == 2


def test_budget_not_adaptive_takes_the_configured_count():
    b = AheadBudget(4, adaptive=False)
    b.observe(_phases(0.001), (4, 1.0))  # a run far past the verify changes nothing
    assert b.branches(1) == 4 and b.branches(8) == 4
    assert AheadBudget(1).branches(3) == 1


class _Script(AheadBudget):
    """A budget that gives each plan the next count of a script (cycled), to drive the draft."""

    def __init__(self, counts: list[int]) -> None:
        super().__init__(max(counts))
        self.counts = counts
        self.calls = 0

    def branches(self, num_requests: int) -> int:
        self.last = self.counts[self.calls % len(self.counts)]
        self.calls += 1
        return self.last


def record_speculation_ahead(llm: LLM, what) -> list:  # noqa: ANN001 - (plan, windows drafted) -> a record
    """Record what(plan, windows drafted) for every run ahead of the engine's draft."""
    ahead, seen = _ahead(llm), []
    speculate_ahead = ahead.speculate_ahead

    def recording(plan, proposal):
        n = speculate_ahead(plan, proposal)
        seen.append(what(plan, n))
        return n

    ahead.speculate_ahead = recording
    return seen


def _windows_per_request(llm: LLM) -> list[tuple[int, int]]:
    """Record, for every run ahead, (the plan's count, the most windows any request got)."""
    ahead = _ahead(llm)
    return record_speculation_ahead(llm, lambda plan, n: (plan.ahead_branches,
                                                  max((len(v) for v in ahead.cache.entries.values()), default=0)))


@pytest.mark.parametrize("counts", [[1], [2], [4, 1, 3, 2]])
def test_draft_obeys_each_plans_count_and_greedy_stays_exact(tiny_models, near_drafts, target_greedy, counts):
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
              speculation_ahead_branches=4, **AHEAD)
    llm.engine.speculation_ahead.budget = _Script(counts)
    seen = _windows_per_request(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == target_greedy("llama")
    assert seen and all(most <= count for count, most in seen), seen
    assert {count for count, _ in seen} == set(counts)
    assert max(most for _, most in seen) == max(counts)  # the fan-out is reached, not only capped
    stats = _ahead(llm).stats
    assert stats.hits > 0
    if counts == [1]:
        assert stats.hits_reject == 0  # one window a request is the all-accepted one: no rejection window at all
    else:
        assert stats.hits_reject > 0
    assert llm.engine.speculation_ahead_branches() == llm.engine.speculation_ahead.budget.last


def test_varying_counts_keep_seeded_sampling_exact(tiny_models, near_drafts, seeded_near):  # noqa: F811
    # Which outcomes have windows changes from step to step; each window is still what the proposal after its
    # outcome would draft, with its own q: seeded outputs equal plain speculation's.
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
              speculation_ahead_branches=4, **AHEAD)
    llm.engine.speculation_ahead.budget = _Script([3, 1, 4, 2])
    assert [o.token_ids for o in llm.generate(SEEDED_PROMPTS, SEEDED)] == seeded_near
    assert _ahead(llm).stats.hits_reject > 0


def test_in_process_engine_keeps_the_configured_count(tiny_models, tiny_drafts):
    # In one process the runs ahead follow the verify instead of overlapping it: no shadow to fit them in, so the
    # budget does not adapt and every plan asks for the configured count, which the draft reports runs of.
    llm = LLM(tiny_models["llama"].path, draft_model=tiny_drafts["llama-1l"].path, num_speculative_tokens=3,
              speculation_ahead_branches=3, **AHEAD)
    assert not llm.engine.speculation_ahead.budget.adaptive
    plans = []
    execute = llm.engine.executor.execute
    llm.engine.executor.execute = lambda plan, *a, **kw: plans.append(plan) or execute(plan, *a, **kw)
    llm.generate(PROMPTS, GREEDY)
    assert plans and {p.ahead_branches for p in plans} == {3}
    budget = llm.engine.speculation_ahead.budget
    assert budget.shadow is not None and budget.windows and all(w.value > 0 for w in budget.windows.values())


def test_adaptive_setting_is_validated(tiny_models, tiny_drafts):
    with pytest.raises(ValueError, match="speculation_ahead_adaptive"):
        LLM(tiny_models["llama"].path, draft_model=tiny_drafts["llama-1l"].path, num_speculative_tokens=3,
            speculation_ahead_adaptive="yes", **AHEAD)
    assert budget_module.SMOOTHING > 0
