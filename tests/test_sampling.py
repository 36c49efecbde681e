"""logits_to_probs against HF's logits warpers, and Sampler: greedy, seeded, frequencies, masks.

Statistical tests use fixed seeds, so they are deterministic; each asserts a Pearson chi-square p-value
> 1e-3 (a correct sampler fails a given seed with probability 1e-3), and a negative control shows the same
test rejects a slightly wrong distribution.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sample.metadata import SamplingMetadata
from engine.sample.processing import apply_temperature_topk_topp, logits_to_probs
from engine.sample.sampler import Sampler, random_exponential, random_uniform

P_VALUE_THRESHOLD = 1e-3


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one cell.

    counts: [C] observed; probs: [C] expected distribution. Cells of probability 0 must be empty.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum() == 0, "sampled a token of probability 0"
    n = counts.sum()
    expected = probs * n
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(float(obs.numel() - 1), dtype=torch.float64)
    # chi2 survival function = regularized upper incomplete gamma Q(dof / 2, stat / 2); no scipy needed.
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def hf_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """HF generate's warper chain (temperature, top-k, top-p) for one row of logits."""
    scores = row.clone().view(1, -1)
    if temperature == 0:
        return torch.nn.functional.one_hot(row.argmax(), row.numel()).float()
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores.softmax(-1).view(-1)


ROW_SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 5, 1.0), (0.8, 0, 0.9), (1.2, 10, 0.5), (0.5, 3, 0.3),
    (1.0, 100, 1.0), (1.0, 0, 0.99), (0.0, 0, 1.0), (0.0, 4, 0.5), (2.0, 1, 1.0), (1.0, 0, 0.05),
]


@pytest.mark.parametrize("settings", [
    ROW_SETTINGS,  # everything mixed in one batch, greedy rows included
    [s for s in ROW_SETTINGS if s[1] == 0 and s[0] > 0],  # no_top_k, all random
    [s for s in ROW_SETTINGS if s[2] == 1.0],  # no_top_p
    [(t, 0, 1.0) for t in (0.3, 1.0, 3.0)],  # temperature only: the no-sort path
    [(0.0, 0, 1.0), (0.0, 3, 0.5)],  # all greedy
])
def test_logits_to_probs_matches_hf(settings: list[tuple[float, int, float]]) -> None:
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(len(settings), vocab) * 3
    md = SamplingMetadata.from_lists([s[0] for s in settings], [s[2] for s in settings],
                                     [s[1] for s in settings])
    probs = logits_to_probs(logits, md)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    for i, (t, k, p) in enumerate(settings):
        ref = hf_probs(logits[i], t, k, p)
        assert torch.equal(probs[i] > 0, ref > 0), f"row {i} {settings[i]}: kept set differs from HF"
        torch.testing.assert_close(probs[i], ref, atol=1e-6, rtol=1e-5)
        # A row's result does not depend on the other rows in the batch.
        alone = SamplingMetadata.from_lists([t], [p], [k])
        torch.testing.assert_close(logits_to_probs(logits[i:i + 1], alone)[0], probs[i], atol=0, rtol=0)


def test_logits_to_probs_3d_broadcasts_row_settings() -> None:
    torch.manual_seed(1)
    settings = ROW_SETTINGS[:6]
    md = SamplingMetadata.from_lists([s[0] for s in settings], [s[2] for s in settings],
                                     [s[1] for s in settings])
    logits = torch.randn(len(settings), 4, 30)
    probs = logits_to_probs(logits, md)
    for j in range(4):
        torch.testing.assert_close(probs[:, j], logits_to_probs(logits[:, j], md), atol=0, rtol=0)
    masked = apply_temperature_topk_topp(logits, md)
    assert torch.equal(torch.isinf(masked), probs == 0)


def test_greedy_rows_are_exact_argmax() -> None:
    torch.manual_seed(2)
    logits = torch.randn(64, 1000)
    temps = [0.0 if i % 3 == 0 else 1.0 for i in range(64)]
    md = SamplingMetadata.from_lists(temps, [0.9] * 64, [20] * 64,
                                     default_generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(-1)
    tokens, probs = Sampler().sample_with_probs(logits, md)
    greedy = torch.tensor(temps) == 0
    assert torch.equal(tokens[greedy], argmax[greedy])
    assert torch.equal(probs[greedy], torch.nn.functional.one_hot(argmax[greedy], 1000).float())
    all_greedy = SamplingMetadata.from_lists([0.0] * 64, [1.0] * 64, [0] * 64)
    assert torch.equal(Sampler()(logits, all_greedy), argmax)
    assert torch.equal(Sampler().sample_with_probs(logits, all_greedy)[0], argmax)


def test_seeded_row_alone_or_in_batch() -> None:
    torch.manual_seed(3)
    vocab = 500
    logits = torch.randn(6, vocab)
    seeds = {1: 1234, 4: 99}
    sampler = Sampler()
    for default_seed in (0, 1):
        gens = {row: torch.Generator().manual_seed(s) for row, s in seeds.items()}
        md = SamplingMetadata.from_lists([1.0, 0.8, 1.0, 1.3, 0.9, 0.0], [1.0, 0.95, 1.0, 1.0, 0.9, 1.0],
                                         [0, 0, 7, 0, 50, 0], generators=gens,
                                         default_generator=torch.Generator().manual_seed(default_seed))
        batch_tokens = [sampler(logits, md) for _ in range(20)]  # generators advance between calls
        for row, seed in seeds.items():
            gen = torch.Generator().manual_seed(seed)
            alone = SamplingMetadata.from_lists([md.temperature[row].item()], [md.top_p[row].item()],
                                                [int(md.top_k[row])], generators={0: gen},
                                                default_generator=torch.Generator().manual_seed(77))
            alone_tokens = [sampler(logits[row:row + 1], alone)[0] for _ in range(20)]
            assert [int(t[row]) for t in batch_tokens] == [int(t) for t in alone_tokens]


def test_random_helpers_respect_generators() -> None:
    gens = {2: torch.Generator().manual_seed(5)}
    md = SamplingMetadata.from_lists([1.0] * 4, [1.0] * 4, [0] * 4, generators=gens,
                                     default_generator=torch.Generator().manual_seed(0))
    u = random_uniform(md, (3, 2), "cpu")
    e = random_exponential(md, (7,), "cpu")
    ref = torch.Generator().manual_seed(5)
    assert torch.equal(u[2], torch.rand(3, 2, generator=ref))
    assert torch.equal(e[2], torch.empty(7).exponential_(generator=ref))
    assert u.shape == (4, 3, 2) and ((u >= 0) & (u < 1)).all() and (e > 0).all()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 8, 0.9), (1.7, 0, 0.7)])
def test_sampled_frequencies_match_probs(temperature: float, top_k: int, top_p: float) -> None:
    torch.manual_seed(4)
    vocab, n = 12, 100_000
    logits = torch.randn(vocab) * 1.5
    md = SamplingMetadata.from_lists([temperature] * n, [top_p] * n, [top_k] * n,
                                     default_generator=torch.Generator().manual_seed(11))
    one_row = SamplingMetadata.from_lists([temperature], [top_p], [top_k])
    probs = logits_to_probs(logits.view(1, -1), one_row)[0]
    tokens = Sampler()(logits.expand(n, vocab), md)
    counts = torch.bincount(tokens, minlength=vocab)
    assert chi_square_p_value(counts, probs) > P_VALUE_THRESHOLD
    # Negative control: the same counts reject the distribution with 2% of the top token's mass moved.
    wrong = probs.clone()
    top, other = probs.argsort()[-1], probs.argsort()[-2]
    wrong[top] -= 0.02
    wrong[other] += 0.02
    assert chi_square_p_value(counts, wrong) < 1e-6


def test_seeded_rows_frequencies() -> None:
    # One generator per row (the seeded path's Python loop), all with different seeds.
    vocab, n = 8, 20_000
    logits = torch.linspace(-1, 1, vocab)
    gens = {i: torch.Generator().manual_seed(1000 + i) for i in range(n)}
    md = SamplingMetadata.from_lists([0.9] * n, [1.0] * n, [0] * n, generators=gens)
    tokens = Sampler()(logits.expand(n, vocab), md)
    probs = (logits / 0.9).softmax(-1)
    assert chi_square_p_value(torch.bincount(tokens, minlength=vocab), probs) > P_VALUE_THRESHOLD


def test_top_k_top_p_never_sample_masked_tokens() -> None:
    torch.manual_seed(5)
    n, vocab = 4000, 200
    logits = torch.randn(n, vocab) * 2
    top_k = [1 + i % 5 for i in range(n)]
    top_p = [0.05 + 0.9 * (i % 7) / 7 for i in range(n)]
    md = SamplingMetadata.from_lists([1.5] * n, top_p, top_k,
                                     default_generator=torch.Generator().manual_seed(1))
    tokens, probs = Sampler().sample_with_probs(logits, md)
    assert (probs.gather(1, tokens[:, None]) > 0).all()
    ranks = (logits > logits.gather(1, tokens[:, None])).sum(1)  # 0 = the most likely token
    assert (ranks < torch.tensor(top_k)).all()
    # top_k=1 or a tiny top_p leaves only the argmax.
    only_top = SamplingMetadata.from_lists([2.0] * n, [1.0 if i % 2 else 0.001 for i in range(n)],
                                           [1 if i % 2 else 0 for i in range(n)],
                                           default_generator=torch.Generator().manual_seed(2))
    assert torch.equal(Sampler()(logits, only_top), logits.argmax(-1))
