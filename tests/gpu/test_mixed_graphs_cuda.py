"""Mixed-batch CUDA graphs (engine/runner/cuda_graphs.py): a step with a prefill chunk beside decodes or verifies,
what a server runs whenever a request arrives while others decode, replays a graph instead of launching every
kernel from the host; so does the draft's first forward of such a step. Outputs equal the eager mixed steps' token
for token (float32), for a target alone (pipelined), a Gemma 3 target (two KV-cache groups) with a hybrid draft,
and seeded sampling."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from engine import LLM, SamplingParams
from engine.request import Request

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=512, max_num_seqs=8, cuda_graph_batch_sizes=(1, 4, 8),
          device="cuda", dtype="float32", max_num_batched_tokens=64)


def staggered(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], every: int = 3) -> list[list[int]]:
    """Add request i at engine step every * i (as requests reach a server while others run): most steps mix a
    prefill chunk (prompts longer than the 64-token budget are chunked too) with the running requests' decodes."""
    engine = llm.engine
    reqs = [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    waiting = list(reqs)
    step = 0
    while waiting or engine.has_unfinished():
        if waiting and step % every == 0:
            engine.add_request(waiting.pop(0))
        engine.step()
        step += 1
    assert all(r.finish_reason == "length" for r in reqs)
    return [list(r.output_token_ids) for r in reqs]


def run(family_path: str, mixed: bool, draft: str | None = None, sampled: bool = False,
        draft_mixed: list[int] | None = None) -> tuple[list, int, int]:
    """draft_mixed: receives the draft loop's first steps that replayed the draft's mixed graphs."""
    spec = dict(draft_model=draft, num_speculative_tokens=3) if draft else {}
    llm = LLM(family_path, seed=4, cuda_graph_mixed_token_sizes=None if mixed else (), **spec, **KW)
    prompts = random_prompts([5, 70, 12, 33, 9, 100, 17], seed=3)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, **({"temperature": 0.8, "seed": i} if sampled else {}))
              for i in range(len(prompts))]
    outs = staggered(llm, prompts, params)
    graphs = llm.engine.executor.verifier.runner.graphs
    if draft_mixed is not None:
        draft_mixed.append(llm.engine.executor.proposer.loop.num_mixed_first_steps)
    return outs, graphs.num_mixed_replays, graphs.num_replays


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_mixed_graphs_equal_eager_mixed_steps(tiny_models, family):
    eager, n_eager, _ = run(tiny_models[family].path, mixed=False)
    graphs, n_mixed, _ = run(tiny_models[family].path, mixed=True)
    assert n_eager == 0 and n_mixed >= 5, (n_eager, n_mixed)
    assert graphs == eager


def test_mixed_graphs_with_a_hybrid_draft_and_seeded_sampling(tiny_models, tiny_drafts):
    target, draft = tiny_models["gemma3"].path, tiny_drafts["gemma3-2l"].path
    draft_mixed: list[int] = []
    eager, _, _ = run(target, mixed=False, draft=draft, sampled=True, draft_mixed=draft_mixed)
    graphs, n_mixed, _ = run(target, mixed=True, draft=draft, sampled=True, draft_mixed=draft_mixed)
    assert n_mixed >= 3, n_mixed
    # The draft's first steps with a prefill chunk replayed its own mixed graphs (none where they are off).
    assert draft_mixed[0] == 0 and draft_mixed[1] >= 3, draft_mixed
    assert graphs == eager
    # Greedy with the draft equals the target alone through mixed graphs too.
    alone, _, _ = run(target, mixed=True)
    spec, _, _ = run(target, mixed=True, draft=draft)
    assert spec == alone
