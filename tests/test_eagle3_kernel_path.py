"""An EAGLE-3 head on the kernel path (input buffers at fixed addresses, Triton attention, the few-row products), on
CPU under Triton's interpreter, in a child process (tests/interpreter_children.py): greedy with the head equals HF's
for a Qwen3 target and a speculators head with a Qwen3 layer (the head drafts; a one-token prompt takes its blind first
drafts there too); and the head's loop (engine/speculation/eagle3_loop.py: whole proposals from static buffers, the
target's states and the head's own carried from step to step, every KV-cache group's metadata rebuilt in place; and
steps 1..k-1 after an eager first step over a longer catch-up) proposes what the plain-torch reference does, proposal
by proposal, for a head with the speculators norms. Interpreted steps are slow, and the torch path's tests cover the
rest."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from interpreter_children import assert_pytest_children_pass, split_by

from engine.kernels.triton_compat import HAS_TRITON, interpreting

if not HAS_TRITON:
    pytest.skip("triton is not installed (the `test` extra installs it on Linux)", allow_module_level=True)

interpreted = pytest.mark.skipif(not interpreting(), reason="runs in the TRITON_INTERPRET=1 child process")


@pytest.mark.skipif(interpreting(), reason="already under the interpreter")
def test_eagle3_kernel_path_under_interpreter():
    # Two children side by side, about equal: the head's loop against the reference, and the rest.
    assert_pytest_children_pass(__file__, split_by("head_loop"))


@interpreted
def test_kernel_path_greedy_with_head_equals_hf():
    import torch
    from conftest import TINY_CONFIGS, hf_greedy, make_tiny_model
    from eagle3_support import random_head, write_speculators

    from engine import LLM, SamplingParams
    from engine.speculation.eagle3_proposer import Eagle3Proposer

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    m = make_tiny_model(root, "qwen3", TINY_CONFIGS["qwen3"])
    head = write_speculators(random_head(m.config, seed=1, layer_type="qwen3", norm_before_residual=True),
                             root / "head")
    llm = LLM(m.path, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2},
              device="cpu", attention_backend="triton", block_size=4, num_kv_blocks=64, max_num_seqs=2,
              small_m_rows=1, max_model_len=64, adaptive_draft_length=False)
    assert llm.executor.target.backend == llm.executor.draft.backend == "triton"
    assert isinstance(llm.executor.proposer, Eagle3Proposer)
    prompts = [[5, 9, 14, 3, 7], [8]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(m.hf, p, 5) for p in prompts]
    assert llm.spec_stats(outs).num_draft_tokens > 0


@interpreted
def test_head_loop_proposals_match_reference():
    """k = 3, 4-token blocks (the loop's steps cross blocks), synthetic acceptance (accepted runs, which the first step
    re-runs from the target's states), a head with norm_before_fc and norm_output: every proposal equals the
    reference's, and the loop ran them: whole proposals (catch-ups of at most k + 1 tokens) and the later steps after
    a prompt's catch-up."""
    import torch
    from eagle3_support import random_head, reference_drafts, write_speculators
    from test_eagle3 import _deep_target, _record_cases

    from engine import LLM, SamplingParams

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    target = _deep_target(root, "llama")
    w = random_head(target.config, seed=4, norm_before_fc=True, norm_output=True)
    head = write_speculators(w, root / "head")
    llm = LLM(target.path, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3},
              device="cpu", attention_backend="triton", block_size=4, num_kv_blocks=64, max_num_seqs=2,
              small_m_rows=1, max_model_len=64, adaptive_draft_length=False, rejection_sampling="synthetic",
              synthetic_acceptance_rate=0.6)
    loop = llm.executor.proposer.loop
    assert loop is not None
    runs = []
    run_first, run_later = loop.run_first, loop.run_later
    loop.run_first = lambda *a, **kw: runs.append("first") or run_first(*a, **kw)
    loop.run_later = lambda *a, **kw: runs.append("later") or run_later(*a, **kw)
    cases = _record_cases(llm)
    prompts = [[5, 9, 14, 3, 7], [8, 21, 4]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert llm.spec_stats(outs).num_accepted_tokens > 3
    assert runs.count("first") >= 2 and runs.count("later") >= 1, runs
    assert any(len(drafts) == 3 for _, drafts in cases)
    for context, drafts in cases:
        assert drafts == reference_drafts(w, target.hf, context, len(drafts)), context
    # States that do not match the catch-up's tokens are refused before anything is copied or run.
    from engine.runner.step_input import Chunk

    width = loop.target_in.shape[1]
    with pytest.raises(ValueError, match=r"target states of \[1\] tokens for chunks of \[2\]"):
        run_first([Chunk([1, 2], 0, 1, [])], [1], [torch.zeros(1, width)], None, {}, None)
