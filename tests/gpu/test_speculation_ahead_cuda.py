"""Speculation ahead on the GPU fast path: the window ahead runs through the draft loop's CUDA graphs (a one-token
first step, then k steps, column 0 the guessed bonus token), its ids and q are cloned out of the loop's static
buffers, and hits are proposed from them. Greedy output equals the target alone; seeded sampled output equals plain
speculation's (a hit verified with another forward's q would change it)."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=256, max_num_seqs=8, cuda_graph_batch_sizes=(1, 4, 8))


@pytest.mark.parametrize("target,draft", [("llama", "self"), ("gemma3", "gemma3-2l")])
def test_fp32_greedy_with_speculation_ahead_on_cuda(tiny_models, tiny_drafts, target, draft):
    t = tiny_models[target].path
    d = t if draft == "self" else tiny_drafts[draft].path
    prompts = random_prompts([3, 21, 9, 40], seed=2)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    base = LLM(model=t, device="cuda", dtype="float32", **KW).generate(prompts, params)
    llm = LLM(model=t, draft_model=d, num_speculative_tokens=3, device="cuda", dtype="float32",
              speculation_ahead=True, **KW)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    loop = llm.executor.proposer.loop
    assert loop is not None and loop.num_graph_replays > 0 and loop.max_k == 4  # k + 1: the guess, then k
    lookups, hits, drafted, unused = llm.engine.speculation_ahead_stats()
    assert drafted > 0 and unused <= drafted
    if draft == "self":
        assert hits >= lookups - 2 * len(prompts)
    assert llm.engine.target_kv.num_used_blocks() == [0] * llm.engine.target_kv.num_groups


def test_fp32_seeded_sampling_with_speculation_ahead_equals_plain_on_cuda(tiny_models):
    m = tiny_models["llama"]
    prompts = random_prompts([5] * 6, seed=9)
    seeded = [SamplingParams(max_tokens=24, temperature=0.5, seed=s, ignore_eos=True) for s in range(6)]
    kw = dict(draft_model=m.path, num_speculative_tokens=3, device="cuda", dtype="float32", **KW)
    ref = [o.token_ids for o in LLM(model=m.path, **kw).generate(prompts, seeded)]
    llm = LLM(model=m.path, speculation_ahead=True, **kw)
    assert [o.token_ids for o in llm.generate(prompts, seeded)] == ref
    assert llm.engine.speculation_ahead_stats()[1] > 5
