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
    lookups, hits, drafted, unused, _skipped, *_ = llm.engine.speculation_ahead_stats()
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


@pytest.mark.parametrize("branches", [2, 4])
@pytest.mark.parametrize("target,draft", [("llama", "near"), ("gemma3", "gemma3-2l")])
def test_fp32_greedy_with_branches_on_cuda(tiny_models, tiny_drafts, near_drafts, target, draft, branches):
    # Fan-out: every window of every request is a row of one draft-loop run through the graphs (column 0 the
    # argmax or the runner-up for all-accepted windows, a rejection window's catch-up token for the others), the
    # runner-ups come from the step function's top-2, and scratch windows are copied back on a hit.
    t = tiny_models[target].path
    d = near_drafts[target].path if draft == "near" else tiny_drafts[draft].path
    prompts = random_prompts([3, 21, 9, 40], seed=2)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    base = LLM(model=t, device="cuda", dtype="float32", **KW).generate(prompts, params)
    llm = LLM(model=t, draft_model=d, num_speculative_tokens=3, device="cuda", dtype="float32",
              speculation_ahead=True, speculation_ahead_branches=branches, **KW)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    loop = llm.executor.proposer.loop
    assert loop is not None and loop.num_graph_replays > 0 and loop.alt is not None
    ahead = llm.executor.ahead
    assert ahead.scratch.capacity > 0 and ahead.stats.drafted_tokens > 0
    if draft == "near":
        assert ahead.stats.hits_reject > 0, ahead.stats
    assert llm.engine.target_kv.num_used_blocks() == [0] * llm.engine.target_kv.num_groups
    assert llm.engine.draft_kv.num_used_blocks() == [0] * llm.engine.draft_kv.num_groups


def test_fp32_seeded_sampling_with_branches_equals_plain_on_cuda(tiny_models, near_drafts):
    # A rejection window's noise comes from the generator the proposal after that rejection would draw from, and
    # its q is cloned out of the loop's buffers: seeded outputs equal plain speculation's.
    m = tiny_models["llama"]
    prompts = random_prompts([5] * 6, seed=9)
    seeded = [SamplingParams(max_tokens=24, temperature=0.2, seed=s, ignore_eos=True) for s in range(6)]
    kw = dict(draft_model=near_drafts["llama"].path, num_speculative_tokens=3, device="cuda", dtype="float32", **KW)
    ref = [o.token_ids for o in LLM(model=m.path, **kw).generate(prompts, seeded)]
    llm = LLM(model=m.path, speculation_ahead=True, speculation_ahead_branches=4, **kw)
    assert [o.token_ids for o in llm.generate(prompts, seeded)] == ref
    stats = llm.executor.ahead.stats
    assert stats.hits_reject > 0 and stats.hits_accept > 0, stats
