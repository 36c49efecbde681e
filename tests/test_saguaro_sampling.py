"""Saguaro sampling (engine/sample/saguaro.py): the draft draws from q' (q's top-F scaled by c, renormalised) and the
verify reads q'. The scaled distribution itself; exactness at the rejection sampler (chi-square of the first output
token and of the first two, k = 1..3) with the negative control of a verify against the stale, unscaled q; the
expected hit probability of a rejection's replacement against an enumeration and against the sampler's own counts;
the option's refusals; and, in the engine, the proposal carrying q' and the output following the target's law.
Statistical tests use fixed generators (deterministic) and spec_support's chi-square at p > 1e-3."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_prompts
from spec_support import ENGINE_KW, P_VALUE_THRESHOLD, chi_square
from test_spec_distribution import (
    DIST_PROMPT,
    SMALL_VOCAB,
    exact_joint,
    small_vocab_pair,  # noqa: F401 - the distribution test's fixture
)
from test_speculation_ahead import _ahead

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.sample.metadata import SamplingMetadata
from engine.sample.processing import logits_to_probs
from engine.sample.saguaro import (
    SaguaroSampling,
    replacement_hit_probability,
    saguaro_probs,
    sample_saguaro,
    top_mask,
)
from engine.speculation import verifier
from engine.speculation.ahead.saguaro import BRANCH_TOP_F
from engine.speculation.draft_loop import draw_distribution
from engine.speculation.proposer import DraftProposer
from engine.speculation.rejection_sampler import rejection_sample

pytestmark = pytest.mark.usefixtures("one_thread")

V, K = 12, 3
_g = torch.Generator().manual_seed(0)
# Target logits at positions 0..K (row K scores the bonus position), the draft's at 0..K-1: related, not equal.
TARGET_LOGITS = torch.randn(K + 1, V, generator=_g) * 1.2
DRAFT_LOGITS = TARGET_LOGITS[:K] + torch.randn(K, V, generator=_g)
# Row groups: (temperature, top_k, top_p) of both models, and the roots' fan-out F (top_f = F + 1 tokens scaled).
GROUPS = [((1.0, 0, 1.0), 1), ((1.0, 0, 1.0), 2), ((1.3, 8, 0.9), 1), ((1.3, 8, 0.9), 3)]
FACTOR = 0.25


def _random_q(rows: int, seed: int, top_k: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    md = SamplingMetadata.from_lists([1.0] * rows, [1.0] * rows, [top_k] * rows)
    return logits_to_probs(torch.randn(rows, V, generator=g) * 2, md)


# ---- the scaled distribution -------------------------------------------------------------------------------------

@pytest.mark.parametrize("top_f", [1, 3, [0, 1, 2, 5, 12, 3]])
def test_top_f_scaled_by_c_relative_to_the_rest(top_f):
    q = torch.cat([_random_q(3, seed=1), _random_q(3, seed=2, top_k=4)])  # the last rows: 8 tokens at 0
    scaled = saguaro_probs(q, top_f, FACTOR)
    torch.testing.assert_close(scaled.sum(-1), torch.ones(6), rtol=0, atol=1e-6)
    counts = [top_f] * 6 if isinstance(top_f, int) else top_f
    for i, f in enumerate(counts):
        top = set(q[i].argsort(descending=True)[:f].tolist())  # an independent ranking
        ratio = scaled[i] / q[i]  # q' / q: c / Z on the top-F, 1 / Z elsewhere (Z the row's normaliser)
        z = 1 - (1 - FACTOR) * q[i, list(top)].sum() if top else torch.tensor(1.0)
        for x in range(V):
            if q[i, x] == 0:
                assert scaled[i, x] == 0  # outside q's support stays outside
            else:
                want = (FACTOR if x in top else 1.0) / z
                assert math.isclose(ratio[x].item(), want.item(), rel_tol=1e-5), (i, x)
    assert not torch.equal(scaled, q)
    torch.testing.assert_close(saguaro_probs(q, top_f, 1.0), q, rtol=0, atol=1e-6)  # c = 1 scales nothing


def test_greedy_rows_are_untouched():
    q = _random_q(4, seed=3)
    one_hot = torch.nn.functional.one_hot(q.argmax(-1), V).float()
    both = torch.stack([one_hot[0], q[1], one_hot[2], q[3]])
    greedy = torch.tensor([True, False, True, False])
    scaled = saguaro_probs(both, 3, FACTOR, greedy=greedy)
    assert torch.equal(scaled[greedy], both[greedy]) and not torch.equal(scaled[~greedy], both[~greedy])
    assert torch.equal(saguaro_probs(one_hot, 3, FACTOR), one_hot)  # a one-hot row stays one-hot anyway
    # The drawing helper: greedy rows take their argmax and hand q on unchanged.
    md = SamplingMetadata.from_lists([0.0, 0.8, 0.0, 1.0], [1.0] * 4, [0] * 4,
                                     default_generator=torch.Generator().manual_seed(0))
    tokens, q_used = sample_saguaro(both, md, 3, FACTOR)
    assert tokens[0] == both[0].argmax() and tokens[2] == both[2].argmax()
    assert torch.equal(q_used[greedy], both[greedy])
    torch.testing.assert_close(q_used[~greedy], saguaro_probs(both[~greedy], 3, FACTOR))
    all_greedy = SamplingMetadata.from_lists([0.0] * 4, [1.0] * 4, [0] * 4)
    tokens, q_used = sample_saguaro(one_hot, all_greedy, 3, FACTOR)
    assert torch.equal(tokens, one_hot.argmax(-1)) and q_used is one_hot


def test_drawn_tokens_follow_the_scaled_distribution():
    n = 60_000
    q = _random_q(1, seed=4)
    md = SamplingMetadata.from_lists([1.0] * n, [1.0] * n, [0] * n, default_generator=torch.Generator().manual_seed(5))
    tokens, q_used = sample_saguaro(q.expand(n, V).contiguous(), md, 3, FACTOR)
    counts = torch.bincount(tokens, minlength=V)
    assert chi_square(counts, q_used[0])[1] > P_VALUE_THRESHOLD
    assert chi_square(counts, q[0])[1] < 1e-12  # and not q


def test_bad_arguments_are_refused():
    q = _random_q(2, seed=6)
    for c in (0, 0.0, -0.1, 1.5, float("nan"), True, "0.5", None):
        with pytest.raises(ValueError, match="factor"):
            saguaro_probs(q, 2, c)
    for f in (-1, V + 1, True, 2.0, [1], [1, 2, 3], [1, True], [-1, 2], [2, V + 1], torch.tensor([1])):
        with pytest.raises(ValueError, match="top_f"):
            saguaro_probs(q, f, FACTOR)
    with pytest.raises(ValueError, match="float32"):
        saguaro_probs(q.double(), 2, FACTOR)
    with pytest.raises(ValueError, match=r"\[rows, V\]"):
        saguaro_probs(q[None], 2, FACTOR)
    with pytest.raises(ValueError, match="greedy"):
        saguaro_probs(q, 2, FACTOR, greedy=torch.tensor([True, False, True]))
    md = SamplingMetadata.from_lists([1.0] * 3, [1.0] * 3, [0] * 3)
    with pytest.raises(ValueError, match="rows"):
        sample_saguaro(q, md, 2, FACTOR)
    for top_f, c in ((0, 0.5), (True, 0.5), (2, 1.0), (2, 0.0), (2, 2.0)):
        with pytest.raises(ValueError, match="top_f|factor|Saguaro"):
            SaguaroSampling(top_f, c)
    with pytest.raises(ValueError, match="fanout"):
        replacement_hit_probability(q, q, V, FACTOR)
    with pytest.raises(ValueError, match="same shape"):
        replacement_hit_probability(q[:1], q, 1, FACTOR)


def test_draft_loop_step_keeps_q_for_guessed_columns():
    # The draft loop's step (its CUDA graphs run the same function): drawn rows race on q', greedy rows and a
    # guessed column 0 (noise 1: the race is an argmax, the draft's own) on q.
    q = _random_q(4, seed=7)
    q[1] = torch.nn.functional.one_hot(q[1].argmax(), V).float()
    hook = SaguaroSampling(top_f=3, factor=FACTOR)
    temperature = torch.tensor([1.0, 0.0, 0.8, 0.8])
    guess = torch.tensor([0, 0, 1, 2])
    first = draw_distribution(q, hook, temperature, guess, torch.tensor([0]))
    scaled = saguaro_probs(q, 3, FACTOR)
    assert torch.equal(first[0], scaled[0]) and torch.equal(first[1], q[1]) and torch.equal(first[2:], q[2:])
    later = draw_distribution(q, hook, temperature, guess, torch.tensor([1]))
    assert torch.equal(later[[0, 2, 3]], scaled[[0, 2, 3]]) and torch.equal(later[1], q[1])


# ---- exactness at the rejection sampler ----------------------------------------------------------------------------

def _group_rows(n: int) -> tuple[SamplingMetadata, torch.Tensor]:
    """Row i is in GROUPS[i % len(GROUPS)]: its sampling settings, and its top_f (F + 1) per row."""
    rows = [GROUPS[i % len(GROUPS)] for i in range(n)]
    md = SamplingMetadata.from_lists([r[0][0] for r in rows], [r[0][2] for r in rows], [r[0][1] for r in rows])
    return md, torch.tensor([r[1] + 1 for r in rows])


def _processed(logits: torch.Tensor) -> torch.Tensor:
    """[m, V] logits -> [len(GROUPS), m, V] processed with each group's settings (row i: group i % len(GROUPS))."""
    small, _ = _group_rows(len(GROUPS))
    return logits_to_probs(logits.expand(len(GROUPS), *logits.shape), small)


def _verify(first: int, k: int, rows: torch.Tensor, md: SamplingMetadata, top_f: torch.Tensor, seed: int,
            stale: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One verify of k drafts from position `first` for the given rows: drafts drawn from q', verified with q'
    (or, stale, with q). Returns (outputs, num_accepted, drafts)."""
    n = len(rows)
    q = _processed(DRAFT_LOGITS[first:first + k])[rows % len(GROUPS)]
    scaled = saguaro_probs(q.reshape(n * k, V), top_f[rows].repeat_interleave(k), FACTOR).view(n, k, V)
    e = torch.empty(n, k, V).exponential_(generator=torch.Generator().manual_seed(seed))
    drafts = (scaled / e).argmax(-1)
    sub = SamplingMetadata.from_lists(md.temperature[rows].tolist(), md.top_p[rows].tolist(),
                                      md.top_k[rows].tolist(),  # the verify's own numbers, not the drafts'
                                      default_generator=torch.Generator().manual_seed(seed + 1000))
    out = rejection_sample(drafts, torch.full((n,), k), q if stale else scaled,
                           TARGET_LOGITS[first:first + k + 1].expand(n, k + 1, V), sub, "probabilistic")
    return out, drafts, q


N = 80_000  # requests per statistical test: 20k a group


@pytest.mark.parametrize("k", [1, 3])
def test_output_follows_target_and_stale_q_is_caught(k: int) -> None:
    # The first two output tokens of N requests: a request that output one token verifies again (k = 1, drafts
    # from q' at position 1), as the engine would.
    md, top_f = _group_rows(N)
    out, _, _ = _verify(0, k, torch.arange(N), md, top_f, seed=10 + k, stale=False)
    x0, x1 = out.output_token_ids[:, 0], out.output_token_ids[:, 1].clone()
    again = (out.num_output == 1).nonzero().squeeze(1)
    x1[again] = _verify(1, 1, again, md, top_f, seed=20 + k, stale=False)[0].output_token_ids[:, 0]
    stale_out, _, _ = _verify(0, k, torch.arange(N), md, top_f, seed=10 + k, stale=True)
    stale0 = stale_out.output_token_ids[:, 0]
    p = _processed(TARGET_LOGITS[:2])  # [groups, 2, V]
    for gi in range(len(GROUPS)):
        rows = slice(gi, None, len(GROUPS))
        counts = torch.bincount(x0[rows], minlength=V)
        stat, p_value, critical = chi_square(counts, p[gi, 0])
        assert p_value > P_VALUE_THRESHOLD, (gi, stat, critical)
        joint = torch.bincount(x0[rows] * V + x1[rows], minlength=V * V)
        assert chi_square(joint, torch.outer(p[gi, 0], p[gi, 1]))[1] > P_VALUE_THRESHOLD, gi
        # Negative control: the same drafts (from q') verified with the stale q they were not drawn from.
        wrong, _, critical = chi_square(torch.bincount(stale0[rows], minlength=V), p[gi, 0])
        assert wrong > 20 * critical, (gi, wrong, critical)
    # Both accepted drafts and rejections shaped the output.
    assert 0 < out.num_accepted.float().mean() < k and (out.num_accepted == k).any()
    assert not torch.equal(out.num_accepted, stale_out.num_accepted)


# ---- the replacement's hit probability -----------------------------------------------------------------------------

def _enumerated_hit(p: list[float], q: list[float], fanout: int, factor: float, top_f: int) -> float:
    """One row by enumeration, as the verify goes: d ~ q', rejected with probability 1 - min(1, p(d) / q'(d)),
    the replacement ~ norm(max(p - q', 0)); a hit if it is among q's top-`fanout` tokens other than d."""
    order = sorted(range(len(q)), key=lambda x: -q[x])
    scaled = [q[x] * (factor if x in order[:top_f] else 1.0) for x in range(len(q))]
    scaled = [s / sum(scaled) for s in scaled]
    residual = [max(a - b, 0.0) for a, b in zip(p, scaled)]
    z = sum(residual)
    total = 0.0
    for d in range(len(q)):
        reject = scaled[d] * (1 - min(1.0, p[d] / scaled[d])) if scaled[d] > 0 else 0.0
        roots = [x for x in order if x != d][:fanout]
        total += reject * sum(residual[x] for x in roots) / z if z > 0 else 0.0
    return total


@pytest.mark.parametrize("fanout,factor,top_f", [(1, 1.0, None), (1, 0.3, None), (3, 0.5, None), (2, 0.2, 2)])
def test_hit_probability_matches_enumeration(fanout, factor, top_f):
    p, q = _random_q(5, seed=8), _random_q(5, seed=9, top_k=7)
    got = replacement_hit_probability(p, q, fanout, factor, top_f)
    want = [_enumerated_hit(p[i].tolist(), q[i].tolist(), fanout, factor, top_f or fanout + 1) for i in range(5)]
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert replacement_hit_probability(p, p, fanout, 1.0).abs().max() < 1e-6  # q = p: never rejected


def test_hit_probability_matches_the_samplers_counts():
    # The rejection sampler's own outcomes at position 0 (k = 1): the share of requests that rejected d and
    # output one of q's top-F tokens other than d (the roots a tree would have cached) is the predicted figure.
    n = N
    md, top_f = _group_rows(n)
    out, drafts, q = _verify(0, 1, torch.arange(n), md, top_f, seed=30, stale=False)
    p = _processed(TARGET_LOGITS[:1])[:, 0]
    moved = []
    for gi, (_, fanout) in enumerate(GROUPS):
        rows = torch.arange(gi, n, len(GROUPS))
        masked = q[rows, 0].clone()
        masked[torch.arange(len(rows)), drafts[rows, 0]] = -1.0  # the roots exclude d
        roots = top_mask(masked, fanout)
        replaced = out.output_token_ids[rows, 0]
        hit = (out.num_accepted[rows] == 0) & roots[torch.arange(len(rows)), replaced]
        want = replacement_hit_probability(p[gi:gi + 1], q[gi:gi + 1, 0], fanout, FACTOR).item()
        plain = replacement_hit_probability(p[gi:gi + 1], q[gi:gi + 1, 0], fanout, 1.0).item()
        sigma = math.sqrt(want * (1 - want) / len(rows))
        assert abs(hit.double().mean().item() - want) < 5 * sigma + 1e-9, (gi, hit.double().mean().item(), want)
        moved.append(abs(want - plain) / sigma)
    assert max(moved) > 10, moved  # the scaling moved the figure: the test would see a lost scaling


# ---- the option, and the engine ------------------------------------------------------------------------------------

def test_option_is_refused_where_it_cannot_apply(tiny_models, near_drafts):
    base = dict(device=torch.device("cpu"), dtype=torch.float32, max_model_len=64, num_speculative_tokens=3)
    for c in (0, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="speculation_ahead_saguaro must be a factor"):
            EngineConfig(**base, speculation_ahead_saguaro=c).validate()
    with pytest.raises(ValueError, match="speculation_ahead_branches >= 2"):
        EngineConfig(**base, speculation_ahead_saguaro=0.5).validate()
    with pytest.raises(ValueError, match="needs speculation_ahead"):
        EngineConfig(**base, speculation_ahead=False, speculation_ahead_branches=2,
                     speculation_ahead_saguaro=0.5).validate()
    for c in (None, 1.0):  # off
        EngineConfig(**base, speculation_ahead_saguaro=c).validate()
    target, draft = tiny_models["llama"].path, near_drafts["llama"].path
    kw = dict(draft_model=draft, num_speculative_tokens=3, speculation_ahead_branches=2,
              speculation_ahead_saguaro=0.5, **ENGINE_KW)
    with pytest.raises(ValueError, match="speculation ahead on .it is off"):
        LLM(target, **kw)  # in process speculation ahead is off unless asked for
    with pytest.raises(ValueError, match="rejection_sampling='probabilistic'"):
        LLM(target, speculation_ahead=True, rejection_sampling="strict", **kw)
    with pytest.raises(ValueError, match="needs a draft model"):
        LLM(target, **dict(kw, draft_model=None), speculation_ahead=True)
    llm = LLM(target, draft_model=draft, num_speculative_tokens=3, speculation_ahead=True,
              speculation_ahead_branches=2, speculation_ahead_saguaro=1.0, **ENGINE_KW)
    assert llm.executor.proposer.saguaro is None  # 1: off


def test_proposals_carry_the_scaled_q(tiny_models, near_drafts, monkeypatch):
    # Every sampled draft, proposed now or from a window drafted ahead, reaches the verify with the q' it was drawn
    # from: each verified draft row is exactly one of the proposer's q' rows, and each q' is the scaled q of its
    # forward's logits.
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
              speculation_ahead=True, speculation_ahead_branches=4, speculation_ahead_saguaro=0.3, **ENGINE_KW)
    proposer: DraftProposer = llm.executor.proposer
    assert proposer.saguaro == SaguaroSampling(BRANCH_TOP_F, 0.3)
    draws: list[torch.Tensor] = []
    draw = proposer._draw

    def recording_draw(logits, md):
        tok, q_used = draw(logits, md)
        q = logits_to_probs(logits, md)
        greedy = md.temperature == 0
        assert torch.equal(q_used, saguaro_probs(q, BRANCH_TOP_F, 0.3, greedy))
        if (~greedy).any():
            assert not torch.equal(q_used[~greedy], q[~greedy])
            draws.append(q_used[~greedy])
        return tok, q_used

    verified: list[torch.Tensor] = []
    sample = verifier.rejection_sample

    def recording_sample(ids, num_draft, q, target_logits, md, mode, rate=None):
        if q is not None:
            drafted = (torch.arange(ids.shape[1]) < num_draft[:, None]) & (md.temperature > 0)[:, None]
            verified.append(q[drafted])
        return sample(ids, num_draft, q, target_logits, md, mode, rate)

    proposer._draw = recording_draw
    monkeypatch.setattr(verifier, "rejection_sample", recording_sample)
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=s, ignore_eos=True) for s in range(3)]
    params.append(SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))  # a greedy row beside them
    llm.generate(random_prompts([5] * 4, seed=9), params)
    stats = _ahead(llm).stats
    assert stats.hits_reject > 0 and stats.hits_accept > 0, stats
    drawn, checked = torch.cat(draws), torch.cat(verified)
    assert len(checked) > 20
    for row in checked:
        assert (drawn == row).all(-1).any()


def test_engine_output_follows_target_distribution(small_vocab_pair):  # noqa: F811
    # As test_branches_sampling_follows_target_distribution, with Saguaro sampling: k = 1, a one-token prompt and
    # B = 3 (every branch of k = 1), so the drafts of windows drafted ahead (token 2 after a rejection, token 3
    # after an accepted draft) fall inside the three tokens whose joint law is enumerated. Fewer requests than
    # there (this only checks the wiring; the sampler-level tests above carry the statistical weight).
    target_path, target_hf, draft_path, draft_hf = small_vocab_pair
    n = 4000
    llm = LLM(target_path, draft_model=draft_path, num_speculative_tokens=1, seed=99, block_size=4, max_model_len=16,
              max_num_seqs=n, max_num_batched_tokens=3 * n, speculation_ahead=True,
              speculation_ahead_branches=3, speculation_ahead_saguaro=FACTOR, adaptive_draft_length=False)
    # max_tokens=4: the windows after the first verify still have a draft to make (k' = 1).
    outs = llm.generate([DIST_PROMPT] * n, SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True))
    stats = _ahead(llm).stats
    assert stats.hits_reject > 10 and stats.hits_accept > 10, stats
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB, SMALL_VOCAB, dtype=torch.float64)
    for o in outs:
        counts[tuple(o.token_ids[:3])] += 1
    assert chi_square(counts, exact_joint(target_hf, DIST_PROMPT, 1.0, 0, 1.0))[1] > P_VALUE_THRESHOLD
    q = exact_joint(draft_hf, DIST_PROMPT, 1.0, 0, 1.0)
    support = q > 0
    assert chi_square(counts[support], q[support] / q[support].sum())[1] < 1e-6
