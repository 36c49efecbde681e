"""Prefix caching on CUDA (Triton attention, CUDA graphs): fp32 greedy outputs with caching equal HF and the
uncached engine, for a hybrid Gemma 3 target with a hybrid draft, with shared blocks in the batch."""

from __future__ import annotations

import pytest
from conftest import hf_greedy_cuda, random_prompts

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=64, max_num_seqs=8, cuda_graph_batch_sizes=(1, 4, 8),
          device="cuda", dtype="float32")


@pytest.mark.parametrize("draft", [None, "gemma3-2l"])
def test_fp32_prefix_cache_matches_hf_and_uncached_on_cuda(tiny_models, tiny_drafts, draft):
    target = tiny_models["gemma3"]
    system = random_prompts([53], seed=5)[0]  # 3 full blocks and a bit: later prompts diverge inside block 3
    prompts = [system + s for s in random_prompts([4, 30, 11, 70], seed=6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(KW, draft_model=tiny_drafts[draft].path, num_speculative_tokens=3) if draft else KW
    outs = {}
    for caching in (True, False):
        llm = LLM(model=target.path, enable_prefix_caching=caching, **kw)
        got = [llm.generate([p], params)[0] for p in prompts]  # one by one: each finds the earlier blocks
        got += llm.generate(prompts, params)  # then together, sharing them
        outs[caching] = [o.token_ids for o in got]
        if caching:
            assert all(o.num_cached_tokens >= 48 for o in got[1:])
        for _, kv in llm.engine.kv_managers():
            assert kv.num_used_blocks() == [0] * kv.num_groups
    assert outs[True] == outs[False] == [hf_greedy_cuda(target.hf, p, 24) for p in prompts * 2]
