"""The engine's torch path on CUDA: fp32 greedy equals HF on the same GPU, speculation stays lossless with a
hybrid (two KV-cache groups) draft, bf16 runs and speculation changes nothing a batch-1 greedy run would see."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy_cuda, random_prompts

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
# Few graph buckets: capture time, not coverage (test_fast_path_cuda.py covers padded buckets).
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=256, max_num_seqs=8, cuda_graph_batch_sizes=(1, 4, 8))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_fp32_greedy_matches_hf_on_cuda(tiny_models, family):
    m = tiny_models[family]
    prompts = random_prompts([5, 17, 40], seed=1)
    llm = LLM(model=m.path, device="cuda", dtype="float32", **KW)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy_cuda(m.hf, p, 24)


@pytest.mark.parametrize("k", [1, 4])
def test_fp32_speculation_lossless_on_cuda_with_hybrid_draft(tiny_models, tiny_drafts, k):
    target, draft = tiny_models["gemma3"], tiny_drafts["gemma3-2l"]
    prompts = random_prompts([3, 21, 9], seed=2)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    base = LLM(model=target.path, device="cuda", dtype="float32", **KW).generate(prompts, params)
    spec_llm = LLM(model=target.path, draft_model=draft.path, num_speculative_tokens=k, device="cuda",
                   dtype="float32", adaptive_draft_length=False, **KW)
    verifier = spec_llm.executor.verifier
    paths = []
    ids_on_device = verifier.ids_on_device
    verifier.ids_on_device = lambda proposal: paths.append(ids_on_device(proposal)) or paths[-1]
    spec = spec_llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    # In process the draft's ids never leave the GPU (a host copy here would wait for the draft every step).
    assert paths and all(paths)
    assert len(spec_llm.executor.draft.kv_groups) == 2
    assert spec_llm.engine.target_kv.num_used_blocks() == [0, 0]


def test_bf16_default_runs_and_self_draft_accepts(tiny_models):
    m = tiny_models["llama"]
    llm = LLM(model=m.path, draft_model=m.path, num_speculative_tokens=3, device="cuda", adaptive_draft_length=False,
              **KW)
    assert llm.engine_config.dtype == torch.bfloat16
    outs = llm.generate(random_prompts([8, 30], seed=3), SamplingParams(max_tokens=20, ignore_eos=True))
    assert all(len(o.token_ids) == 20 for o in outs)
    # Draft == target in the same dtype: verify logits differ from draft logits only by bf16 reduction order
    # (multi-token vs single-token queries), so nearly everything is accepted.
    assert llm.spec_stats(outs).acceptance_rate > 0.9


def test_seeded_sampling_on_cuda_is_batch_independent(tiny_models):
    m = tiny_models["qwen2"]
    llm = LLM(model=m.path, device="cuda", dtype="float32", **KW)
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    prompt = random_prompts([9], seed=4)[0]
    alone = llm.generate([prompt], p)[0].token_ids
    noise = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batched = llm.generate(random_prompts([4, 12], seed=5) + [prompt], [noise, noise, p])[2].token_ids
    assert alone == batched
