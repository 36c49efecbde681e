"""Penalties, logit_bias, allowed_token_ids, bad words, min_tokens and min_p: each equals a plain reference, and the
engine's greedy output with them equals a plain greedy decode of HF transformers' logits processed by that
reference, with and without a draft (so each verify position is processed with the drafts before it). The sampled
distribution under speculation is checked in tests/test_spec_distribution.py's style below."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_prompts
from spec_support import ENGINE_KW

from engine import LLM, SamplingParams
from engine.sample.penalties import apply_penalties, apply_penalties_reference
from engine.sample.token_masks import (
    apply_allowed_token_ids,
    apply_logit_bias,
    apply_min_p,
    bad_word_bans,
    min_tokens_bans,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# --- each processor against its definition ----------------------------------------------------------------------
def test_penalties_equal_reference() -> None:
    g = torch.Generator().manual_seed(0)
    vocab, positions = 13, 3
    logits = torch.randn(2, positions, vocab, generator=g) * 3
    outputs = [[[1, 4, 4], [1, 4, 4, 7], [1, 4, 4, 7, 1]], [[], [2], [2, 2]]]
    prompts = [[5, 6], [0]]
    settings = [(0.5, 0.3, 1.4), (-0.2, 1.1, 0.8)]
    counts = torch.zeros(2, positions, vocab)
    for i, hist in enumerate(outputs):
        for j, h in enumerate(hist):
            for t in h:
                counts[i, j, t] += 1
    mask = torch.zeros(2, vocab, dtype=torch.bool)
    for i, p in enumerate(prompts):
        mask[i, p] = True
    got = apply_penalties(logits, counts, mask, *(torch.tensor([s[n] for s in settings]) for n in range(3)))
    for i in range(2):
        for j in range(positions):
            ref = apply_penalties_reference(logits[i, j].tolist(), outputs[i][j], prompts[i], *settings[i])
            assert got[i, j].tolist() == pytest.approx(ref, abs=1e-5)


def test_token_masks_equal_definitions() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    assert apply_logit_bias(logits, {1: 5.0, 3: -1.0}).tolist() == [[0, 6, 2, 2], [3, 7, 1, -1]]
    assert apply_allowed_token_ids(logits, [0, 2]).tolist() == [[0, -math.inf, 2, -math.inf],
                                                                 [3, -math.inf, 1, -math.inf]]
    # A one-token word is always banned; a longer one once the history ends with its prefix.
    assert bad_word_bans([[3], [1, 2], [0, 1, 2]], [[], [5, 1], [0, 1], [1, 0, 1]]) == [[3], [3, 2], [3, 2, 2],
                                                                                       [3, 2, 2]]
    assert min_tokens_bans(3, [2, 9], num_output_tokens=1, num_positions=4) == [[2, 9], [2, 9], [], []]
    # min_p against its definition: softmax after temperature, tokens under min_p * max masked.
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(5, 20, generator=g) * 2
    for t, m in [(1.0, 0.1), (0.5, 0.3), (2.0, 0.05)]:
        probs = torch.softmax(raw / t, dim=-1)
        keep = probs >= m * probs.max(dim=-1, keepdim=True).values
        assert torch.equal(apply_min_p(raw, m, t) > -math.inf, keep)
    assert torch.equal(apply_min_p(raw, 0.5, 0.0), raw)  # greedy: the argmax is all that matters


# --- the engine against a plain greedy decode of HF's logits -------------------------------------------------
def _reference_greedy(model: torch.nn.Module, prompt: list[int], sp: SamplingParams, eos: int = 2) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        while len(out) < sp.max_tokens:
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float().tolist()
            if sp.allowed_token_ids is not None:
                logits = [v if t in sp.allowed_token_ids else -math.inf for t, v in enumerate(logits)]
            for t in (b for ban in bad_word_bans(sp.bad_words_token_ids or [], [out]) for b in ban):
                logits[t] = -math.inf
            if len(out) < sp.min_tokens:
                for t in list(sp.stop_token_ids) + ([] if sp.ignore_eos else [eos]):
                    logits[t] = -math.inf
            for t, b in (sp.logit_bias or {}).items():
                logits[t] += b
            logits = apply_penalties_reference(logits, out, prompt, sp.presence_penalty, sp.frequency_penalty,
                                               sp.repetition_penalty)
            tok = max(range(len(logits)), key=lambda v: logits[v])
            out.append(tok)
            if tok in sp.stop_token_ids or (tok == eos and not sp.ignore_eos):
                break
    return out


CASES = {
    "penalties": dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.5, ignore_eos=True),
    "negative-presence": dict(presence_penalty=-1.5, repetition_penalty=0.7, ignore_eos=True),
    "logit-bias": dict(logit_bias={7: 4.0, 9: 3.0, 11: -100.0}, ignore_eos=True),
    "allowed-and-bad-words": dict(allowed_token_ids=list(range(3, 40)), bad_words_token_ids=[[5], [10, 12]],
                                  frequency_penalty=0.5, ignore_eos=True),
    "min-tokens": dict(min_tokens=4, logit_bias={2: 50.0}),  # EOS is forced, but not before 4 tokens
}


@pytest.mark.parametrize("draft", [None, "probabilistic", "strict"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_with_processors_equals_reference(tiny_models, near_drafts, case, draft) -> None:
    tm = tiny_models["llama"]
    kw = dict(draft_model=near_drafts["llama"].path, num_speculative_tokens=3, rejection_sampling=draft,
              adaptive_draft_length=False) if draft else {}  # a fixed k: acceptance is counted
    llm = LLM(tm.path, **kw, **ENGINE_KW)
    prompts = random_prompts([6, 3], seed=21)
    sp = SamplingParams(max_tokens=12, temperature=0.0, **CASES[case])
    # A request without processing in the same batch keeps its own plain output.
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts + [prompts[0]], [sp, sp, plain])
    for out, prompt in zip(outs[:2], prompts):
        assert out.token_ids == _reference_greedy(tm.hf, prompt, sp)
    assert outs[2].token_ids == llm.generate([prompts[0]], plain)[0].token_ids
    if case == "min-tokens":
        assert [len(o.token_ids) for o in outs[:2]] == [5, 5] and outs[0].finish_reason == "stop"
    if draft:
        assert llm.spec_stats(outs).num_accepted_tokens > 0


def test_out_of_vocabulary_ids_are_refused(tiny_models) -> None:
    llm = LLM(tiny_models["llama"].path, **ENGINE_KW)
    for kw in (dict(logit_bias={10**6: 1.0}), dict(allowed_token_ids=[10**6]), dict(bad_words_token_ids=[[10**6]])):
        with pytest.raises(ValueError, match="vocabulary"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2, **kw))
    for kw, name in ((dict(presence_penalty=3.0), "presence_penalty"), (dict(repetition_penalty=0.0),
                                                                          "repetition_penalty"),
                     (dict(min_p=1.5), "min_p"), (dict(min_tokens=9, max_tokens=4), "min_tokens"),
                     (dict(logit_bias={5: 200.0}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw)
    assert not llm.engine.has_unfinished()


# --- the sampled distribution under speculation ------------------------------------------------------------------
SAMPLES = 10000
PROCESSED = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={3: 1.0, 6: -1.5})


@torch.no_grad()
def _exact_processed_joint(model: torch.nn.Module, prompt: list[int], sp: SamplingParams) -> torch.Tensor:
    """[V, V, V] exact probability of the first three tokens when each position's logits are processed with its own
    history by the plain references, then go through the engine's temperature / top-k / top-p / min_p."""
    from test_spec_distribution import SMALL_VOCAB as v

    from engine.sample.metadata import SamplingMetadata
    from engine.sample.processing import logits_to_probs

    seqs = torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])
    raw = model(seqs).logits[:, len(prompt) - 1:].float()  # [v * v, 3, v]
    processed = torch.empty_like(raw)
    for row in range(v * v):
        a, b = divmod(row, v)
        for j, history in enumerate(([], [a], [a, b])):
            logits = raw[row, j].tolist()
            for t, bias in (sp.logit_bias or {}).items():
                logits[t] += bias
            logits = apply_penalties_reference(logits, history, prompt, sp.presence_penalty, sp.frequency_penalty,
                                               sp.repetition_penalty)
            processed[row, j] = apply_min_p(torch.tensor([logits]), sp.min_p, sp.temperature)[0]
    md = SamplingMetadata.from_lists([sp.temperature] * v * v, [sp.top_p] * v * v, [sp.top_k] * v * v)
    probs = logits_to_probs(processed, md).double()
    p1, p2, p3 = probs[0, 0], probs[::v, 1], probs[:, 2].view(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.parametrize("mode,extra", [("probabilistic", dict(temperature=1.0)),
                                        ("probabilistic", dict(temperature=0.8, top_k=6, min_p=0.05)),
                                        ("strict", dict(temperature=1.0))], ids=["prob", "prob-topk-minp", "strict"])
def test_speculative_sampling_with_processing_is_exact(tmp_path, mode, extra) -> None:
    from spec_support import P_VALUE_THRESHOLD, chi_square_p_value
    from test_spec_distribution import SMALL_VOCAB as v
    from test_spec_distribution import _small_vocab_model

    target = _small_vocab_model(tmp_path / "target", seed=0, hidden=16, layers=1, head_scale=8.0)
    _small_vocab_model(tmp_path / "draft", seed=1, hidden=32, layers=1, head_scale=8.0)
    llm = LLM(str(tmp_path / "target"), draft_model=str(tmp_path / "draft"), num_speculative_tokens=2,
              rejection_sampling=mode, seed=99, block_size=4, max_model_len=16, max_num_seqs=SAMPLES,
              max_num_batched_tokens=3 * SAMPLES, adaptive_draft_length=False)
    prompt = [5]
    sp = SamplingParams(max_tokens=3, ignore_eos=True, **PROCESSED, **extra)
    outs = llm.generate([prompt] * SAMPLES, sp)
    counts = torch.zeros(v, v, v, dtype=torch.float64)
    for o in outs:
        counts[tuple(o.token_ids)] += 1
    total = llm.spec_stats(outs)
    assert 0.05 < total.acceptance_rate < 0.95 and total.accepted_per_position[-1] > 0, total
    expected = _exact_processed_joint(target, prompt, sp)
    p_value = chi_square_p_value(counts, expected)
    assert p_value > P_VALUE_THRESHOLD, f"output does not follow the processed target (p = {p_value:.2e})"
    # Negative control: the unprocessed target's joint is rejected by the same counts.
    plain = _exact_processed_joint(target, prompt, SamplingParams(max_tokens=3, **extra))
    support = plain > 0
    assert chi_square_p_value(counts[support], plain[support] / plain[support].sum()) < 1e-6


def test_draft_proposes_from_the_processed_distribution(tiny_models, near_drafts) -> None:
    """The draft applies the target's masks to its own proposals (only acceptance depends on it): with a narrow
    allowed_token_ids no draft token falls outside it, so none is rejected for being masked."""
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
              rejection_sampling="probabilistic", **ENGINE_KW)
    proposer = llm.executor.proposer
    proposed: list[int] = []
    propose = proposer.propose

    def recording(plan):
        proposal = propose(plan)
        for row, r in zip(proposal.draft_token_ids.tolist(), plan.requests):
            proposed.extend(row[:r.num_draft_tokens])
        return proposal

    proposer.propose = recording
    allowed = list(range(20, 30))
    outs = llm.generate(random_prompts([5, 7], seed=4), SamplingParams(max_tokens=12, temperature=0.8, seed=2,
                                                                       allowed_token_ids=allowed, ignore_eos=True))
    assert proposed and set(proposed) <= set(allowed)
    assert all(set(o.token_ids) <= set(allowed) for o in outs)
