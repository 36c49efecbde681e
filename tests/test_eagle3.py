"""EAGLE-3 heads (engine/models/eagle3.py, engine/speculation/eagle3_proposer.py) over tiny Llama and Qwen3 targets, in
both checkpoint formats: greedy output equal to the target alone, the formats drafting the same tokens, every
proposal equal to an independent plain-torch reference (tests/eagle3_support.py), the output distribution at
temperature 1 under probabilistic rejection, and the refused settings. Heads are random: the reference test uses
synthetic acceptance, so accepted runs (whose positions the head re-runs from the target's states) occur."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from eagle3_support import random_head, reference_drafts, write_flat, write_speculators
from spec_support import ENGINE_KW, GREEDY, P_VALUE_THRESHOLD, PROMPTS, chi_square_p_value
from transformers import LlamaConfig, Qwen3Config

from engine import LLM, SamplingParams
from engine.speculation.eagle3_proposer import Eagle3Proposer

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3


def _eagle(target: str, head: str, k: int = K, **kw) -> LLM:
    return LLM(target, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": k},
               **{**ENGINE_KW, **kw})


@pytest.fixture(scope="module")
def heads(tiny_models, tmp_path_factory) -> dict[tuple[str, str], str]:
    """(target family, format) -> a random head's directory. Llama: a flat head that names no auxiliary layers (the
    default (2, L // 2, L - 3) applies) and the same head as speculators; Qwen3: a flat Llama-layer head, and a
    speculators head with a Qwen3 layer (q/k norms), norm_before_residual and an embedding of its own."""
    root = tmp_path_factory.mktemp("eagle3")
    out = {}
    llama = random_head(tiny_models["llama"].config, seed=1)
    out["llama", "flat"] = write_flat(llama, root / "llama-flat", aux_in_config=False)
    out["llama", "speculators"] = write_speculators(llama, root / "llama-spec")
    qwen_flat = random_head(tiny_models["qwen3"].config, seed=2)
    out["qwen3", "flat"] = write_flat(qwen_flat, root / "qwen3-flat")
    qwen_spec = random_head(tiny_models["qwen3"].config, seed=3, layer_type="qwen3", norm_before_residual=True)
    embedding = tiny_models["qwen3"].hf.get_input_embeddings().weight
    out["qwen3", "speculators"] = write_speculators(qwen_spec, root / "qwen3-spec", embedding=embedding * 0.5)
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("family,fmt", [("llama", "flat"), ("llama", "speculators"), ("qwen3", "flat"),
                                        ("qwen3", "speculators")])
def test_greedy_equals_target(tiny_models, heads, target_greedy, family, fmt, async_scheduling):
    llm = _eagle(tiny_models[family].path, heads[family, fmt], async_scheduling=async_scheduling)
    assert isinstance(llm.executor.proposer, Eagle3Proposer)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy(family)
    stats = llm.spec_stats(outs)
    assert stats.num_draft_tokens > 0  # the head drafted
    # Finished requests' states go with the next plan (its finished ids), as the request tables' entries do.
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert not {o.request_id for o in outs} & set(llm.executor.proposer.pending)


def _record_proposals(llm: LLM) -> list[list[list[int]]]:
    """Every proposal's drafts per request, in step order."""
    proposer = llm.executor.proposer
    recorded: list[list[list[int]]] = []
    propose = proposer.propose

    def recording(plan, *a, **kw):
        proposal = propose(plan, *a, **kw)
        recorded.append(proposal.host_rows([r.num_draft_tokens for r in plan.requests]))
        return proposal

    proposer.propose = recording
    return recorded


def test_formats_draft_same_tokens(tiny_models, heads):
    """One head's weights in the two formats (the flat one sharing the target's embedding, the speculators one with
    a copy of it) propose the same drafts at every step."""
    drafts = []
    for fmt in ("flat", "speculators"):
        llm = _eagle(tiny_models["llama"].path, heads["llama", fmt])
        rec = _record_proposals(llm)
        llm.generate(PROMPTS, GREEDY)
        drafts.append(rec)
    assert drafts[0] == drafts[1]
    assert sum(len(row) for step in drafts[0] for row in step) > 50


# ------------------------------------------------------------------------------------------------------------
# Every proposal against the plain-torch reference, with accepted runs (synthetic acceptance)
# ------------------------------------------------------------------------------------------------------------

def _deep_target(root, family: str):
    """An 8-layer target: the default auxiliary layers (2, 4, 5) differ from other plausible choices."""
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, head_dim=16, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)
    cfg = LlamaConfig(**base) if family == "llama" else Qwen3Config(**base)
    return make_tiny_model(root, f"{family}-deep", cfg, seed=5)


def _record_cases(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens when proposed for, its drafts) for every request of every proposal: the tokens kept
    from the plans (their chunks) and the results (accepted drafts and bonus tokens). Synchronous scheduling: every
    plan's entries are explicit."""
    executor, proposer = llm.executor, llm.executor.proposer
    tokens: dict[str, list[int]] = {}
    cases: list[tuple[list[int], list[int]]] = []
    execute, propose = executor.execute, proposer.propose

    def recording_propose(plan, *a, **kw):
        proposal = propose(plan, *a, **kw)
        rows = proposal.host_rows([r.num_draft_tokens for r in plan.requests])
        for r, drafts in zip(plan.requests, rows):
            if drafts:
                cases.append((tokens[r.request_id][:r.start_pos + len(r.token_ids)], drafts))
        return proposal

    def recording_execute(plan, *a, **kw):
        for r in plan.requests:
            tokens[r.request_id] = tokens.get(r.request_id, [])[:r.start_pos] + list(r.token_ids)
        result = execute(plan, *a, **kw)
        for r, sampled in zip(plan.requests, result.sampled):
            if sampled is not None:
                tokens[r.request_id] += sampled
        return result

    proposer.propose = recording_propose
    executor.execute = recording_execute
    return cases


@pytest.mark.parametrize("family,layer_type", [("llama", "llama"), ("qwen3", "qwen3")])
def test_proposals_match_reference(tmp_path, family, layer_type):
    target = _deep_target(tmp_path, family)
    w = random_head(target.config, seed=4, layer_type=layer_type)
    assert w.aux_layers == (2, 4, 5)
    head = (write_flat(w, tmp_path / "head", aux_in_config=False) if layer_type == "llama"
            else write_speculators(w, tmp_path / "head"))
    llm = _eagle(target.path, head, rejection_sampling="synthetic", synthetic_acceptance_rate=0.6)
    cases = _record_cases(llm)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert llm.spec_stats(outs).num_accepted_tokens > 5  # accepted runs happened
    assert len(cases) > 8
    for context, drafts in cases:
        assert drafts == reference_drafts(w, target.hf, context, len(drafts)), context
    # The reference can tell: each of these mistakes changes some proposal.
    wrong = [dict(aux_layers=(2, 4, 6)), dict(skip_hidden_norm=True), dict(target_ids=w.target_ids.roll(1))]
    for kw in wrong:
        assert any(drafts != reference_drafts(w, target.hf, context, len(drafts), **kw)
                   for context, drafts in cases), kw
