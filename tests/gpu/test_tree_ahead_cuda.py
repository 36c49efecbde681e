"""Speculation ahead's tree mode on CUDA, on the torch attention path and on the kernel path (the Triton tree kernel;
tree forwards replay CUDA graphs of their buckets there, engine/runner/tree_graphs.py): greedy output equals the
target alone with branches hitting, in float32 and bfloat16; seeded sampled output equals plain speculation's on both
paths (the eager draft and the draft loop)."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=256, max_num_seqs=8)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("target,draft", [("llama", "near"), ("gemma3", "gemma3-2l")])
def test_greedy_with_tree_mode_on_cuda(tiny_models, tiny_drafts, near_drafts, target, draft, dtype, backend):
    t = tiny_models[target].path
    d = near_drafts[target].path if draft == "near" else tiny_drafts[draft].path
    prompts = random_prompts([3, 21, 9, 40], seed=2)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    base = LLM(model=t, device="cuda", dtype=dtype, attention_backend=backend, **KW).generate(prompts, params)
    llm = LLM(model=t, draft_model=d, num_speculative_tokens=3, device="cuda", dtype=dtype, speculation_ahead=True,
              speculation_ahead_tree_fanout=3, attention_backend=backend, adaptive_draft_length=False, **KW)
    outs = llm.generate(prompts, params)
    if dtype == "float32":  # bfloat16: a near tie may flip between batch shapes; the hits are what is checked there
        assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    stats = llm.engine.executor.ahead.stats
    assert stats.trees > 0 and stats.drafted_tokens > 0
    if draft == "near":
        assert stats.hits_reject > 0, stats
    graphs = llm.engine.executor.ahead.runner.tree_graphs
    assert (graphs is not None and graphs.num_replays > 0) == (backend == "triton"), "tree forwards as graphs"
    assert llm.engine.target_kv.num_used_blocks() == [0] * llm.engine.target_kv.num_groups
    assert llm.engine.draft_kv.num_used_blocks() == [0] * llm.engine.draft_kv.num_groups



@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp32_seeded_sampling_with_tree_mode_equals_plain_on_cuda(tiny_models, backend):
    # A seeded sampled branch draws the noise the next proposal would: one [V] draw a draft on the eager path (torch
    # attention), [k, V] up front on the draft loop's (Triton: its graphs), so hits change no seeded output.
    m = tiny_models["llama"]
    prompts = random_prompts([5] * 6, seed=9)
    seeded = [SamplingParams(max_tokens=24, temperature=0.5, seed=s, ignore_eos=True) for s in range(6)]
    kw = dict(draft_model=m.path, num_speculative_tokens=3, device="cuda", dtype="float32", attention_backend=backend,
              **KW)
    ref = [o.token_ids for o in LLM(model=m.path, **kw).generate(prompts, seeded)]
    llm = LLM(model=m.path, speculation_ahead=True, speculation_ahead_tree_fanout=3, **kw)
    assert [o.token_ids for o in llm.generate(prompts, seeded)] == ref
    stats = llm.engine.executor.ahead.stats
    assert stats.trees > 0 and stats.hits > 5, stats
