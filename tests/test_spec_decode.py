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

import pytest
import torch
from conftest import _base, random_prompts
from spec_support import (
    ENGINE_KW,
    GREEDY,
    NEW_TOKENS,
    PROMPTS,
    assert_kv_released,
    record_steps,
    steps_by_request,
)
from transformers import AutoModelForCausalLM, LlamaConfig

from engine import LLM, SamplingParams

# Tiny models gain nothing from intra-op threads, and one thread keeps the runtime steady on a busy machine.
pytestmark = pytest.mark.usefixtures("one_thread")

# k held at num_speculative_tokens (the draft length rule off) where a test checks what speculation did: the rule
# chooses k from measured step times, so on a busy machine it may stop a tiny draft part-way through a test.
FIXED_K = dict(ENGINE_KW, adaptive_draft_length=False)

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
              num_speculative_tokens=k, rejection_sampling=mode, **FIXED_K)
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
    llm = LLM(path, draft_model=path, num_speculative_tokens=4, rejection_sampling=mode, **FIXED_K)
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
    # Default batching budget: every decode then gets its full k, as in the batch-1 reference (a fixed k: the draft
    # length rule off).
    llm = LLM(tm.path, draft_model=dm.path, num_speculative_tokens=k, rejection_sampling="probabilistic",
              block_size=4, max_model_len=64, adaptive_draft_length=False)
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


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_ids_on_the_device_or_from_the_host_verify_alike(tiny_models, near_drafts, monkeypatch, temperature):
    """An in-process draft's ids stay on the device and are written into the verify input there; a remote draft's
    arrive as host tensors and go in as lists. Same seed, same steps: the tokens must match one for one."""
    from engine.speculation.verifier import Verifier

    def run() -> tuple[list[list[int]], int]:
        # Same steps: a fixed k (the draft length rule's choices follow measured time, which differs run to run).
        llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
                  rejection_sampling="probabilistic", seed=5, adaptive_draft_length=False, **ENGINE_KW)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=temperature,
                                                    ignore_eos=True))
        return [o.token_ids for o in outs], llm.spec_stats(outs).num_accepted_tokens

    on_device, accepted = run()
    assert accepted > 0  # drafts were read, not only bonus tokens
    monkeypatch.setattr(Verifier, "ids_on_device", lambda self, proposal: False)
    assert run() == (on_device, accepted)


# --------------------------------------------------------------------------------------------------------
# 7. k shrinks near max_tokens and max_model_len
# --------------------------------------------------------------------------------------------------------


def test_k_shrinks_near_max_tokens(tiny_models):
    # A draft identical to the target accepts everything, so an unshrunk k would overshoot max_tokens.
    path = tiny_models["llama"].path
    llm = LLM(path, draft_model=path, num_speculative_tokens=5, **FIXED_K)
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
    llm = LLM(path, draft_model=path, num_speculative_tokens=5, adaptive_draft_length=False, **kw)
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
    llm = LLM(path, draft_model=path, num_speculative_tokens=k, **FIXED_K)
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
               block_size=16, max_model_len=256, adaptive_draft_length=False)
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
