"""Rejection sampling: exactness of the output distribution, greedy equality, synthetic rate, batching.

Statistical tests run one large batch with fixed generators, so they are deterministic; each asserts a
Pearson chi-square p-value > 1e-3 (a correct sampler fails a given seed with probability 1e-3), and a
negative control shows the test has the power to reject the draft's distribution. The synthetic-rate tests
allow 5 binomial standard deviations.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.sample.metadata import SamplingMetadata
from engine.sample.processing import logits_to_probs
from engine.speculation.rejection_sampler import (
    RejectionOutput,
    rejection_sample,
    rejection_sample_from_noise,
    synthetic_position_rate,
)

P_VALUE_THRESHOLD = 1e-3
V = 6
# Hand-built target p_j and draft q_j over a 6-token vocabulary (distinct values: no top-k ties).
TARGET_P = torch.tensor([
    [0.30, 0.24, 0.19, 0.12, 0.09, 0.06],
    [0.04, 0.38, 0.07, 0.22, 0.11, 0.18],
    [0.21, 0.17, 0.25, 0.14, 0.13, 0.10],
    [0.45, 0.08, 0.12, 0.15, 0.07, 0.13],
])
DRAFT_Q = torch.tensor([
    [0.10, 0.08, 0.40, 0.05, 0.33, 0.04],
    [0.06, 0.28, 0.03, 0.33, 0.12, 0.18],
    [0.42, 0.11, 0.09, 0.16, 0.07, 0.15],
])
TARGET_LOGITS, DRAFT_LOGITS = TARGET_P.log(), DRAFT_Q.log()
# (temperature, top_k, top_p); the second leaves p and q with different supports.
SETTINGS = [(1.0, 0, 1.0), (0.7, 4, 0.8)]


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit (cells of probability 0 must be empty; all expected >= 5 here)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum() == 0, "output a token of probability 0"
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    assert (expected >= 5).all()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))  # chi2 survival function, without scipy


def mixed_md(n: int, settings: list[tuple[float, int, float]], seed: int,
             generators: dict[int, torch.Generator] | None = None) -> SamplingMetadata:
    """Row i uses settings[i % len(settings)]."""
    rows = [settings[i % len(settings)] for i in range(n)]
    return SamplingMetadata.from_lists([r[0] for r in rows], [r[2] for r in rows], [r[1] for r in rows],
                                       generators=generators,
                                       default_generator=torch.Generator().manual_seed(seed))


def sample_drafts(q: torch.Tensor, seed: int) -> torch.Tensor:
    """[n, k, V] probabilities -> [n, k] tokens x_j ~ q_j (the draft model's sampling, outside the unit)."""
    e = torch.empty(q.shape).exponential_(generator=torch.Generator().manual_seed(seed))
    return (q / e).argmax(-1)


def fixed_step(n: int, k: int, md: SamplingMetadata, draft_seed: int, first: int = 0):
    """A batch of n requests whose target/draft rows are the hand-built ones from position `first` on.

    Rows cycle through at most len(SETTINGS) distinct settings (see `mixed_md`), so q is processed once per
    distinct row and broadcast (keeps the 200k-request tests fast).
    """
    target_logits = TARGET_LOGITS[first:first + k + 1].expand(n, k + 1, V)
    period = min(n, len(SETTINGS))
    small = SamplingMetadata.from_lists(md.temperature[:period].tolist(), md.top_p[:period].tolist(),
                                        md.top_k[:period].tolist())
    q_small = logits_to_probs(DRAFT_LOGITS[first:first + k].expand(period, k, V), small)
    q = q_small[torch.arange(n) % period]
    return sample_drafts(q, draft_seed), q, target_logits


def processed(logits: torch.Tensor, setting: tuple[float, int, float]) -> torch.Tensor:
    t, k, p = setting
    return logits_to_probs(logits.view(1, -1), SamplingMetadata.from_lists([t], [p], [k]))[0]


@pytest.mark.parametrize("mode", ["probabilistic", "strict"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_output_tokens_follow_target(mode: str, k: int) -> None:
    """The first output token follows p_0 exactly; the first two follow p_0(x0) p_1(x1).

    200k requests in one batch, rows alternating between the SETTINGS (plain, and temperature 0.7 with
    top-k/top-p on both p and q). Target rows are fixed rather than conditioned on tokens, so position 1
    must follow p_1 whatever was output at position 0. Requests that output a single token continue with a
    second verify step (k = 1: draft q_1, target p_1, p_2), as the engine would. In strict mode the joint
    also checks that the target's samples at different positions are independent.
    """
    n = 200_000
    md = mixed_md(n, SETTINGS, seed=k)
    drafts, q, target_logits = fixed_step(n, k, md, draft_seed=100 + k)
    out = rejection_sample(drafts, torch.full((n,), k), q, target_logits, md, mode)
    x0, x1 = out.output_token_ids[:, 0], out.output_token_ids[:, 1].clone()
    again = (out.num_output == 1).nonzero().squeeze(1)
    md2 = mixed_md(n, SETTINGS, seed=10 + k)  # same row -> setting map as md; only `again` rows are used
    drafts2, q2, target2 = fixed_step(n, 1, md2, draft_seed=200 + k, first=1)
    md2 = SamplingMetadata.from_lists(md2.temperature[again].tolist(), md2.top_p[again].tolist(),
                                      md2.top_k[again].tolist(), default_generator=md2.default_generator)
    out2 = rejection_sample(drafts2[again], torch.ones(len(again), dtype=torch.int64), q2[again],
                            target2[again], md2, mode)
    x1[again] = out2.output_token_ids[:, 0]
    for s, setting in enumerate(SETTINGS):
        rows = slice(s, None, len(SETTINGS))
        p0, p1 = processed(TARGET_LOGITS[0], setting), processed(TARGET_LOGITS[1], setting)
        counts = torch.bincount(x0[rows], minlength=V)
        assert chi_square_p_value(counts, p0) > P_VALUE_THRESHOLD
        # Negative control: the test has the power to see 3% of the draft's distribution mixed into p_0.
        q0 = processed(DRAFT_LOGITS[0], setting)
        assert chi_square_p_value(counts, 0.97 * p0 + 0.03 * q0) < 1e-6
        joint = torch.bincount(x0[rows] * V + x1[rows], minlength=V * V)
        assert chi_square_p_value(joint, torch.outer(p0, p1)) > P_VALUE_THRESHOLD


def test_identical_p_and_q_accepts_everything() -> None:
    n, k = 5000, 3
    for setting in SETTINGS:
        md = mixed_md(n, [setting], seed=3)
        target_logits = TARGET_LOGITS.expand(n, k + 1, V)
        q = logits_to_probs(target_logits[:, :k], md)
        drafts = sample_drafts(q, seed=4)
        out = rejection_sample(drafts, torch.full((n,), k), q, target_logits, md, "probabilistic")
        assert (out.num_accepted == k).all() and (out.num_output == k + 1).all()
        assert torch.equal(out.output_token_ids[:, :k], drafts)


def greedy_batch(n: int, max_k: int, vocab: int, seed: int):
    """Random target logits, drafts = target argmax with a mismatch injected at a random position."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(n, max_k + 1, vocab, generator=g)
    argmax = target_logits.argmax(-1)
    mismatch_at = torch.randint(0, max_k + 1, (n,), generator=g)  # max_k: no mismatch
    num_draft = torch.randint(0, max_k + 1, (n,), generator=g)
    pos = torch.arange(max_k)
    drafts = torch.where(pos == mismatch_at[:, None], (argmax[:, :max_k] + 1) % vocab, argmax[:, :max_k])
    drafts = torch.where(pos < num_draft[:, None], drafts, -1)
    expected_accepted = torch.minimum(mismatch_at, num_draft)
    return target_logits, argmax, drafts, num_draft, expected_accepted


def check_greedy_rows(out: RejectionOutput, rows: torch.Tensor, argmax: torch.Tensor,
                      expected_accepted: torch.Tensor) -> None:
    assert torch.equal(out.num_accepted[rows], expected_accepted[rows])
    pos = torch.arange(argmax.shape[1])
    want = torch.where(pos <= expected_accepted[:, None], argmax, -1)
    assert torch.equal(out.output_token_ids[rows], want[rows])


@pytest.mark.parametrize("mode", ["strict", "probabilistic"])
def test_greedy_rows_output_target_argmax(mode: str) -> None:
    n, max_k, vocab = 256, 4, 100
    target_logits, argmax, drafts, num_draft, expected = greedy_batch(n, max_k, vocab, seed=7)
    all_rows = torch.ones(n, dtype=torch.bool)
    md = SamplingMetadata.from_lists([0.0] * n, [1.0] * n, [0] * n)
    # q: the draft's one-hot (what a greedy draft yields) and, to be sure, an unrelated dense q.
    for q in (torch.nn.functional.one_hot(drafts.clamp(min=0), vocab).float(),
              torch.randn(n, max_k, vocab).softmax(-1)):
        out = rejection_sample(drafts, num_draft, q, target_logits, md, mode)
        check_greedy_rows(out, all_rows, argmax, expected)
    # Mixed batch: greedy rows stay exact next to random rows with top-k/top-p.
    temps = [0.0 if i % 2 == 0 else 0.9 for i in range(n)]
    md = SamplingMetadata.from_lists(temps, [0.8] * n, [5] * n,
                                     generators={1: torch.Generator().manual_seed(1)},
                                     default_generator=torch.Generator().manual_seed(2))
    q = logits_to_probs(torch.randn(n, max_k, vocab), md)
    out = rejection_sample(drafts, num_draft, q, target_logits, md, mode)
    check_greedy_rows(out, torch.tensor(temps) == 0, argmax, expected)


@pytest.mark.parametrize("rate", [0.0, 0.35, 0.8, 1.0])
def test_synthetic_acceptance_rate(rate: float) -> None:
    n = 50_000
    for k in (1, 3):
        md = mixed_md(n, [(1.0, 0, 1.0)], seed=k)
        drafts, _, target_logits = fixed_step(n, k, md, draft_seed=k)
        out = rejection_sample(drafts, torch.full((n,), k), None, target_logits, md, "synthetic", rate)
        # Each drafted position that is reached is accepted with probability a_k: estimate it as
        # accepted / attempted positions (attempted = accepted + 1 rejection, unless all k were accepted).
        a = synthetic_position_rate(rate, k)
        attempts = torch.clamp(out.num_accepted + 1, max=k).sum().item()
        est = out.num_accepted.sum().item() / attempts
        sigma = math.sqrt(a * (1 - a) / attempts)
        assert abs(est - a) <= 5 * sigma + 1e-12
        # ... and the acceptance rate users see (accepted / drafted) is the configured rate, for every k.
        mean = out.num_accepted.double().mean().item() / k
        dist = [a ** j * (1 - a) for j in range(k)] + [a ** k]
        var = sum(p * j * j for j, p in enumerate(dist)) - sum(p * j for j, p in enumerate(dist)) ** 2
        assert abs(mean - rate) <= 5 * math.sqrt(var / n) / k + 1e-12
        if 0 < rate < 1:
            # The token output at a rejection is the target's own sample: follows p_0 at position 0.
            rejected0 = out.num_accepted == 0
            counts = torch.bincount(out.output_token_ids[rejected0, 0], minlength=V)
            assert chi_square_p_value(counts, TARGET_P[0]) > P_VALUE_THRESHOLD


def test_zero_drafts_is_plain_decode() -> None:
    n = 50_000
    md = mixed_md(n, [(0.7, 4, 0.8)], seed=5)
    p0 = processed(TARGET_LOGITS[0], (0.7, 4, 0.8))
    for mode in ("probabilistic", "strict", "synthetic"):
        rate = 0.5 if mode == "synthetic" else None
        # max_k = 2 with every row at 0 drafts, and max_k = 0 (no draft tensors at all).
        padded = rejection_sample(torch.full((n, 2), -1), torch.zeros(n, dtype=torch.int64),
                                  torch.zeros(n, 2, V), TARGET_LOGITS[:3].expand(n, 3, V), md, mode, rate)
        empty = rejection_sample(torch.empty(n, 0, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
                                 None, TARGET_LOGITS[:1].expand(n, 1, V), md, mode, rate)
        for out in (padded, empty):
            assert (out.num_accepted == 0).all() and (out.num_output == 1).all()
            assert (out.output_token_ids[:, 1:] == -1).all()
            counts = torch.bincount(out.output_token_ids[:, 0], minlength=V)
            assert chi_square_p_value(counts, p0) > P_VALUE_THRESHOLD


@pytest.mark.parametrize("mode", ["probabilistic", "strict", "synthetic"])
def test_padding_beyond_num_draft_tokens_is_ignored(mode: str) -> None:
    n, max_k, vocab = 400, 4, 10
    g = torch.Generator().manual_seed(0)
    num_draft = torch.randint(0, max_k + 1, (n,), generator=g)
    target_logits = torch.randn(n, max_k + 1, vocab, generator=g)
    md_args = dict(temperature=[1.0] * n, top_p=[0.9] * n, top_k=[0] * n)
    q = logits_to_probs(target_logits[:, :max_k] + torch.randn(n, max_k, vocab, generator=g),
                        SamplingMetadata.from_lists(**md_args))
    drafts = sample_drafts(q, seed=1)
    pad = torch.arange(max_k) >= num_draft[:, None]
    rate = 0.7 if mode == "synthetic" else None
    outs = []
    for filler in ("clean", "garbage"):
        d = drafts.masked_fill(pad, -1) if filler == "clean" else \
            torch.where(pad, torch.randint(0, vocab, drafts.shape, generator=g), drafts)
        qq = q.masked_fill(pad[..., None], 0.0) if filler == "clean" else \
            torch.where(pad[..., None], torch.rand(q.shape, generator=g), q)
        md = SamplingMetadata.from_lists(**md_args, default_generator=torch.Generator().manual_seed(3))
        outs.append(rejection_sample(d, num_draft, qq, target_logits, md, mode, rate))
    assert torch.equal(outs[0].output_token_ids, outs[1].output_token_ids)
    assert (outs[0].num_accepted <= num_draft).all()
    valid = torch.arange(max_k + 1) < outs[0].num_output[:, None]
    assert ((outs[0].output_token_ids >= 0) == valid).all()


@pytest.mark.parametrize("mode", ["probabilistic", "strict", "synthetic"])
def test_seeded_rows_independent_of_batch(mode: str) -> None:
    n, max_k, vocab = 10, 3, 50
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(n, max_k + 1, vocab, generator=g)
    settings = [(0.9, 0, 1.0), (1.2, 10, 0.9), (0.0, 0, 1.0), (0.6, 0, 0.7), (1.0, 5, 1.0)]
    seeds = {2: 42, 3: 7, 7: 2024}
    rate = 0.6 if mode == "synthetic" else None

    def run(rows: list[int], default_seed: int) -> RejectionOutput:
        gens = {i: torch.Generator().manual_seed(seeds[r]) for i, r in enumerate(rows) if r in seeds}
        rs = [settings[r % len(settings)] for r in rows]
        md = SamplingMetadata.from_lists([s[0] for s in rs], [s[2] for s in rs], [s[1] for s in rs],
                                         generators=gens,
                                         default_generator=torch.Generator().manual_seed(default_seed))
        tl = target_logits[rows]
        q = logits_to_probs(tl[:, :max_k] * 0.5, md)
        drafts = torch.stack([sample_drafts(q[i:i + 1], seed=r)[0] for i, r in enumerate(rows)])
        return rejection_sample(drafts, torch.full((len(rows),), max_k), q, tl, md, mode, rate)

    batch_a, batch_b = run(list(range(n)), 0), run(list(range(n)), 1)
    for r in seeds:
        alone = run([r], 5)
        for batch in (batch_a, batch_b):
            assert torch.equal(batch.output_token_ids[r], alone.output_token_ids[0])
            assert batch.num_accepted[r] == alone.num_accepted[0]


def test_bad_mode_and_rate_raise() -> None:
    n, k = 2, 1
    md = mixed_md(n, [(1.0, 0, 1.0)], seed=0)
    drafts, q, target_logits = fixed_step(n, k, md, draft_seed=0)
    num_draft = torch.full((n,), k)
    with pytest.raises(ValueError, match="mode"):
        rejection_sample(drafts, num_draft, q, target_logits, md, "greedy")
    for rate in (None, -0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="synthetic_acceptance_rate"):
            rejection_sample(drafts, num_draft, q, target_logits, md, "synthetic", rate)
    with pytest.raises(ValueError, match="synthetic_acceptance_rate"):
        rejection_sample(drafts, num_draft, q, target_logits, md, "strict", 0.5)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(drafts, num_draft, None, target_logits, md, "probabilistic")
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(drafts, num_draft, q, target_logits[:, :1], md, "probabilistic")


# ---- Oracle: batch-1 reference that reads like the paper, matched draw for draw -------------------------

def reference_step(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None, u: torch.Tensor,
                   e: torch.Tensor, mode: str, rate: float | None) -> list[int]:
    """One request. p: [k+1, V] target, q: [k, V] draft, u: [k] uniforms, e: [k+1, V] Exp(1) noise."""

    def sample(dist: torch.Tensor, j: int) -> int:  # exponential race with position j's noise
        return int((dist / e[j]).argmax())

    out: list[int] = []
    for j, x in enumerate(drafts):
        if mode == "probabilistic":
            if u[j] * q[j, x] < p[j, x]:  # u < min(1, p(x) / q(x))
                out.append(x)
                continue
            residual = (p[j] - q[j]).clamp(min=0)  # norm(max(0, p - q)); p itself if empty
            out.append(sample(residual if residual.sum() > 0 else p[j], j))
            return out
        if mode == "strict":
            t = sample(p[j], j)  # the target's own token
            if x == t:
                out.append(x)
                continue
            out.append(t)
            return out
        if u[j] < synthetic_position_rate(rate, len(drafts)):  # synthetic
            out.append(x)
            continue
        out.append(sample(p[j], j))
        return out
    out.append(sample(p[len(drafts)], len(drafts)))  # bonus token
    return out


@pytest.mark.parametrize("mode", ["probabilistic", "strict", "synthetic"])
def test_vectorized_matches_reference_draw_for_draw(mode: str) -> None:
    n, max_k, vocab = 600, 4, 8
    g = torch.Generator().manual_seed(123)
    settings = [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.3, 0, 0.6), (0.9, 5, 0.8)]
    md = mixed_md(n, settings, seed=0)
    target_logits = torch.randn(n, max_k + 1, vocab, generator=g) * 2
    p = logits_to_probs(target_logits, md)
    q = logits_to_probs(target_logits[:, :max_k] + torch.randn(n, max_k, vocab, generator=g), md)
    drafts = sample_drafts(q, seed=1)
    uniforms = torch.rand(n, max_k, generator=g)
    noise_positions = max_k + 1 if mode == "strict" else 1
    exponentials = torch.empty(n, noise_positions, vocab).exponential_(generator=g)
    if mode == "strict":
        # Make long accepted prefixes likely: drafts copy the target's tokens, then diverge at random.
        target_tokens = (p / exponentials).argmax(-1)[:, :max_k]
        keep = torch.rand(n, max_k, generator=g) < 0.8
        drafts = torch.where(keep, target_tokens, drafts)
    # A few drafts the draft could not have sampled (q(x) = 0 possible): still handled identically.
    odd = torch.rand(n, max_k, generator=g) < 0.05
    drafts = torch.where(odd, torch.randint(0, vocab, drafts.shape, generator=g), drafts)
    num_draft = torch.randint(0, max_k + 1, (n,), generator=g)
    drafts = drafts.masked_fill(torch.arange(max_k) >= num_draft[:, None], -1)
    rate = 0.6 if mode == "synthetic" else None

    out = rejection_sample_from_noise(drafts, num_draft, q, p, mode, rate, uniforms, exponentials)
    seen_accepted = set()
    for i in range(n):
        k = int(num_draft[i])
        e = exponentials[i, :k + 1] if mode == "strict" else exponentials[i, 0].expand(k + 1, vocab)
        ref = reference_step(drafts[i, :k].tolist(), p[i, :k + 1], q[i, :k], uniforms[i, :k], e, mode, rate)
        got = out.output_token_ids[i]
        assert got[:len(ref)].tolist() == ref, f"request {i}"
        assert (got[len(ref):] == -1).all() and int(out.num_accepted[i]) == len(ref) - 1
        seen_accepted.add(len(ref) - 1)
    assert seen_accepted == set(range(max_k + 1))  # every prefix length was exercised
