"""Speculative sampling at temperature > 0 follows the target's distribution exactly (chi-square against the
exact joint of a tiny-vocabulary model, with negative controls), seeded requests do not depend on the batch,
and synthetic mode reaches its configured mean acceptance rate. Helpers: tests/spec_support.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import random_prompts
from spec_support import (
    P_VALUE_THRESHOLD,
    PROMPTS,
    chi_square_p_value,
    record_steps,
)
from transformers import AutoModelForCausalLM, LlamaConfig

from engine import LLM, SamplingParams
from engine.sample.metadata import SamplingMetadata
from engine.sample.processing import logits_to_probs
from engine.speculation.rejection_sampler import synthetic_position_rate

# Tiny models gain nothing from intra-op threads, and one thread keeps the runtime steady on a busy machine.
pytestmark = pytest.mark.usefixtures("one_thread")

# --------------------------------------------------------------------------------------------------------
# 4. The output distribution at temperature > 0
# --------------------------------------------------------------------------------------------------------

SMALL_VOCAB = 8
DIST_PROMPT = [5]
DIST_SAMPLES = 10000


def _small_vocab_model(path: Path, seed: int, hidden: int, layers: int, head_scale: float) -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        # RMSNorm undoes scaling inside the network; scaling the output head makes the next-token distributions
        # non-uniform (largest probability ~0.25-0.3, smallest ~0.03), far from one-hot.
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory) -> tuple[str, torch.nn.Module, str, torch.nn.Module]:
    root = tmp_path_factory.mktemp("vocab8")
    target = _small_vocab_model(root / "target", seed=0, hidden=16, layers=1, head_scale=8.0)
    draft = _small_vocab_model(root / "draft", seed=1, hidden=32, layers=1, head_scale=8.0)
    return str(root / "target"), target, str(root / "draft"), draft


@torch.no_grad()
def exact_joint(model: torch.nn.Module, prompt: list[int], temperature: float, top_k: int,
                top_p: float) -> torch.Tensor:
    """[V, V, V] exact probability of the first three generated tokens, p(x1) p(x2 | x1) p(x3 | x1, x2), after the
    engine's own temperature / top-k / top-p processing (itself checked against HF's warpers in test_sampling)."""
    v = SMALL_VOCAB
    seqs = torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])  # row a * v + b
    logits = model(seqs).logits[:, len(prompt) - 1:]  # [v * v, 3, v]
    md = SamplingMetadata.from_lists([temperature] * v * v, [top_p] * v * v, [top_k] * v * v)
    probs = logits_to_probs(logits, md).double()
    p1 = probs[0, 0]  # [v]
    p2 = probs[::v, 1]  # [x1, v]: rows with b == 0 see prompt + x1
    p3 = probs[:, 2].view(v, v, v)  # [x1, x2, v]
    return p1[:, None, None] * p2[:, :, None] * p3



def assert_first_three_follow_target(outs: list, target_hf: torch.nn.Module,
                                     draft_hf: torch.nn.Module | None) -> None:
    """The first three tokens of `outs` (DIST_PROMPT, temperature 1, no truncation) follow the target's exact joint
    law; given the draft, the same counts reject the draft's (the test tells the two laws apart)."""
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB, SMALL_VOCAB, dtype=torch.float64)
    for o in outs:
        counts[tuple(o.token_ids[:3])] += 1
    assert chi_square_p_value(counts, exact_joint(target_hf, DIST_PROMPT, 1.0, 0, 1.0)) > P_VALUE_THRESHOLD
    if draft_hf is not None:
        q = exact_joint(draft_hf, DIST_PROMPT, 1.0, 0, 1.0)
        support = q > 0  # cells it cannot produce are dropped: the helper demands they be empty
        assert chi_square_p_value(counts[support], q[support] / q[support].sum()) < 1e-6

# A one-token prompt is decoded from the first step, so with max_tokens=3 and k=2 the first verify step drafts two
# tokens: x1 and x2 each come from an accepted draft or a recovered token, x3 from the bonus token, or after a
# rejection from a later step (k=1, or a plain decode). The joint of (x1, x2, x3) covers all of those paths.
@pytest.mark.parametrize("mode,temperature,top_k,top_p", [
    ("probabilistic", 1.0, 0, 1.0),
    ("probabilistic", 0.8, 5, 0.85),
    ("strict", 1.0, 0, 1.0),
])
def test_speculative_sampling_follows_target_distribution(small_vocab_pair, mode, temperature, top_k, top_p):
    target_path, target_hf, draft_path, draft_hf = small_vocab_pair
    llm = LLM(target_path, draft_model=draft_path, num_speculative_tokens=2, rejection_sampling=mode, seed=1234,
              block_size=4, max_model_len=16, max_num_seqs=DIST_SAMPLES,
              max_num_batched_tokens=3 * DIST_SAMPLES, adaptive_draft_length=False)
    params = SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p, ignore_eos=True)
    outs = llm.generate([DIST_PROMPT] * DIST_SAMPLES, params)
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB, SMALL_VOCAB, dtype=torch.float64)
    for o in outs:
        assert len(o.token_ids) == 3
        counts[tuple(o.token_ids)] += 1

    target = exact_joint(target_hf, DIST_PROMPT, temperature, top_k, top_p)
    draft = exact_joint(draft_hf, DIST_PROMPT, temperature, top_k, top_p)
    # Both accepted drafts and rejections must shape the output (strict accepts only when the draft's sample
    # equals the target's own, sum_x p(x) q(x) ~ 0.15 here; probabilistic accepts sum_x min(p, q) ~ 0.6).
    total = llm.spec_stats(outs)
    assert 0.05 < total.acceptance_rate < 0.9, total
    assert total.accepted_per_position[-1] > 0  # some steps accepted both drafts and output a bonus token
    p_value = chi_square_p_value(counts, target)
    assert p_value > P_VALUE_THRESHOLD, f"{mode}: output does not follow the target (p = {p_value:.2e})"
    # Negative controls, so the test has power: the same counts reject the draft's distribution, and also a subtle
    # bias, a joint 10% of the way to the draft's (as a sampler that sometimes kept a rejected draft would give).
    for wrong, limit in ((draft, 1e-6), (0.9 * target + 0.1 * draft, 1e-4)):
        support = wrong > 0  # cells it cannot produce are dropped: the helper demands they be empty
        p_wrong = chi_square_p_value(counts[support], wrong[support] / wrong[support].sum())
        assert p_wrong < limit, f"the test cannot tell a wrong distribution from the target (p = {p_wrong:.2e})"


@pytest.mark.parametrize("mode", ["strict", "probabilistic"])
def test_seeded_speculative_sampling_is_batch_independent(tiny_models, tiny_drafts, mode):
    # SamplingParams' contract: a seed makes a request's samples independent of what else runs in the batch.
    # Short requests shrink their k near max_tokens while a long one keeps k = 4, so batched steps mix k's; the
    # random draft is mostly rejected, so nearly every step samples a recovered token.
    llm = LLM(tiny_models["llama"].path, draft_model=tiny_drafts["llama-1l"].path, num_speculative_tokens=4,
              rejection_sampling=mode, block_size=4, max_model_len=64)
    prompts = random_prompts([5] * 8, seed=9)
    seeded = [SamplingParams(max_tokens=8, temperature=0.9, seed=s, ignore_eos=True) for s in range(8)]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, seeded, strict=True)]
    batched = llm.generate(prompts + [PROMPTS[2]], seeded + [SamplingParams(max_tokens=40, ignore_eos=True)])
    assert [o.token_ids for o in batched[:8]] == alone


# --------------------------------------------------------------------------------------------------------
# 5. Synthetic acceptance
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("rate", [0.6, 0.8])
def test_synthetic_acceptance_rate(tiny_models, tiny_drafts, rate, k):
    # Every step at k (the draft length rule off): the rate is checked per k over many steps.
    llm = LLM(tiny_models["llama"].path, draft_model=tiny_drafts["qwen3-1l"].path, num_speculative_tokens=k,
              rejection_sampling="synthetic", synthetic_acceptance_rate=rate, block_size=4, max_model_len=128,
              adaptive_draft_length=False)
    steps = record_steps(llm)
    outs = llm.generate(random_prompts([4] * 64, seed=3), SamplingParams(max_tokens=100, ignore_eos=True))
    assert all(len(o.token_ids) == 100 for o in outs)
    # The configured rate is the mean acceptance rate (accepted / drafted) users see, for every k. Each step
    # accepts A in 0..k drafts with P(A = j) = a^j (1 - a) for j < k and a^k for j = k, a = a_k per position.
    drafted = [s for s in steps if s.num_draft_tokens]
    assert len(drafted) >= 1000
    total = llm.spec_stats(outs)
    for kk in {s.num_draft_tokens for s in drafted}:
        of_k = [s for s in drafted if s.num_draft_tokens == kk]
        if len(of_k) < 200:
            continue  # the few steps where k shrank near max_tokens
        a = synthetic_position_rate(rate, kk)
        dist = [a ** j * (1 - a) for j in range(kk)] + [a ** kk]
        var = sum(p * j * j for j, p in enumerate(dist)) - sum(p * j for j, p in enumerate(dist)) ** 2
        mean = sum(s.num_accepted for s in of_k) / len(of_k) / kk
        assert abs(mean - rate) < 5 * math.sqrt(var / len(of_k)) / kk, (kk, mean, len(of_k))
    assert abs(total.acceptance_rate - rate) < 0.05, total
