"""Speculation ahead's tree mode for every kind of request (engine/speculation/ahead/tree.py): grammars (structured
outputs), logits processing (penalties, logit_bias, bad words) and seeded sampling get trees, and a branch is what
the next proposal after its outcome would draft: greedy outputs equal the target alone, seeded sampled outputs equal
plain speculation's token for token, a grammar request's branches start from tokens its grammar allows after the
accepted prefix and follow it along the branch, and the engine's ahead budget counts exactly the requests the draft
drafts ahead. Tiny byte-level models (a real tokenizer, for the grammars), the draft a noisy copy of the target.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from byte_models import make_byte_models
from test_speculation_ahead import _ahead, _assert_released

from engine import LLM, SamplingParams
from engine.sample.grammar_matchers import compile_grammar
from engine.sample.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(num_speculative_tokens=3, max_model_len=128, device="cpu", block_size=4, num_kv_blocks=256)
# A fixed k (the draft length rule off): windows drafted ahead for k hit, and are counted, at that k.
TREE = dict(speculation_ahead=True, speculation_ahead_tree_fanout=2, adaptive_draft_length=False)
SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}}, "required": ["color", "size", "ok"], "additionalProperties": False}
PROMPTS = ["a", "The sea is", "def f(x):", "0123"]
N = 24


@pytest.fixture(scope="module")
def byte_pair(tmp_path_factory):
    return make_byte_models(tmp_path_factory.mktemp("byte"))


def _grammar(temperature: float = 0.0, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=48, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA))


def _penalised(temperature: float = 0.0, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=temperature, seed=seed, ignore_eos=True, repetition_penalty=1.4,
                          presence_penalty=0.5, frequency_penalty=0.3, logit_bias={40: 3.0},
                          bad_words_token_ids=[[72, 104]], min_tokens=4)


class _Spy:
    """Per request, the lookups that hit; and every pre-draft's branches as (output so far, d_1..d_a, root, drafts),
    for the requests of `watch`."""

    def __init__(self, llm: LLM, watch: set[str]) -> None:
        self.hits: dict[str, int] = {}
        self.branches: list[tuple[str, list[int], list[int]]] = []  # (request, output, d[:a] + [t] + e)
        ahead = _ahead(llm)
        lookup, speculate_ahead = ahead._lookup, ahead.speculate_ahead

        def spy_lookup(entries, p, plan):  # noqa: ANN001, ANN202
            e = lookup(entries, p, plan)
            self.hits[p.request_id] = self.hits.get(p.request_id, 0) + (e is not None)
            return e

        def spy_speculate_ahead(plan, proposal):  # noqa: ANN001, ANN202
            n = speculate_ahead(plan, proposal)
            host = proposal.host_rows([p.num_draft_tokens for p in plan.requests])
            for p, d in zip(plan.requests, host):
                for e in ahead.cache.entries.get(p.request_id, []) if p.request_id in watch else []:
                    self.branches.append((p.request_id, list(p.output_token_ids or []),
                                          [*d[:e.outcome], e.tokens[-1], *e.token_ids.tolist()]))
            return n

        ahead._lookup, ahead.speculate_ahead = spy_lookup, spy_speculate_ahead


@pytest.mark.parametrize("async_", [False, True])
def test_mixed_batch_greedy_equals_target_alone_and_seeded_equals_plain(byte_pair, async_):
    # Greedy grammar, penalised and plain requests beside a seeded sampled one, all with trees: the greedy ones equal
    # the target alone; the seeded one equals plain speculation (its branches drew what its proposals would have).
    target, draft = byte_pair
    params = [_grammar(), _penalised(), SamplingParams(max_tokens=N, ignore_eos=True),
              SamplingParams(max_tokens=N, temperature=0.8, seed=11, ignore_eos=True)]
    alone = LLM(target, **KW).generate(PROMPTS[:3], params[:3])
    plain = LLM(target, draft_model=draft, **KW).generate(PROMPTS[3:], params[3:])
    llm = LLM(target, draft_model=draft, async_scheduling=async_, **KW, **TREE)
    spy = _Spy(llm, set())
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in alone]
    assert outs[3].token_ids == plain[0].token_ids
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert all(spy.hits.get(o.request_id, 0) > 0 for o in outs), spy.hits  # every kind's trees hit
    _assert_released(llm)


def test_seeded_grammar_and_penalties_equal_plain_speculation(byte_pair):
    # Seeded sampling with grammars and penalties: a branch's drafts come from the logits the proposal would process
    # (the grammar's matcher after the accepted drafts and the root, the penalties over that history) with the noise
    # the proposal would draw (its generator at the next output position), so a hit proposes what the proposal
    # would have, q included, and the outputs equal plain speculation's token for token. Every branch of a grammar
    # request (root and drafts after the accepted prefix) is one the grammar allows.
    target, draft = byte_pair
    params = [_grammar(1.0, 3), _grammar(0.7, 4), _penalised(0.5, 5), _penalised(0.0)]
    plain = LLM(target, draft_model=draft, rejection_sampling="probabilistic", **KW).generate(PROMPTS, params)
    llm = LLM(target, draft_model=draft, rejection_sampling="probabilistic", **KW, **TREE)
    ids = [f"gen-{i}" for i in range(len(PROMPTS))]
    spy = _Spy(llm, set(ids[:2]))
    outs = llm.generate(PROMPTS, params)
    assert [o.request_id for o in outs] == ids
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for o in outs[:2]:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert all(spy.hits.get(i, 0) > 0 for i in ids), spy.hits
    assert spy.branches, "no grammar branch drafted"
    eos = set(_grammar_spec(llm, params[0]).eos_token_ids)
    for rid, output, branch in spy.branches:
        m = compile_grammar(_grammar_spec(llm, params[0])).deep_copy()
        assert all(m.consume_token(t) for t in output)
        for t in branch:
            if t in eos and m.is_accepting():
                break
            assert m.try_consume_tokens([t]) == 1, (rid, output, branch, t)
    _assert_released(llm)


def _grammar_spec(llm: LLM, params: SamplingParams):  # noqa: ANN202 - the engine's GrammarSpec of the schema
    from engine.request import Request

    return llm.engine._grammar(Request("spec", [1], params))


@pytest.mark.parametrize("ahead", [dict(speculation_ahead_branches=2), TREE])
def test_the_budget_counts_the_requests_drafted_ahead(byte_pair, ahead):
    # The engine sizes each step's drafting ahead by the requests the draft drafts ahead: windows leave out those
    # with logits processing (and so the count does), trees take every kind.
    target, draft = byte_pair
    llm = LLM(target, draft_model=draft, **KW, **dict(ahead, speculation_ahead=True))
    engine, drafts = llm.engine, _ahead(llm)
    budget, make_plan, speculate_ahead = engine.speculation_ahead.budget, engine.make_plan, drafts.speculate_ahead
    counts: dict[str, list[int]] = {"branches": [], "tree_nodes": []}  # the requests the budget counted, by step
    branches, tree_nodes = budget.branches, budget.tree_nodes
    budget.branches = lambda n: counts["branches"].append(n) or branches(n)
    budget.tree_nodes = lambda ks: counts["tree_nodes"].append(len(ks)) or tree_nodes(ks)
    counted: dict[int, int] = {}  # plan -> the requests its budget counted
    drafted: dict[int, int] = {}  # plan -> the requests drafted ahead after its proposal

    def spy_plan(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        plan = make_plan(*a, **kw)
        counted[plan.step_id] = counts["branches"][-1]
        return plan

    def spy_speculate_ahead(plan, proposal):  # noqa: ANN001, ANN202
        n = speculate_ahead(plan, proposal)
        drafted[plan.step_id] = len(drafts._pending)  # one entry a request drafted ahead
        return n

    engine.make_plan, drafts.speculate_ahead = spy_plan, spy_speculate_ahead
    params = [_grammar(), _penalised(0.9, 5), SamplingParams(max_tokens=N, ignore_eos=True),
              SamplingParams(max_tokens=N, temperature=0.8, seed=2, ignore_eos=True)]
    llm.generate(PROMPTS, params)
    assert drafted and all(counted[step] == n for step, n in drafted.items()), (counted, drafted)
    if "speculation_ahead_tree_fanout" in ahead:
        assert counts["tree_nodes"] == counts["branches"] and max(drafted.values()) == len(PROMPTS), counts
    else:  # the grammar and the penalised requests draft just in time
        assert max(drafted.values()) == 2, drafted
