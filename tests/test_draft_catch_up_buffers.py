"""A draft's catch-up larger than the kernel path's input buffers. After steps at draft length 0 the draft catches up
on every token it missed in its next forward, and that catch-up is not charged to the step's token budget, so it can
hold more tokens than the buffers (max_num_batched_tokens + max_num_seqs * (k + 2)). The runner then runs the
leading tokens ahead in forwards that fit (ModelRunner.fit_chunks) and the tail as the usual forward."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import TINY_CONFIGS, hf_greedy, make_tiny_model, random_prompts
from draft_catch_up_support import ENGINE_KW
from interpreter_children import run_side_by_side, skip_without_triton

from engine import LLM, SamplingParams
from engine.runner.step_input import Chunk

skip_without_triton()

# Ten steps at k = 0, then k = 2: the catch-up is both prompts and about ten tokens each (30+; the buffers hold 16).
CASE = {"prompts": random_prompts([5, 9], seed=7), "max_tokens": 16, "ks": [0] * 10 + [2]}


@pytest.fixture(scope="module")
def kernel_llm(tiny_models) -> LLM:
    """A target on the kernel path, built in this process (nothing run): its runner's host-side cutting is tested
    with the forwards recorded instead of run."""
    return LLM(tiny_models["llama"].path, attention_backend="triton", **ENGINE_KW)


def _record_pieces(runner, monkeypatch) -> list[list[Chunk]]:
    pieces: list[list[Chunk]] = []
    monkeypatch.setattr(runner, "_prefill_piece", pieces.append)
    return pieces


def test_fit_chunks_cuts_an_oversized_catch_up_in_causal_order(kernel_llm, monkeypatch):
    runner = kernel_llm.engine.executor.target
    cap = runner.buffers.max_num_tokens
    pieces = _record_pieces(runner, monkeypatch)
    fits = [Chunk(list(range(3, 3 + cap - 1)), 0, 1, [[0]]), Chunk([5], 7, 1, [[1, 2]])]
    assert runner.fit_chunks(fits) is fits and pieces == []  # within the buffers: untouched, nothing run ahead
    tables = [[list(range(20))], [list(range(20, 40))]]
    cases = [[Chunk(list(range(100, 100 + 2 * cap + 3)), 4, 1, tables[0]), Chunk(list(range(300, 300 + cap)), 0, 3,
                                                                                  tables[1])],
             [Chunk(list(range(200, 207)), 10, 0, tables[0]), Chunk(list(range(400, 400 + cap + 2)), 0, 1, tables[1])]]
    for chunks in cases:
        pieces.clear()
        rest = runner.fit_chunks(chunks)
        # The rest: every chunk, in order, with its logits rows, holding its last max(num_logits, 1) tokens.
        assert [(c.token_ids, c.start_pos, c.num_logits, c.block_tables) for c in rest] == [
            (o.token_ids[-max(o.num_logits, 1):], o.start_pos + len(o.token_ids) - max(o.num_logits, 1), o.num_logits,
             o.block_tables) for o in chunks]
        # Run ahead: each piece fits and wants no logits; each request's leading tokens, once each, in order.
        assert pieces and all(sum(len(c.token_ids) for c in p) <= cap for p in pieces)
        assert all(c.num_logits == 0 and len(c.token_ids) > 0 for p in pieces for c in p)
        for orig, kept in zip(chunks, rest):
            segs = [c for p in pieces for c in p if c.block_tables is orig.block_tables]
            assert all(sum(c.block_tables is orig.block_tables for c in p) <= 1 for p in pieces)
            assert [t for c in segs for t in c.token_ids] + kept.token_ids == orig.token_ids
            assert [c.start_pos for c in segs] == [orig.start_pos + sum(len(s.token_ids) for s in segs[:i])
                                                   for i in range(len(segs))]


def test_fit_chunks_refuses_logits_rows_past_the_buffers(kernel_llm, monkeypatch):
    runner = kernel_llm.engine.executor.target
    cap = runner.buffers.max_num_tokens
    pieces = _record_pieces(runner, monkeypatch)
    with pytest.raises(ValueError, match="logits rows does not fit the input buffers"):
        runner.fit_chunks([Chunk(list(range(3, 3 + cap + 1)), 0, cap + 1, [list(range(20))])])
    assert pieces == []


def test_draft_resumes_after_many_steps_at_k0_on_the_kernel_path(tiny_models, tmp_path):
    """Greedy with a draft that sat at k = 0 for ten steps and then drafts: its catch-up (both requests' prompts
    and about ten tokens each) overflows the input buffers, is run ahead in pieces under Triton's interpreter, and
    the output is the target's alone, and HF's."""
    target = tiny_models["llama"]
    draft = make_tiny_model(tmp_path, "llama-draft", TINY_CONFIGS["llama"], scale=5.9)  # a near copy: it accepts
    script = str(Path(__file__).resolve().parent / "draft_catch_up_run.py")
    [(rc, stdout, stderr)] = run_side_by_side([[sys.executable, script, target.path, draft.path, json.dumps(CASE)]])
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert rc == 0 and lines, stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    params = SamplingParams(max_tokens=CASE["max_tokens"], temperature=0.0, ignore_eos=True)
    alone = [o.token_ids for o in LLM(target.path, **{**ENGINE_KW, "attention_backend": "torch"}).generate(
        CASE["prompts"], params)]
    assert alone == [hf_greedy(target.hf, p, CASE["max_tokens"]) for p in CASE["prompts"]]
    assert res["tokens"] == alone
    assert 0 in res["chosen"] and 2 in res["chosen"] and res["num_drafts"] > 0
    cap = res["capacity"]
    run_ahead = sum(n for piece in res["pieces"] for _, n in piece)
    assert run_ahead > cap, res  # the catch-up held more than the buffers: it ran ahead in pieces
    assert all(sum(n for _, n in piece) <= cap for piece in res["pieces"])
