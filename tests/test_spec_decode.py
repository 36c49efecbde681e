"""Speculative decoding end to end: the engine with a draft model against target-only decoding, HF transformers,
a from-scratch reference implementation, and exact output distributions.

Lossless at temperature 0 means token-for-token equality with the target alone (itself checked against HF greedy).
Lossless at temperature > 0 is tested statistically: one large batch with a fixed engine seed (so each test is
deterministic), a Pearson chi-square goodness of fit of the joint distribution of the first generated tokens
against the exact joint computed with HF, asserting p-value > 1e-3 (a correct engine fails a given seed with
probability 1e-3); negative controls show the same counts reject the draft's distribution and a subtly biased one.
Synthetic-mode rates allow 5 binomial standard deviations.

Drafts: the conftest drafts of other architectures (a 2-layer Gemma 3 hybrid with two KV-cache groups, 1-layer
Llama and Qwen3) agree with random targets rarely, so per family a "near copy" draft (target weights plus noise, one
extra layer) adds steps with runs of accepted tokens. Small block_size (4) makes verify and draft steps cross block
boundaries; the tiny models' sliding windows (5-7 tokens) are shorter than every sequence, so sliding-window
metadata and block release are exercised in both models. Per-step k and acceptance are read at the executor
boundary (see record_steps).
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import TinyModel, _base, hf_greedy, random_prompts
from scipy import stats
from transformers import AutoModelForCausalLM, LlamaConfig

from engine import LLM, SamplingParams
from engine.sample.metadata import SamplingMetadata
from engine.sample.processing import logits_to_probs
from engine.spec.rejection_sampler import synthetic_position_rate

P_VALUE_THRESHOLD = 1e-3
PROMPTS = random_prompts([3, 9, 17], seed=11)
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# max_num_batched_tokens=20 makes the first step a mix of whole prompts and a chunk of the 17-token prompt, and
# later steps mix speculative decodes with that prompt's last chunk; max_model_len keeps the KV pools small.
ENGINE_KW = dict(block_size=4, max_model_len=64, max_num_batched_tokens=20)


# --------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------


@dataclass
class Step:
    """One request's share of one step that sampled for it (a verify step, or a plain decode / last prefill chunk)."""

    request_id: str
    num_output_before: int  # output tokens before this step
    num_tokens_before: int  # prompt + output tokens before this step
    num_draft_tokens: int  # k this step (0: plain decode / last prefill chunk)
    num_accepted: int


def record_steps(llm: LLM) -> list[Step]:
    """Record every sampled request of every step `llm` runs from now on.

    SpecStats only holds totals; the per-step k and accepted counts are what the scheduler's k-shrinking and the
    reference comparison are about. They cross the executor boundary (StepPlan in, StepResult out: the same
    interface the Ray workers serve), so this instance's executor is wrapped.
    """
    steps: list[Step] = []
    executor = llm.engine.executor
    execute = executor.execute

    def recording_execute(plan):
        result = execute(plan)
        for p, tokens, accepted in zip(plan.requests, result.sampled, result.num_accepted, strict=True):
            if tokens is not None:  # None: a prefill chunk short of the prompt's end
                steps.append(Step(p.request_id, p.num_output_tokens, p.start_pos + len(p.token_ids),
                                  p.num_draft_tokens, accepted))
        return result

    executor.execute = recording_execute
    return steps


def steps_by_request(steps: list[Step]) -> dict[str, list[Step]]:
    out: dict[str, list[Step]] = defaultdict(list)
    for s in steps:
        out[s.request_id].append(s)
    return out


def kv_used_blocks(llm: LLM) -> dict[str, list[int]]:
    """Blocks in use per KV-cache group, for the target's and the draft's managers."""
    used = {"target": llm.engine.target_kv.num_used_blocks()}
    if llm.engine.draft_kv is not None:
        used["draft"] = llm.engine.draft_kv.num_used_blocks()
    return used


def assert_kv_released(llm: LLM) -> None:
    used = kv_used_blocks(llm)
    assert set(used) == {"target", "draft"}
    assert all(n == 0 for groups in used.values() for n in groups), f"blocks still held after generate: {used}"


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one cell (the
    chi-square approximation needs expected counts >= 5). Cells of probability 0 must be empty."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum() == 0, "the engine produced a sequence of probability 0"
    expected = probs * counts.sum()
    big = expected >= 5
    small = ~big & (probs > 0)
    obs = torch.cat([counts[big], counts[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    if exp[-1] < 5:  # a pooled cell that is still small joins the smallest big cell
        i = int(exp[:-1].argmin())
        obs[i] += obs[-1]
        exp[i] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


# --------------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine a second busy process makes
    2-thread kernels 10-30x slower (measured); one thread keeps this module's runtime steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_greedy(tiny_models):
    """Target-only greedy outputs per family, checked against HF greedy once: a speculative run is then compared
    with an oracle already known to be right, so a failure points at speculation."""
    cache: dict[str, list[list[int]]] = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            m = tiny_models[family]
            outs = LLM(m.path, **ENGINE_KW).generate(PROMPTS, GREEDY)
            ids = [o.token_ids for o in outs]
            assert ids == [hf_greedy(m.hf, p, NEW_TOKENS) for p in PROMPTS], f"{family}: target-only != HF"
            cache[family] = ids
        return cache[family]

    return get


@pytest.fixture(scope="module")
def near_drafts(tiny_models, tmp_path_factory) -> dict[str, TinyModel]:
    """Per target family, a draft of another shape that agrees with the target about half the time: the target's
    weights plus 5% noise, and one extra layer (a sliding-window one for Gemma 3). Random drafts of other
    architectures are almost always rejected, which leaves the paths of accepted runs untested."""
    root = tmp_path_factory.mktemp("near")
    drafts = {}
    for family, target in tiny_models.items():
        cfg = copy.deepcopy(target.config)
        cfg.num_hidden_layers += 1
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = list(cfg.layer_types) + ["sliding_attention"]
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(cfg).eval()  # the extra layer keeps its small random init
        weights = model.state_dict()
        with torch.no_grad():
            for name, w in target.hf.state_dict().items():
                weights[name] = w + 0.05 * w.std() * torch.randn_like(w) if w.dim() == 2 else w.clone()
        model.load_state_dict(weights)
        model.save_pretrained(root / family)
        drafts[family] = TinyModel(f"{family}-near", str(root / family), model, cfg)
    return drafts


# --------------------------------------------------------------------------------------------------------
# 1, 2. Lossless greedy
# --------------------------------------------------------------------------------------------------------

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
# Every target family with every k and both modes, for two drafts: the hybrid "gemma3-2l" (two KV-cache groups
# behind single-group targets and behind Gemma 3's own two groups) and a near copy (see near_drafts) that gives
# mixed runs of accepted and rejected tokens; random drafts of other architectures are mostly rejected. The
# single-group random drafts run once per family. Each case takes a fraction of a second.
LOSSLESS_CASES = (
    [(t, d, k, m) for t in FAMILIES for d in ("gemma3-2l", "near") for k in (1, 3, 5)
     for m in ("strict", "probabilistic")]
    + [(t, d, 3, m) for t in FAMILIES for d, m in (("llama-1l", "strict"), ("qwen3-1l", "probabilistic"))]
)


def _draft_path(tiny_drafts, near_drafts, target: str, draft: str) -> str:
    return near_drafts[target].path if draft == "near" else tiny_drafts[draft].path


@pytest.mark.parametrize("target,draft,k,mode", LOSSLESS_CASES)
def test_greedy_speculation_is_lossless(tiny_models, tiny_drafts, near_drafts, target_greedy, target, draft, k,
                                        mode):
    llm = LLM(tiny_models[target].path, draft_model=_draft_path(tiny_drafts, near_drafts, target, draft),
              num_speculative_tokens=k, rejection_sampling=mode, **ENGINE_KW)
    outs = llm.generate(PROMPTS, GREEDY)
    # target_greedy already equals HF greedy, so this is equality with both.
    assert [o.token_ids for o in outs] == target_greedy(target)
    assert all(o.finish_reason == "length" for o in outs)
    total = llm.spec_stats(outs)
    assert total.num_drafts > 0  # speculation really ran
    if draft == "near":
        # Runs of accepted drafts (draft KV kept, draft catch-up on the bonus token) and rejections both happen.
        assert 0.1 < total.acceptance_rate < 0.9, total
    assert_kv_released(llm)


@pytest.mark.parametrize("target,mode", [("llama", "strict"), ("gemma3", "probabilistic")])
def test_draft_identical_to_target_accepts_everything(tiny_models, target_greedy, target, mode):
    path = tiny_models[target].path
    llm = LLM(path, draft_model=path, num_speculative_tokens=4, rejection_sampling=mode, **ENGINE_KW)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy(target)
    total = llm.spec_stats(outs)
    # Not exactly 1: the draft scores one token per forward and the target k + 1, so a near-tie could flip.
    assert total.acceptance_rate >= 0.98, total
    # Everything accepted: each verify step yields k + 1 = 5 tokens, except where k shrinks near max_tokens.
    assert total.acceptance_length > 4.0


# --------------------------------------------------------------------------------------------------------
# 3. A reference implementation as the oracle for tokens and per-step acceptance
# --------------------------------------------------------------------------------------------------------


@torch.no_grad()
def speculative_decode(target: torch.nn.Module, draft: torch.nn.Module, prompt: list[int], k: int,
                       max_new_tokens: int) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding of one sequence (Leviathan et al. 2023, Algorithm 1, at temperature 0), every
    forward recomputed from scratch. Returns (new tokens, accepted draft tokens per speculation step).

    Scheduled like the engine: the first token comes from the prompt's own forward (the prefill step), and k
    shrinks so a step never overshoots max_new_tokens.
    """
    seq = list(prompt)
    seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    end = len(prompt) + max_new_tokens
    accepted_per_step = []
    while len(seq) < end:
        n_draft = min(k, end - len(seq) - 1)
        # 1. The draft guesses n_draft tokens, one forward each.
        guesses: list[int] = []
        for _ in range(n_draft):
            guesses.append(int(draft(torch.tensor([seq + guesses])).logits[0, -1].argmax()))
        # 2. One target forward over prefix + guesses: row i is the target's token after seq + guesses[:i].
        choices = target(torch.tensor([seq + guesses])).logits[0, len(seq) - 1:].argmax(-1).tolist()
        # 3. Keep the guesses while the target agrees...
        n = 0
        while n < n_draft and guesses[n] == choices[n]:
            n += 1
        # 4. ...and add the target's own token: the correction at the first disagreement, or the bonus token.
        seq += guesses[:n] + [choices[n]]
        if n_draft:
            accepted_per_step.append(n)
    return seq[len(prompt):], accepted_per_step


# A single-group pair and a hybrid pair (two KV-cache groups in both models), each with mixed acceptance.
@pytest.mark.parametrize("target,draft,k", [("llama", "near", 3), ("gemma3", "gemma3-2l", 4)])
def test_engine_matches_reference_speculative_decoding(tiny_models, tiny_drafts, near_drafts, target, draft, k):
    tm = tiny_models[target]
    dm = near_drafts[target] if draft == "near" else tiny_drafts[draft]
    prompts = PROMPTS[1:]
    # Default batching budget: every decode then gets its full k, as in the batch-1 reference.
    llm = LLM(tm.path, draft_model=dm.path, num_speculative_tokens=k, rejection_sampling="probabilistic",
              block_size=4, max_model_len=64)
    steps = record_steps(llm)
    outs = llm.generate(prompts, GREEDY)
    per_req = steps_by_request(steps)
    for prompt, out in zip(prompts, outs, strict=True):
        ref_tokens, ref_accepted = speculative_decode(tm.hf, dm.hf, prompt, k, NEW_TOKENS)
        assert out.token_ids == ref_tokens
        assert [s.num_accepted for s in per_req[out.request_id] if s.num_draft_tokens] == ref_accepted
        assert out.spec.num_drafts == len(ref_accepted)
        assert out.spec.num_accepted_tokens == sum(ref_accepted)
        # A useful oracle comparison needs both accepted and rejected guesses.
        assert 0 < sum(ref_accepted) < out.spec.num_draft_tokens


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
              max_num_batched_tokens=3 * DIST_SAMPLES)
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
    llm = LLM(tiny_models["llama"].path, draft_model=tiny_drafts["qwen3-1l"].path, num_speculative_tokens=k,
              rejection_sampling="synthetic", synthetic_acceptance_rate=rate, block_size=4, max_model_len=128)
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


# --------------------------------------------------------------------------------------------------------
# 6. Statistics
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_spec_stats_are_consistent_with_steps(tiny_models, near_drafts, temperature):
    k = 3
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=k,
              **ENGINE_KW)
    steps = record_steps(llm)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=temperature, ignore_eos=True))
    per_req = steps_by_request(steps)
    for o in outs:
        drafted = [s for s in per_req[o.request_id] if s.num_draft_tokens]
        spec = o.spec
        assert spec.num_drafts == len(drafted)
        assert spec.num_draft_tokens == sum(s.num_draft_tokens for s in drafted)
        assert spec.num_accepted_tokens == sum(s.num_accepted for s in drafted)
        assert 0 <= spec.num_accepted_tokens <= spec.num_draft_tokens
        assert all(s.num_accepted <= s.num_draft_tokens <= k for s in drafted)
        assert len(spec.accepted_per_position) == k
        assert spec.accepted_per_position == [sum(s.num_accepted > i for s in drafted) for i in range(k)]
        assert all(a >= b for a, b in zip(spec.accepted_per_position[:-1], spec.accepted_per_position[1:], strict=True))
        assert sum(spec.accepted_per_position) == spec.num_accepted_tokens
        assert spec.acceptance_length == pytest.approx(1 + spec.num_accepted_tokens / spec.num_drafts)
        assert spec.acceptance_rate == pytest.approx(spec.num_accepted_tokens / spec.num_draft_tokens)
        # Every token after the first (prefill) comes from a verify step: accepted drafts plus one each.
        plain = [s for s in per_req[o.request_id] if not s.num_draft_tokens]
        assert len(o.token_ids) == spec.num_accepted_tokens + spec.num_drafts + len(plain)
    total = llm.spec_stats(outs)
    assert total.num_draft_tokens == sum(o.spec.num_draft_tokens for o in outs)
    assert total.num_accepted_tokens == sum(o.spec.num_accepted_tokens for o in outs)
    assert total.accepted_per_position == [sum(o.spec.accepted_per_position[i] for o in outs) for i in range(k)]


# --------------------------------------------------------------------------------------------------------
# 7. k shrinks near max_tokens and max_model_len
# --------------------------------------------------------------------------------------------------------


def test_k_shrinks_near_max_tokens(tiny_models):
    # A draft identical to the target accepts everything, so an unshrunk k would overshoot max_tokens.
    path = tiny_models["llama"].path
    llm = LLM(path, draft_model=path, num_speculative_tokens=5, **ENGINE_KW)
    steps = record_steps(llm)
    max_tokens = 3
    prompts = PROMPTS + [[7]]  # a one-token prompt speculates from its first step
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    ref = LLM(path, **ENGINE_KW).generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in outs)
    assert all(s.num_draft_tokens <= max_tokens - s.num_output_before - 1 for s in steps)
    assert all(o.spec.num_draft_tokens <= max_tokens - 1 for o in outs)
    assert any(s.num_draft_tokens for s in steps)
    assert outs[-1].spec.num_draft_tokens == max_tokens - 1  # the one-token prompt drafted right up to the limit


def test_k_shrinks_near_max_model_len(tiny_models):
    path = tiny_models["llama"].path
    prompts = random_prompts([9, 7], seed=5)
    max_model_len = 9 + 4
    kw = dict(block_size=4, max_model_len=max_model_len)
    llm = LLM(path, draft_model=path, num_speculative_tokens=5, **kw)
    steps = record_steps(llm)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    outs = llm.generate(prompts, params)
    ref = LLM(path, **kw).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [len(o.token_ids) for o in outs] == [max_model_len - len(p) for p in prompts]
    assert all(o.finish_reason == "length" for o in outs)
    assert all(s.num_draft_tokens <= max_model_len - s.num_tokens_before - 1 for s in steps)
    assert any(s.num_draft_tokens for s in steps)


# --------------------------------------------------------------------------------------------------------
# 8. Stops inside a run of accepted tokens
# --------------------------------------------------------------------------------------------------------


def test_stop_token_inside_accepted_run(tiny_models, target_greedy):
    path = tiny_models["llama"].path
    k = 4
    ref = target_greedy("llama")
    llm = LLM(path, draft_model=path, num_speculative_tokens=k, **ENGINE_KW)
    steps = record_steps(llm)
    # Per prompt, a stop token first produced at output position j >= 2 (after a verify step began).
    stops = []
    for r in ref:
        j = next(j for j in range(2, len(r)) if r[j] not in r[:j])
        stops.append(j)
    params = [SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=[r[j]], ignore_eos=True)
              for r, j in zip(ref, stops, strict=True)]
    outs = llm.generate(PROMPTS, params)
    per_req = steps_by_request(steps)
    for o, r, j in zip(outs, ref, stops, strict=True):
        assert o.token_ids == r[:j + 1]
        assert o.finish_reason == "stop" and o.stop_reason == r[j]
        # The step that produced the stop token had accepted it as a draft, with more tokens after it that were
        # dropped: the stop really ended the request mid-run.
        step = next(s for s in per_req[o.request_id]
                    if s.num_output_before <= j <= s.num_output_before + s.num_accepted)
        assert j - step.num_output_before < step.num_accepted
    assert_kv_released(llm)


# --------------------------------------------------------------------------------------------------------
# 9. Validation
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def odd_drafts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("odd_drafts")
    cfgs = {"vocab64": LlamaConfig(**_base(vocab_size=64, num_hidden_layers=1)),
            "short_context": LlamaConfig(**_base(num_hidden_layers=1, max_position_embeddings=32))}
    paths = {}
    for name, cfg in cfgs.items():
        AutoModelForCausalLM.from_config(cfg).save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


@pytest.mark.parametrize("kwargs,match", [
    (dict(draft="vocab64"), r"draft vocabulary \(64 tokens\) differs from the target's \(128\)"),
    (dict(draft="short_context", max_model_len=64), r"draft's context \(32 tokens\) is shorter than max_model_len=64"),
    (dict(num_speculative_tokens=0), r"num_speculative_tokens must be an integer in \[1, 16\], got 0"),
    (dict(num_speculative_tokens=17), r"num_speculative_tokens must be an integer in \[1, 16\], got 17"),
    (dict(rejection_sampling="synthetic", synthetic_acceptance_rate=-0.1), r"synthetic_acceptance_rate.*-0\.1"),
    (dict(rejection_sampling="synthetic", synthetic_acceptance_rate=1.5), r"synthetic_acceptance_rate.*1\.5"),
    (dict(rejection_sampling="synthetic"), r"synthetic_acceptance_rate.*None"),
    (dict(rejection_sampling="probabilistic", synthetic_acceptance_rate=0.5), r"only used with.*synthetic"),
    (dict(rejection_sampling="greedy"), r"rejection_sampling must be one of .*'greedy'"),
], ids=["draft_vocab", "draft_context", "k_0", "k_17", "rate_negative", "rate_above_1", "rate_missing",
        "rate_without_synthetic", "unknown_mode"])
def test_invalid_speculative_config_raises(tiny_models, odd_drafts, kwargs, match):
    kwargs = dict(kwargs)
    draft = odd_drafts[kwargs.pop("draft")] if "draft" in kwargs else tiny_models["llama"].path
    with pytest.raises(ValueError, match=match):
        LLM(tiny_models["llama"].path, draft_model=draft, **kwargs)


# --------------------------------------------------------------------------------------------------------
# 10. Preemption
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target,draft,k,mode", [("llama", "near", 3, "probabilistic"),
                                                 ("gemma3", "gemma3-2l", 5, "strict")])
def test_preemption_with_speculation(tiny_models, tiny_drafts, near_drafts, target_greedy, target, draft, k, mode):
    # 16 blocks of 4 tokens per model: 3 requests need 7 + 9 + 11 blocks at full length, so some get preempted
    # and recomputed (both models' caches rebuilt from their tokens); one alone (at most 12 blocks) still fits.
    llm = LLM(tiny_models[target].path, draft_model=_draft_path(tiny_drafts, near_drafts, target, draft),
              num_speculative_tokens=k, rejection_sampling=mode, block_size=4, max_model_len=48, num_kv_blocks=16)
    outs = llm.generate(PROMPTS, GREEDY)
    assert any(o.num_preemptions > 0 for o in outs)
    assert [o.token_ids for o in outs] == target_greedy(target)
    assert_kv_released(llm)


# --------------------------------------------------------------------------------------------------------
# 11. Real models
# --------------------------------------------------------------------------------------------------------

CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash table is."]


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_path) -> tuple[LLM, LLM]:
    """SmolLM2-135M alone, and speculating with itself as draft (k=4)."""
    plain = LLM(smollm2_path, block_size=16, max_model_len=256)
    spec = LLM(smollm2_path, draft_model=smollm2_path, num_speculative_tokens=4, rejection_sampling="probabilistic",
               block_size=16, max_model_len=256)
    return plain, spec


def _chat_prompt(llm: LLM, text: str) -> list[int]:
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.mark.slow
def test_smollm2_self_draft_is_lossless(smollm2_pair):
    plain, spec = smollm2_pair
    prompts = [_chat_prompt(plain, c) for c in CHATS]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ref = plain.generate(prompts, params)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.text for o in outs] == [o.text for o in ref]
    assert spec.spec_stats(outs).acceptance_rate >= 0.98


@pytest.mark.slow
def test_smollm2_stop_string_inside_accepted_run(smollm2_pair):
    plain, spec = smollm2_pair
    prompt = _chat_prompt(plain, CHATS[0])
    full = plain.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    # A stop string completed by output token 3: the first verify step (k = 4, all accepted) outputs tokens 1-5,
    # so the stop falls inside its accepted run and tokens 4 and 5 must be dropped.
    head = plain.tokenizer.decode(full.token_ids[:4], skip_special_tokens=True).rstrip()
    stop = head[-3:]
    assert full.text.find(stop) == len(head) - 3, "pick a stop string that does not occur earlier"
    params = SamplingParams(max_tokens=16, stop=[stop], ignore_eos=True)
    ref = plain.generate([prompt], params)[0]
    steps = record_steps(spec)
    out = spec.generate([prompt], params)[0]
    assert ref.finish_reason == "stop" and ref.token_ids == full.token_ids[:4]
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == \
        (ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason)
    assert stop not in out.text and full.text.startswith(out.text)
    last = steps[-1]
    assert last.num_output_before < len(out.token_ids) <= last.num_output_before + last.num_accepted
