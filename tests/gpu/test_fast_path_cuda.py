"""The CUDA fast path: graph replays against eager steps (target decode/verify graphs and the draft loop's
graphs), draft probabilities after k replays, the draft loop's metadata rebuild against HF, and lossless greedy
speculation with a Gemma-3-style hybrid pair on the kernel path."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from fast_path_support import draft_runner, hf_draft_tokens, run_draft_loop

from engine import LLM, SamplingParams
from engine.speculation.draft_loop import DraftLoop

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=512, max_num_seqs=16,
          cuda_graph_batch_sizes=(1, 2, 4, 8, 16))


@pytest.mark.parametrize("dtype,batch", [("bfloat16", 1), ("bfloat16", 3), ("float32", 6), ("bfloat16", 13)])
def test_graph_replay_equals_eager(tiny_models, tiny_drafts, dtype, batch):
    """Batches of 3, 6 and 13 run padded in the 4, 8 and 16 graphs; every decode and verify step of the graph
    run must give the eager run's greedy tokens, with and without a draft."""
    target, draft = tiny_models["gemma3"], tiny_drafts["gemma3-2l"]
    prompts = random_prompts([5 + 7 * i % 40 for i in range(batch)], seed=batch)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for d in (None, draft.path):
        runs = {}
        for eager in (True, False):
            llm = LLM(model=target.path, draft_model=d, num_speculative_tokens=3, device="cuda", dtype=dtype,
                      enforce_eager=eager, adaptive_draft_length=False, **KW)  # verify graphs every step
            runs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
            if not eager:
                graphs = llm.executor.target.graphs
                assert graphs is not None and graphs.num_replays > 0
                if d is not None:
                    assert llm.executor.proposer.loop.num_graph_replays > 0
        assert runs[False] == runs[True]


@pytest.mark.parametrize("k", [2, 5])
def test_draft_probs_after_graph_replays_equal_eager_steps(tiny_drafts, k):
    """Sampled drafts (temperature 0.8, seeded): the tokens and the q rows that rejection sampling reads after
    k graph replays equal those of k eager steps, at every position. A replay that left a static buffer
    stale (probs written outside the graph, or step_idx not advanced) fails here."""
    model = tiny_drafts["gemma3-2l"]
    prompts = random_prompts([6, 11, 30], seed=9)
    out = {}
    for graphs in (False, True):
        runner = draft_runner(model, "cuda", k, 4, graphs=graphs)
        loop = DraftLoop(runner, k, keep_probs=True)
        loop.capture()
        ids, probs = run_draft_loop(runner, loop, prompts, [k] * len(prompts), temperature=0.8, seed=3)
        out[graphs] = (ids.clone(), probs.clone())
        assert (loop.num_graph_replays > 0) == graphs
    assert torch.equal(out[True][0], out[False][0])
    for j in range(k):
        torch.testing.assert_close(out[True][1][:, j], out[False][1][:, j], rtol=1e-5, atol=1e-6)
    assert not torch.equal(out[True][1][:, 0], out[True][1][:, k - 1])  # positions really differ


@pytest.mark.parametrize("graphs,catch_up", [(False, 1), (True, 1), (True, 2)])
def test_draft_loop_metadata_rebuilt_across_block_and_window_boundaries(tiny_drafts, graphs, catch_up):
    """Greedy draft tokens of one loop (k = 6, 4-token blocks, windows of 5 tokens in the hybrid draft) equal HF
    greedy decoding of the draft: positions, slots and window starts must move on at every replay. The first
    step catches up one token a request (the later steps' graph runs it) or two (the first-step graph)."""
    model = tiny_drafts["gemma3-2l"]
    prompts = random_prompts([6, 7, 10, 13], seed=5)
    ks = [6, 6, 3, 6]
    runner = draft_runner(model, "cuda", 6, 4, graphs=graphs)
    loop = DraftLoop(runner, 6, keep_probs=False)
    loop.capture()
    ids, _ = run_draft_loop(runner, loop, prompts, ks, catch_up=catch_up)
    assert [row[:k] for row, k in zip(ids.tolist(), ks)] == hf_draft_tokens(model, prompts, ks)
    assert loop.num_graph_replays == (6 if graphs else 0)
    assert loop.num_one_token_first_steps == (1 if graphs and catch_up == 1 else 0)


@pytest.mark.parametrize("k", [1, 4, 6])
def test_lossless_greedy_speculation_hybrid_pair_kernel_path(tiny_models, tiny_drafts, k):
    target, draft = tiny_models["gemma3"], tiny_drafts["gemma3-2l"]
    prompts = random_prompts([3, 21, 9, 40, 17], seed=2)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    base = LLM(model=target.path, device="cuda", dtype="float32", **KW).generate(prompts, params)
    llm = LLM(model=target.path, draft_model=draft.path, num_speculative_tokens=k, device="cuda", dtype="float32",
              **KW)
    assert llm.executor.target.backend == "triton"
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert llm.engine.target_kv.num_used_blocks() == [0, 0]
