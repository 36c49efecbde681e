"""Speculation ahead's tree mode where a grammar masks every root candidate (engine/speculation/ahead/tree.py,
`choose_roots`): a rejection outcome's candidates exclude the rejected draft, so where the grammar allows one token
alone (the draft's own) and the budget fans out only at such outcomes (near the end of a request, where the next step
would draft nothing after the later outcomes), no candidate is left. The tree still gets one branch, at its widest
outcome, which can never hit: greedy outputs stay the target's alone and the grammar holds. Tiny byte-level models (a
real tokenizer, for the grammar), the draft a noisy copy of the target.
"""

from __future__ import annotations

import pytest
from byte_models import make_byte_models
from test_speculation_ahead import _assert_released

import engine.speculation.ahead.tree as tree_ahead
from engine import LLM, SamplingParams
from engine.request import Request
from engine.sample.grammar_matchers import compile_grammar
from engine.sample.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(num_speculative_tokens=3, max_model_len=128, device="cpu", block_size=4, num_kv_blocks=256,
          adaptive_draft_length=False)  # trees at every step
TREE = dict(speculation_ahead=True, speculation_ahead_tree_fanout=2)
# A free letter, then a literal the grammar forces byte by byte (one token a byte): most positions allow one token.
REGEX = "([a-z]=0123456789;)+"
PROMPTS = ["a", "The sea is", "def f(x):"]
# Ends by max_tokens inside the literal: the last steps' trees fan out at early outcomes only, which it forces.
GRAMMAR = SamplingParams(max_tokens=21, structured_outputs=StructuredOutputsParams(regex=REGEX))


@pytest.fixture(scope="module")
def byte_pair(tmp_path_factory):
    return make_byte_models(tmp_path_factory.mktemp("byte"))


def test_a_tree_whose_candidates_are_all_masked_keeps_one_root(byte_pair, monkeypatch):
    target, draft = byte_pair
    alone = LLM(target, **KW).generate(PROMPTS, GRAMMAR)
    roots_of, draft_tree = tree_ahead.top_f_roots_many, tree_ahead.draft_tree
    masked: list[tuple[int, list[int]]] = []  # this draft_tree call's trees with no candidate: (tree, F_a per outcome)
    kept: list[tuple[list[int], list[int]]] = []  # every such tree's (F_a per outcome, its branches' outcomes)

    def spy_roots(logits, windows, fanouts):  # noqa: ANN001, ANN202
        roots = roots_of(logits, windows, fanouts)
        masked.extend((i, list(fan)) for i, (r, fan) in enumerate(zip(roots, fanouts)) if not any(r))
        return roots

    def spy_tree(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        masked.clear()
        trees = draft_tree(*args, **kwargs)
        kept.extend((fan, [where - 1 for where in trees[i].outcome]) for i, fan in masked)  # roots[a + 1]: outcome a
        return trees

    monkeypatch.setattr(tree_ahead, "top_f_roots_many", spy_roots)
    monkeypatch.setattr(tree_ahead, "draft_tree", spy_tree)
    llm = LLM(target, draft_model=draft, **KW, **TREE)
    outs = llm.generate(PROMPTS, GRAMMAR)
    assert kept, "no tree had every candidate masked"
    # One branch, at the outcome the schedule fanned out widest.
    assert all(outcomes == [fan.index(max(fan))] for fan, outcomes in kept), kept
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    spec = llm.engine._grammar(Request("spec", [1], GRAMMAR))
    for o in outs:
        m = compile_grammar(spec).deep_copy()
        assert all(m.consume_token(t) for t in o.token_ids), o.text
    _assert_released(llm)
