"""The benchmarks' measured agreement profile (EngineConfig.synthetic_top_f_agreement, engine/agreement_profile.py,
engine/speculation/ahead/synthetic_agreement.py): with synthetic rejection a draft's candidates drafted ahead hit at a
real pair's top-f rate for their number, so tree mode's fan-out changes hits (one rate, synthetic_bonus_agreement,
cannot)."""

from __future__ import annotations

import pytest
from spec_support import ENGINE_KW, PROMPTS
from test_speculation_ahead import _ahead

from engine import LLM, SamplingParams
from engine.agreement_profile import AgreementProfile

pytestmark = pytest.mark.usefixtures("one_thread")

# k = 2: rejections at a = 0 and 1, then the bonus row; f = 1..3.
TABLE = [[0.2, 0.5, 0.6], [0.3, 0.3, 0.9], [0.7, 0.8, 1.0]]


def test_profile_rows_ranks_and_rates() -> None:
    prof = AgreementProfile.from_table(TABLE)
    assert prof.row(0, 2) == (0.2, 0.5, 0.6) and prof.row(2, 2) == (0.7, 0.8, 1.0)
    # another k: rejections past the profile's read its last rejection row; the bonus is always the last row
    assert prof.row(3, 4) == (0.3, 0.3, 0.9) and prof.row(4, 4) == (0.7, 0.8, 1.0)
    # a uniform u picks the candidate whose cumulative share it falls in; past the candidates drafted: no hit
    grid = [(i + 0.5) / 1000 for i in range(1000)]
    for a, row in enumerate(TABLE):
        for n in (1, 2, 3, 5):
            ranks = [prof.hit_rank(a, 2, n, u) for u in grid]
            assert sum(r is not None for r in ranks) / len(grid) == pytest.approx(row[min(n, 3) - 1], abs=1e-9)
            assert all(r is None or r < n for r in ranks)
            for r in range(min(n, 3)):  # candidate r agrees at row[r] - row[r - 1]
                assert ranks.count(r) / len(grid) == pytest.approx(row[r] - (row[r - 1] if r else 0.0), abs=1e-9)
    assert prof.guess_rates(2, 2) == pytest.approx((0.7, 0.1)) and prof.guess_rates(1, 2) == pytest.approx((0.3, 0.0))


@pytest.mark.parametrize(("table", "words"), [
    ([[0.5]], "at least 2 rows"),
    ("0.5", "at least 2 rows"),
    ([[0.5], []], "non-empty"),
    ([[0.5, 1.2], [0.1, 0.2]], "not a probability"),
    ([[0.5, 0.4], [0.1, 0.2]], "must not decrease"),
    ([[0.5], [0.1, 0.2]], "same fan-outs"),
])
def test_bad_profiles_are_refused(table, words) -> None:
    with pytest.raises(ValueError, match="synthetic_top_f_agreement") as err:
        AgreementProfile.from_table(table)
    assert words in str(err.value)


def _tree_hits(path: str, draft: str, fanout: int, table: list[list[float]]) -> tuple[int, int]:
    llm = LLM(path, draft_model=draft, num_speculative_tokens=2, rejection_sampling="synthetic",
              synthetic_acceptance_rate=0.5, synthetic_top_f_agreement=table, speculation_ahead=True,
              speculation_ahead_tree_fanout=fanout, adaptive_draft_length=False, **ENGINE_KW)  # a tree every step
    llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    stats = _ahead(llm).stats
    return stats.lookups, stats.hits


def test_tree_fanout_changes_synthetic_hits_as_the_profile_says(tiny_models, tiny_drafts) -> None:
    """A profile where only a second candidate ever agrees: a tree of one root an outcome never hits, one of two
    hits; a profile of certain agreement hits every lookup a tree was drafted for."""
    path, draft = tiny_models["llama"].path, tiny_drafts["llama-1l"].path
    second_only = [[0.0, 1.0]] * 3
    lookups, hits = _tree_hits(path, draft, 1, second_only)
    assert lookups > 0 and hits == 0
    lookups, hits = _tree_hits(path, draft, 2, second_only)
    assert hits > 0
    lookups, hits = _tree_hits(path, draft, 1, [[1.0]] * 3)
    assert hits >= lookups - 2 * len(PROMPTS) and hits > 0  # all but the first lookups (and a few at the ends)
    with pytest.raises(ValueError, match="synthetic_top_f_agreement is a benchmark setting"):
        LLM(path, draft_model=draft, num_speculative_tokens=2, synthetic_top_f_agreement=[[1.0]] * 3,
            speculation_ahead=True, **ENGINE_KW)
    with pytest.raises(ValueError, match="set one"):
        LLM(path, draft_model=draft, num_speculative_tokens=2, rejection_sampling="synthetic",
            synthetic_acceptance_rate=0.5, synthetic_top_f_agreement=[[1.0]] * 3, synthetic_bonus_agreement=0.5,
            speculation_ahead=True, **ENGINE_KW)
