"""Structured outputs on the GPU fast path: a step with a grammar request drafts on the eager path (each draft
position masked under the grammar; the draft loop's graphs do not mask), the target's verify masks every position.
Greedy output with the draft equals greedy output without it and parses under the grammar; the constrained draft's
proposals are accepted; steps without a grammar still replay the draft loop's graphs."""

from __future__ import annotations

import json

import pytest
from byte_models import make_byte_models

from engine import LLM, SamplingParams
from engine.sample.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.gpu
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "size"], "additionalProperties": False}


@pytest.fixture(scope="module")
def byte_models(tmp_path_factory):
    return make_byte_models(tmp_path_factory.mktemp("byte"))


def test_grammar_steps_draft_under_the_grammar_on_cuda(byte_models):
    target, draft = byte_models
    kw = dict(max_model_len=128, block_size=16, num_kv_blocks=256, max_num_seqs=4, device="cuda", dtype="float32",
              cuda_graph_batch_sizes=(1, 2, 4))
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA))]
    base = LLM(model=target, **kw).generate(["a", "b"], params * 2)
    llm = LLM(model=target, draft_model=draft, num_speculative_tokens=3, adaptive_draft_length=False, **kw)
    loop = llm.executor.proposer.loop
    assert loop is not None
    outs = llm.generate(["a", "b"], params * 2)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert set(json.loads(o.text)) == {"color", "size"}
    assert llm.spec_stats(outs).num_accepted_tokens > 0
    assert loop.num_graph_replays == 0  # every step had a grammar request: none went through the graphs
    llm.generate(["c"], SamplingParams(max_tokens=8, ignore_eos=True))
    assert loop.num_graph_replays > 0
