"""Logprobs and logits processing on CUDA (graph-replayed forwards, the draft loop, the Triton rejection kernel):
greedy output with penalties and logit_bias equals the CPU engine's with and without a draft, logprobs equal HF's
float32 log-softmax on the GPU, and a batch mixing processed and plain requests leaves the plain ones untouched."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=256, max_num_seqs=8, cuda_graph_batch_sizes=(1, 4, 8))
PROCESSED = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.4, logit_bias={7: 3.0, 9: -50.0},
                 min_tokens=3)


@pytest.mark.parametrize("draft", [False, True], ids=["no-draft", "near-draft"])
def test_processed_greedy_equals_cpu(tiny_models, near_drafts, draft):
    m = tiny_models["llama"]
    kw = dict(draft_model=near_drafts["llama"].path, num_speculative_tokens=3) if draft else {}
    prompts = random_prompts([5, 17, 9], seed=4)
    params = [SamplingParams(max_tokens=24, **PROCESSED), SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=24, logprobs=4, **PROCESSED)]
    cpu = LLM(model=m.path, device="cpu", max_model_len=256, block_size=16).generate(prompts, params)
    gpu = LLM(model=m.path, device="cuda", dtype="float32", **kw, **KW).generate(prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    for tok, a, b in zip(gpu[2].token_ids, gpu[2].logprobs, cpu[2].logprobs):
        assert a[tok] == pytest.approx(b[tok], abs=1e-3)
        assert sorted(a.values()) == pytest.approx(sorted(b.values()), abs=1e-3)  # ids may swap on ties


def test_logprobs_equal_hf_on_cuda(tiny_models, near_drafts):
    m = tiny_models["llama"]
    llm = LLM(model=m.path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3, device="cuda",
              dtype="float32", **KW)
    prompts = random_prompts([6, 11], seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.9, seed=3, logprobs=5, ignore_eos=True))
    hf = m.hf.to("cuda")
    try:
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + out.token_ids], device="cuda")).logits[0].float()
            ref = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1).cpu()
            for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
                assert tok in entry
                assert all(v == pytest.approx(ref[j, t].item(), abs=1e-3) for t, v in entry.items())
                assert sorted(entry.values(), reverse=True)[:5] == pytest.approx(ref[j].topk(5).values.tolist(),
                                                                                 abs=1e-3)
    finally:
        m.hf.to("cpu")
