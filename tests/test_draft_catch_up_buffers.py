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


@pytest.fixture(scope="module")
def interpreted_runs(tiny_models, tmp_path_factory) -> dict:
    """Both drafters' runs of CASE on the kernel path, one interpreted child each, side by side: a draft model (a near
    copy of the Llama target: it accepts) and an EAGLE-3 head over a Qwen3 target (whose pending target states wait
    through the steps at k = 0 as the draft model's missed tokens do)."""
    from eagle3_support import random_head, write_speculators

    root = tmp_path_factory.mktemp("catch_up")
    draft = make_tiny_model(root, "llama-draft", TINY_CONFIGS["llama"], scale=5.9)
    qwen3 = tiny_models["qwen3"]
    head = write_speculators(random_head(qwen3.config, seed=1, layer_type="qwen3", norm_before_residual=True),
                             root / "head")
    script = str(Path(__file__).resolve().parent / "draft_catch_up_run.py")
    cases = {"llama": [tiny_models["llama"].path, draft.path, "draft"], "qwen3": [qwen3.path, head, "eagle3"]}
    runs = run_side_by_side([[sys.executable, script, *args, json.dumps(CASE)] for args in cases.values()])
    out = {}
    for name, (rc, stdout, stderr) in zip(cases, runs):
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        assert rc == 0 and lines, f"{name}: {stderr[-3000:]}"
        out[name] = json.loads(lines[-1][len("RESULT "):])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_draft_resumes_after_many_steps_at_k0_on_the_kernel_path(tiny_models, interpreted_runs, family):
    """Greedy with a drafter that sat at k = 0 for ten steps and then drafts: its catch-up (both requests' prompts
    and about ten tokens each) overflows the input buffers, is run ahead in pieces under Triton's interpreter, and
    the output is the target's alone, and HF's. llama: a draft model; qwen3: an EAGLE-3 head."""
    target = tiny_models[family]
    res = interpreted_runs[family]
    params = SamplingParams(max_tokens=CASE["max_tokens"], temperature=0.0, ignore_eos=True)
    alone = [o.token_ids for o in LLM(target.path, **{**ENGINE_KW, "attention_backend": "torch"}).generate(
        CASE["prompts"], params)]
    assert alone == [hf_greedy(target.hf, p, CASE["max_tokens"]) for p in CASE["prompts"]]
    assert res["tokens"] == alone
    assert 0 in res["chosen"] and 2 in res["chosen"] and res["num_drafts"] > 0
    cap = res["capacity"]
    assert sum(map(sum, res["pieces"])) > cap, res  # the catch-up held more than the buffers: it ran ahead in pieces
    assert all(sum(piece) <= cap for piece in res["pieces"])
