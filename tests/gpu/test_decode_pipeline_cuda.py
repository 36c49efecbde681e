"""A target alone on the GPU with its steps queued one ahead (engine/decode_pipeline.py): CUDA-graph replays whose
open inputs are written on the device from the step before's sampled ids, read back through pinned memory after
the next step is queued. Outputs equal the step-by-step engine's token for token, greedy and sampled."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=256, max_num_seqs=8, cuda_graph_batch_sizes=(1, 4, 8),
          device="cuda", dtype="float32")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_pipelined_equals_step_by_step_on_cuda(tiny_models, family):
    path = tiny_models[family].path
    prompts = random_prompts([3, 21, 9, 40, 5, 6], seed=2)
    # Equal lengths and no stops: both schedules run the same batches, so even unseeded rows draw alike.
    params = [SamplingParams(max_tokens=40, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.7, top_k=5, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=40, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.9, ignore_eos=True)]
    ref = [o.token_ids for o in LLM(path, async_scheduling=False, seed=5, **KW).generate(prompts, params)]
    llm = LLM(path, seed=5, **KW)  # a target alone on CUDA: pipelined by default
    pipeline = llm.engine.executor.pipeline
    assert pipeline is not None
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert pipeline.num_queued_ahead > 30 and pipeline.pending is None
    assert llm.engine.executor.target.graphs.num_replays > 30
    assert llm.engine.target_kv.num_used_blocks() == [0] * llm.engine.target_kv.num_groups
    print(f"{family}: {pipeline.num_queued_ahead} steps queued ahead, {pipeline.num_overlapped} while the GPU "
          "still ran the step before")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_steps_without_speculation_queue_beside_a_draft_on_cuda(tiny_models, near_drafts, family):
    """A draft model pair on CUDA schedules asynchronously by default: its k = 0 steps replay queued one ahead (the
    draft sits them out), its steps that speculate run in order between them, the draft catching up. Greedy output
    equals the target alone's token for token."""
    path = tiny_models[family].path
    prompts = random_prompts([3, 21, 9, 40, 5, 6], seed=2)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in LLM(path, async_scheduling=False, **KW).generate(prompts, params)]
    llm = LLM(path, draft_model=near_drafts[family].path, num_speculative_tokens=3, **KW)
    assert llm.engine.async_scheduling
    ks = [0, 0, 0, 0, 3, 3, 0, 0, 2]
    llm.engine.scheduler.draft_length_fn = lambda batch, it=iter(ks * 100): next(it)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert all(o.spec.num_drafts > 0 for o in outs)
    pipeline = llm.engine.executor.pipeline
    assert pipeline.num_queued_ahead > 10 and pipeline.pending is None
    assert llm.engine.draft_kv.num_used_blocks() == [0] * llm.engine.draft_kv.num_groups
