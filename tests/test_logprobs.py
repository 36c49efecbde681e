"""Logprobs equal log_softmax of HF transformers' float32 logits at every emitted position, for the emitted token
and the top k, with and without a draft (greedy, and sampled with probabilistic rejection so that accepted runs,
recovered and bonus tokens all occur); they are the raw model's (vLLM's default `raw_logprobs`), independent of
temperature."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from spec_support import ENGINE_KW

from engine import LLM, SamplingParams
from engine.sample.logprobs import emitted_logprobs

TOP = 5


def _hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] float32 log_softmax of HF's logits at the positions that produced each output token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(output)], dim=-1)


def _check(outputs, prompts, model) -> None:
    for out, prompt in zip(outputs, prompts):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) > 0
        ref = _hf_logprobs(model, prompt, out.token_ids)
        for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            # The emitted token and the top k, each with HF's logprob for that very id.
            assert tok in entry and len(entry) in (TOP, TOP + 1)
            assert all(v == pytest.approx(ref[j, t].item(), abs=2e-4) for t, v in entry.items())
            # ... and they are the k most likely (compared by value: ids may swap on exact ties).
            got = sorted(entry.values(), reverse=True)[:TOP]
            assert got == pytest.approx(ref[j].topk(TOP).values.tolist(), abs=2e-4)


@pytest.mark.parametrize("draft", [None, "near"], ids=["no-draft", "near-draft"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=7)], ids=["greedy", "seeded"])
def test_logprobs_equal_hf(tiny_models, near_drafts, draft, sampling) -> None:
    tm = tiny_models["llama"]
    kw = dict(draft_model=near_drafts["llama"].path, num_speculative_tokens=3, rejection_sampling="probabilistic",
              adaptive_draft_length=False) if draft else {}  # a fixed k: both the accept and reject paths run
    llm = LLM(tm.path, **kw, **ENGINE_KW)
    prompts = random_prompts([5, 9, 3], seed=11)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=TOP, **sampling))
    if draft:
        spec = llm.spec_stats(outputs)
        assert spec.num_accepted_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens  # both paths ran
    _check(outputs, prompts, tm.hf)


def test_logprobs_zero_and_off(tiny_models) -> None:
    llm = LLM(tiny_models["llama"].path, **ENGINE_KW)
    prompt = random_prompts([4], seed=2)[0]
    only, off = llm.generate([prompt, prompt], [SamplingParams(max_tokens=4, logprobs=0, ignore_eos=True),
                                                SamplingParams(max_tokens=4, ignore_eos=True)])
    assert [len(e) for e in only.logprobs] == [1] * 4 and off.logprobs is None
    assert only.token_ids == off.token_ids  # asking for logprobs changes no token
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)


def test_emitted_logprobs_reference() -> None:
    """The helper against a plain per-row computation: rows, tokens and per-request top counts."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=g)
    rows, tokens, tops = [[0, 1], [], [4, 5, 3]], [[3, 7], [], [1, 0, 10]], [2, 4, 0]
    out = emitted_logprobs(logits, rows, tokens, tops)
    ref = torch.log_softmax(logits, dim=-1)
    for req_rows, req_tokens, k, got in zip(rows, tokens, tops, out):
        assert len(got) == len(req_rows)
        for r, t, (lp, top) in zip(req_rows, req_tokens, got):
            assert lp == pytest.approx(ref[r, t].item(), abs=1e-6)
            values, ids = ref[r].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
            assert [i for i, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)
