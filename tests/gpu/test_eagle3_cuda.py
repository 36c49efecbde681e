"""EAGLE-3 heads on CUDA, eagerly (the kernel path: Triton attention, the few-row products): fp32 greedy with the head
equals HF's greedy on the same GPU for a Llama and a Qwen3 target, in both checkpoint formats; and with CUDA graphs
(the target's keeping the auxiliary states, the head's loop replaying its first step from the target's states and its
later steps), with the same drafts as eagerly, and the draft probabilities written inside the head loop's replays."""

from __future__ import annotations

import pytest
from conftest import hf_greedy_cuda, random_prompts
from eagle3_support import random_head, write_flat, write_speculators

from engine import LLM, SamplingParams
from engine.speculation.eagle3_proposer import Eagle3Proposer

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=256, max_num_seqs=8, device="cuda", dtype="float32")


@pytest.mark.parametrize("family,fmt", [("llama", "flat"), ("qwen3", "speculators")])
def test_eager_head_greedy_matches_hf_on_cuda(tiny_models, tmp_path, family, fmt):
    m = tiny_models[family]
    w = random_head(m.config, seed=1, layer_type="qwen3" if fmt == "speculators" else "llama")
    head = write_flat(w, tmp_path / "head") if fmt == "flat" else write_speculators(w, tmp_path / "head")
    llm = LLM(m.path, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3},
              enforce_eager=True, adaptive_draft_length=False, **KW)
    assert isinstance(llm.executor.proposer, Eagle3Proposer)
    prompts = random_prompts([5, 17, 40], seed=1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy_cuda(m.hf, p, 24)
    assert llm.spec_stats(outs).num_draft_tokens > 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_graphed_target_with_eager_head_matches_hf(tiny_models, tmp_path, family):
    """The target's CUDA graphs keep the auxiliary states as a side output: with graphs (the default) greedy output
    with the head equals HF's, the verify replayed graphs, and the head drafted from the replayed states (drafts
    accepted: a head fed stale or zero states from a graph's memory would fail both)."""
    m = tiny_models[family]
    head = write_flat(random_head(m.config, seed=1), tmp_path / "head")
    llm = LLM(m.path, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3},
              adaptive_draft_length=False, **KW)
    target = llm.executor.target
    assert target.graphs is not None and target.graphs.side_output is not None
    prompts = random_prompts([5, 17, 40], seed=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy_cuda(m.hf, p, 24)
    assert target.graphs.num_replays > 0
    loop = llm.executor.proposer.loop
    assert loop.num_first_graph_steps > 0  # whole proposals replayed: the first step from the target's states too
    assert loop.num_graph_replays > loop.num_first_graph_steps  # and the later steps
    eager = LLM(m.path, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3},
                adaptive_draft_length=False, enforce_eager=True, **KW)
    want = eager.spec_stats(eager.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True)))
    got = llm.spec_stats(outs)
    # The same drafts either way (fp32; the head's inputs are the same states): the same acceptance counts.
    assert (got.num_draft_tokens, got.num_accepted_tokens) == (want.num_draft_tokens, want.num_accepted_tokens)


def test_head_loop_writes_draft_probabilities_in_replay(tiny_models, tmp_path):
    """Sampled drafts on the head's graphed loop: the q of every column it drafts (what probabilistic rejection reads:
    all k where the whole proposal replays, 1..k-1 after an eager first step) come out of the replays as
    distributions over the draft vocabulary (zero off it), one per row and column drafted."""
    import torch

    m = tiny_models["llama"]
    w = random_head(m.config, seed=1)
    head = write_flat(w, tmp_path / "head")
    llm = LLM(m.path, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3},
              adaptive_draft_length=False, **KW)
    loop = llm.executor.proposer.loop
    seen = []

    def recording(run, first_column):
        def record(chunks, ks, *a, **kw):
            ids, q = run(chunks, ks, *a, **kw)
            seen.append((first_column, list(ks), None if q is None else q.clone()))
            return ids, q
        return record

    loop.run_first, loop.run_later = recording(loop.run_first, 0), recording(loop.run_later, 1)
    llm.generate(random_prompts([5, 17], seed=3), SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
    assert loop.num_first_graph_steps > 0 and {first for first, _, _ in seen} == {0, 1}
    off = torch.ones(m.config.vocab_size, dtype=torch.bool, device="cuda")
    off[llm.executor.proposer.head.draft_to_target] = False
    for first, ks, q in seen:
        assert q is not None
        for row, k in enumerate(ks):
            for j in range(first, k):
                torch.testing.assert_close(q[row, j].sum().item(), 1.0, atol=1e-4, rtol=0)
                assert not q[row, j][off].any()
