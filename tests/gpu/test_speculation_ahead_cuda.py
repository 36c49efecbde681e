"""Speculation ahead on the GPU fast path: the window ahead runs through the draft loop's CUDA graphs (a one-token
first step, then k steps, column 0 the guessed bonus token), its ids and q are cloned out of the loop's static
buffers, and hits are proposed from them. Greedy output equals the target alone; seeded sampled output equals plain
speculation's (a hit verified with another forward's q would change it). With Saguaro sampling the loop keeps the
scaled q' of each draw (against HF's logits)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from fast_path_support import draft_runner, run_draft_loop

from engine import LLM, SamplingParams
from engine.sample.metadata import SamplingMetadata
from engine.sample.processing import logits_to_probs
from engine.sample.saguaro import SaguaroSampling, saguaro_probs
from engine.speculation.draft_loop import DraftLoop

pytestmark = pytest.mark.gpu
# A fixed k (the draft length rule off): the tests count what the draft drafted ahead and hit.
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=256, max_num_seqs=8, cuda_graph_batch_sizes=(1, 4, 8),
          adaptive_draft_length=False)


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


def saguaro_loop_rows(model, device: str, graphs: bool) -> list[tuple[list[int], torch.Tensor]]:
    """Sampled drafts of one draft loop with Saguaro sampling (top 2 scaled by 0.3), k = 4: per request and position
    (the context the draft saw, the q row the loop keeps for the verify)."""
    k = 4
    prompts = random_prompts([6, 11, 30], seed=9)
    runner = draft_runner(model, device, k, 4, graphs=graphs)
    loop = DraftLoop(runner, k, keep_probs=True, saguaro=SaguaroSampling(top_f=2, factor=0.3))
    loop.capture()
    ids, probs = run_draft_loop(runner, loop, prompts, [k] * len(prompts), temperature=0.8, seed=3)
    assert (loop.num_graph_replays > 0) == graphs
    ids, probs = ids.cpu(), probs.cpu()
    return [(p + ids[i, :j].tolist(), probs[i, j]) for i, p in enumerate(prompts) for j in range(k)]


def check_saguaro_rows(model, rows: list[tuple[list[int], torch.Tensor]]) -> None:
    """Each kept row is q' of HF's logits for its context (temperature 0.8), not q."""
    md = SamplingMetadata.from_lists([0.8], [1.0], [0])
    for ctx, kept in rows:
        with torch.no_grad():
            logits = model.hf(torch.tensor([ctx])).logits[0, -1:].float()
        q = logits_to_probs(logits, md)
        want = saguaro_probs(q, 2, 0.3)[0]
        torch.testing.assert_close(kept, want, rtol=1e-4, atol=1e-5)
        assert (want - q[0]).abs().max() > 1e-3  # the scaling shows


@pytest.mark.parametrize("graphs", [False, True])
def test_saguaro_draft_loop_keeps_the_scaled_q_on_cuda(tiny_drafts, graphs):
    # The draft loop's step function (eager, and captured in its graphs) draws from q' and keeps q' for the verify.
    model = tiny_drafts["gemma3-2l"]
    check_saguaro_rows(model, saguaro_loop_rows(model, "cuda", graphs))


def test_fp32_saguaro_with_branches_on_cuda(tiny_models, near_drafts):
    # Greedy rows are untouched by Saguaro sampling (output equals the target alone's); sampled rows run beside them
    # through the graphs, rejection windows hitting.
    t = tiny_models["llama"].path
    prompts = random_prompts([3, 21, 9, 40], seed=2)
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    base = LLM(model=t, device="cuda", dtype="float32", **KW).generate(prompts, greedy)
    llm = LLM(model=t, draft_model=near_drafts["llama"].path, num_speculative_tokens=3, device="cuda", dtype="float32",
              speculation_ahead=True, speculation_ahead_branches=4, speculation_ahead_saguaro=0.3, **KW)
    assert llm.executor.proposer.loop.saguaro is not None
    sampled = [SamplingParams(max_tokens=32, temperature=0.8, seed=s, ignore_eos=True) for s in range(4)]
    outs = llm.generate(prompts + prompts, [greedy] * 4 + sampled)
    assert [o.token_ids for o in outs[:4]] == [o.token_ids for o in base]
    assert all(len(o.token_ids) == 32 for o in outs[4:])
    assert llm.executor.proposer.loop.num_graph_replays > 0
    stats = llm.executor.ahead.stats
    assert stats.hits_reject > 0 and stats.hits_accept > 0, stats
