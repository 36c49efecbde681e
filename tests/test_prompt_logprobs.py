"""Prompt logprobs (vLLM's `prompt_logprobs`) equal log_softmax of HF transformers' float32 logits at every prompt
position: the prompt token's own logprob, its rank in the vocabulary and the top k. Checked across prefill chunks
(a prompt longer than the step's token budget), with and without a draft, with synchronous and asynchronous
scheduling, on a Gemma 3 hybrid model (two KV-cache groups), with prefix caching on (such a request computes its
prompt rather than reading cached blocks), and through preemption (a recomputed prompt adds no entry twice).
Asking for them changes no output token. Ray workers: tests/test_ray_executor.py; HTTP: tests/openai_parity."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from spec_support import ENGINE_KW

from engine import LLM, SamplingParams
from engine.sample.logprobs import prompt_token_logprobs

TOP = 3


def _hf_prompt_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V] float32 log_softmax of HF's logits at the positions that predict prompt[1:]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def _check(outputs, prompts, model, top: int = TOP) -> None:
    for out, prompt in zip(outputs, prompts):
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None  # nothing predicts the first token
        ref = _hf_prompt_logprobs(model, prompt)
        for j, (tok, entry) in enumerate(zip(prompt[1:], out.prompt_logprobs[1:])):
            assert tok in entry and len(entry) in (top, top + 1), (j, entry)
            assert all(v == pytest.approx(ref[j, t].item(), abs=2e-4) for t, v in entry.items()), j
            got = sorted(entry.values(), reverse=True)[:top]
            assert got == pytest.approx(ref[j].topk(top).values.tolist(), abs=2e-4), j


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("draft", [None, "near"], ids=["no-draft", "near-draft"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_equal_hf_across_chunks(tiny_models, near_drafts, family, draft, async_scheduling) -> None:
    tm = tiny_models[family]
    kw = dict(draft_model=near_drafts[family].path, num_speculative_tokens=3) if draft else {}
    llm = LLM(tm.path, async_scheduling=async_scheduling, **kw, **ENGINE_KW)
    # 47 tokens take three steps of the 20-token budget; 2 is the shortest prompt with an entry.
    prompts = random_prompts([47, 9, 2], seed=5)
    params = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=TOP)
    outputs = llm.generate(prompts, params)
    _check(outputs, prompts, tm.hf)
    plain = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_prompt_logprobs_bypass_the_prefix_cache(tiny_models) -> None:
    tm = tiny_models["llama"]
    llm = LLM(tm.path, enable_prefix_caching=True, **ENGINE_KW)
    prompt = random_prompts([30], seed=8)[0]
    first = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    again = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert again.num_cached_tokens > 0  # the cache holds the prompt's blocks...
    scored = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0  # ...which a request for prompt logprobs does not read
    assert scored.token_ids == first.token_ids == again.token_ids
    _check([scored], [prompt], tm.hf, top=0)
    assert all(len(e) == 1 for e in scored.prompt_logprobs[1:])  # prompt_logprobs=0: the token's own only


def test_prompt_logprobs_survive_preemption(tiny_models) -> None:
    """Too few KV blocks for four requests at once: some are preempted and recomputed, prompt included."""
    tm = tiny_models["llama"]
    llm = LLM(tm.path, block_size=4, max_model_len=64, max_num_batched_tokens=20, num_kv_blocks=14)
    prompts = random_prompts([21, 17, 13, 19], seed=3)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, prompt_logprobs=2))
    assert sum(o.num_preemptions for o in outputs) > 0
    _check(outputs, prompts, tm.hf, top=2)


def test_prompt_logprobs_refused_when_invalid() -> None:
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_prompt_token_logprobs_reference() -> None:
    """The helper against a plain per-row computation: rows, tokens, ranks and per-request top counts."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 13, generator=g)
    rows, tokens, tops = [[0, 1, 2], [], [5, 6]], [[3, 12, 0], [], [1, 9]], [2, 4, 0]
    out = prompt_token_logprobs(logits, rows, tokens, tops)
    ref = torch.log_softmax(logits, dim=-1)
    for req_rows, req_tokens, k, got in zip(rows, tokens, tops, out):
        assert len(got) == len(req_rows)
        for r, t, (lp, rank, top) in zip(req_rows, req_tokens, got):
            assert lp == pytest.approx(ref[r, t].item(), abs=1e-6)
            assert rank == int((ref[r] > ref[r, t]).sum()) + 1
            values, ids = ref[r].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
            assert [i for i, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)
