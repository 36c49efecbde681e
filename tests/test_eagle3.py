"""EAGLE-3 heads (engine/models/eagle3.py, engine/speculation/eagle3_proposer.py) over tiny Llama and Qwen3 targets, in
both checkpoint formats: greedy output equal to the target alone, the formats drafting the same tokens, every
proposal equal to an independent plain-torch reference (tests/eagle3_support.py), the output distribution at
temperature 1 under probabilistic rejection, and the refused settings. Heads are random: the reference test uses
synthetic acceptance, so accepted runs (whose positions the head re-runs from the target's states) occur."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, make_tiny_model
from eagle3_support import random_head, reference_drafts, write_flat, write_speculators
from moe_support import gpt_oss_config, make_model
from spec_support import (
    ENGINE_KW,
    GREEDY,
    P_VALUE_THRESHOLD,
    PROMPTS,
    assert_kv_released,
    chi_square_p_value,
    first_three_counts,
)
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
    llm = _eagle(tiny_models[family].path, heads[family, fmt], async_scheduling=async_scheduling,
                 adaptive_draft_length=False)  # a fixed k: the head's drafts are counted
    assert isinstance(llm.executor.proposer, Eagle3Proposer)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy(family)
    stats = llm.spec_stats(outs)
    assert stats.num_draft_tokens > 0  # the head drafted
    # Finished requests' states go with the next plan (its finished ids), as the request tables' entries do.
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert not {o.request_id for o in outs} & set(llm.executor.proposer.pending)


def test_prefix_cache_hit(tiny_models, heads):
    """A prompt whose prefix is cached: the target skips those positions (no states for the head there), the head
    starts at the target's first computed position over the KV its cached blocks hold; greedy still equals HF's."""
    from conftest import hf_greedy, random_prompts

    m = tiny_models["qwen3"]
    llm = _eagle(m.path, heads["qwen3", "speculators"])
    shared = random_prompts([13], seed=3)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = llm.generate([shared + [7]], params)[0]
    second = llm.generate([shared + [9, 4]], params)[0]
    assert second.num_cached_tokens >= 12
    assert first.token_ids == hf_greedy(m.hf, shared + [7], 12)
    assert second.token_ids == hf_greedy(m.hf, shared + [9, 4], 12)


def test_preemption(tiny_models, heads, target_greedy):
    """16 blocks of 4 tokens per model do not hold the three requests at full length: some are preempted and
    recomputed (the head's pending states dropped with them, rebuilt from the recompute's)."""
    llm = _eagle(tiny_models["llama"].path, heads["llama", "flat"], num_kv_blocks=16, max_model_len=48)
    outs = llm.generate(PROMPTS, GREEDY)
    assert any(o.num_preemptions > 0 for o in outs)
    assert [o.token_ids for o in outs] == target_greedy("llama")
    assert_kv_released(llm)


def test_steps_without_speculation(tiny_models, heads):
    """Steps of more than one request run without speculation (spec_disable_above_batch_size=1): the head does not
    run then, and the target's states of those steps wait for it; when the batch is down to one request the head
    catches up over every position it missed and drafts again. Greedy equals HF's."""
    from conftest import hf_greedy

    m = tiny_models["qwen3"]
    llm = _eagle(m.path, heads["qwen3", "flat"], spec_disable_above_batch_size=1)
    lengths = [4, 8, 20]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [hf_greedy(m.hf, p, n) for p, n in zip(PROMPTS, lengths)]
    assert outs[0].spec.num_drafts == 0 and outs[2].spec.num_drafts > 0


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
        llm = _eagle(tiny_models["llama"].path, heads["llama", fmt], adaptive_draft_length=False)  # k drafts a step
        rec = _record_proposals(llm)
        llm.generate(PROMPTS, GREEDY)
        drafts.append(rec)
    assert drafts[0] == drafts[1]
    assert sum(len(row) for step in drafts[0] for row in step) > 50


# ------------------------------------------------------------------------------------------------------------
# Every proposal against the plain-torch reference, with accepted runs (synthetic acceptance)
# ------------------------------------------------------------------------------------------------------------

def _deep_target(root, family: str):
    """An 8-layer target: the default auxiliary layers (2, 4, 5) differ from other plausible choices. GPT-OSS: MoE
    layers with sinks, sliding and full attention alternating (the seeds' EAGLE-3 target family)."""
    if family == "gpt_oss":
        cfg = gpt_oss_config(num_hidden_layers=8, layer_types=["sliding_attention", "full_attention"] * 4)
        return make_model(root, "gpt-oss-deep", cfg, seed=5)
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


# The speculators options: gpt-oss heads normalise the concatenated states before fc (norm_before_fc); Eagle 3.1 heads
# feed the final norm's output forward (norm_output); fc_norm normalises each state on its own.
OPTIONS = {"": {}, "norm_before_fc+norm_output": dict(norm_before_fc=True, norm_output=True),
           "fc_norm": dict(fc_norm=True)}


@pytest.mark.parametrize("family,layer_type,options", [
    ("llama", "llama", ""), ("qwen3", "qwen3", ""), ("gpt_oss", "llama", ""),
    ("gpt_oss", "llama", "norm_before_fc+norm_output"), ("llama", "llama", "fc_norm")])
def test_proposals_match_reference(tmp_path, family, layer_type, options):
    target = _deep_target(tmp_path, family)
    w = random_head(target.config, seed=4, layer_type=layer_type, **OPTIONS[options])
    assert w.aux_layers == (2, 4, 5)
    head = (write_flat(w, tmp_path / "head", aux_in_config=False) if layer_type == "llama" and not options
            else write_speculators(w, tmp_path / "head"))
    llm = _eagle(target.path, head, rejection_sampling="synthetic", synthetic_acceptance_rate=0.6,
                 adaptive_draft_length=False)
    cases = _record_cases(llm)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert llm.spec_stats(outs).num_accepted_tokens > 5  # accepted runs happened
    assert len(cases) > 8
    for context, drafts in cases:
        assert drafts == reference_drafts(w, target.hf, context, len(drafts)), context
    # The reference can tell: each of these mistakes changes some proposal.
    wrong = [dict(aux_layers=(2, 4, 6)), dict(skip_hidden_norm=True), dict(target_ids=w.target_ids.roll(1))]
    wrong += [dict(skip_fc_norms=True)] if w.norm_before_fc or w.fc_norm else []
    wrong += [dict(feed_prenorm=True)] if w.norm_output else []
    for kw in wrong:
        assert any(drafts != reference_drafts(w, target.hf, context, len(drafts), **kw)
                   for context, drafts in cases), kw
    # Strict rejection over the same head: greedy output is the target's (HF's).
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    strict = _eagle(target.path, head, adaptive_draft_length=False).generate(PROMPTS, greedy)
    assert [o.token_ids for o in strict] == [hf_greedy(target.hf, p, 16) for p in PROMPTS]


# ------------------------------------------------------------------------------------------------------------
# Temperature 1, probabilistic rejection: the output follows the target's law
# ------------------------------------------------------------------------------------------------------------

SMALL_VOCAB = 8
# Two tokens: the first output token is the prefill's, the next two come from a verify of the head's drafts (a one-token
# prompt would speculate in its first step, before the head has a state: test_one_token_prompt).
DIST_PROMPT = [5, 3]
DIST_SAMPLES = 6000


@torch.no_grad()
def _exact_joint(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """[V, V, V] the exact probability of the first three tokens at temperature 1."""
    v = SMALL_VOCAB
    seqs = torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])
    probs = model(seqs).logits[:, len(prompt) - 1:].double().softmax(-1)  # [v * v, 3, v]
    return probs[0, 0][:, None, None] * probs[::v, 1][:, :, None] * probs[:, 2].view(v, v, v)


def test_one_token_prompt(tiny_models, heads):
    """A one-token prompt speculates in its first step, before the target has run its token: those drafts are drawn
    blind, the later ones from the head; greedy still equals HF's."""
    from conftest import hf_greedy

    m = tiny_models["llama"]
    llm = _eagle(m.path, heads["llama", "flat"])
    outs = llm.generate([[7], [9]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(m.hf, [7], 12), hf_greedy(m.hf, [9], 12)]


def test_probabilistic_rejection_follows_target(tmp_path):
    """A 3-layer target of 8 tokens with a head whose draft vocabulary leaves 2 of them out (q is 0 there: the
    draft-vocabulary probabilities scattered through d2t): the joint of the first three tokens is the target's."""
    cfg = LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    target = make_tiny_model(tmp_path, "small", cfg, seed=0, scale=1.0)
    with torch.no_grad():
        target.hf.lm_head.weight.mul_(8.0)  # peaked but far from one-hot (the model in the file is unscaled)
    target.hf.save_pretrained(target.path)
    w = random_head(cfg, draft_vocab=6, seed=9, scale=1.5)
    head = write_flat(w, tmp_path / "head")
    llm = LLM(target.path, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2,
                                               "rejection_sampling": "probabilistic"},
              seed=1234, block_size=4, max_model_len=16, max_num_seqs=DIST_SAMPLES,
              max_num_batched_tokens=3 * DIST_SAMPLES, adaptive_draft_length=False)
    counts, outs = first_three_counts(llm, DIST_PROMPT, DIST_SAMPLES, SMALL_VOCAB)
    stats = llm.spec_stats(outs)
    assert 0.05 < stats.acceptance_rate < 0.95, stats  # both accepted drafts and rejections shape the output
    joint = _exact_joint(target.hf, DIST_PROMPT)
    p_value = chi_square_p_value(counts, joint)
    assert p_value > P_VALUE_THRESHOLD, f"the output does not follow the target (p = {p_value:.2e})"
    # The test has power: a law 15% of the way to uniform is rejected by the same counts.
    wrong = 0.85 * joint + 0.15 / SMALL_VOCAB ** 3
    assert chi_square_p_value(counts, wrong) < 1e-4


# ------------------------------------------------------------------------------------------------------------
# Settings refused
# ------------------------------------------------------------------------------------------------------------

def test_speculation_ahead_refused(tiny_models, heads):
    with pytest.raises(ValueError, match="speculation_ahead cannot be used with an EAGLE-3 head"):
        _eagle(tiny_models["llama"].path, heads["llama", "flat"], speculation_ahead=True)


def test_speculative_config_errors(tiny_models, heads, tiny_drafts, target_greedy):
    target, head = tiny_models["llama"].path, heads["llama", "flat"]
    with pytest.raises(ValueError, match="unknown key.*'num_lookahead_slots'.*'typo'"):
        LLM(target, speculative_config={"method": "eagle3", "model": head, "typo": 1, "num_lookahead_slots": 2})
    with pytest.raises(ValueError, match="method 'medusa' is not supported"):
        LLM(target, speculative_config={"method": "medusa", "model": head})
    with pytest.raises(ValueError, match="needs the draft's or head's 'model'"):
        LLM(target, speculative_config={"method": "eagle3"})
    with pytest.raises(ValueError, match="either as draft_model or in speculative_config"):
        LLM(target, draft_model=head, speculative_config={"method": "eagle3", "model": head})
    with pytest.raises(ValueError, match="is not an EAGLE-3 head"):
        LLM(target, speculative_config={"method": "eagle3", "model": tiny_drafts["llama-1l"].path})
    # method draft_model in the same mapping is today's draft model, vLLM's keys read into specserve's.
    llm = LLM(target, speculative_config={"method": "draft_model", "model": tiny_drafts["llama-1l"].path,
                                          "num_speculative_tokens": 2, "disable_by_batch_size": 8}, **ENGINE_KW)
    assert llm.engine.spec_config.num_speculative_tokens == 2
    assert llm.engine.spec_config.spec_disable_above_batch_size == 8
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == target_greedy("llama")


def test_bad_heads_refused(tiny_models, tmp_path):
    cfg = tiny_models["llama"].config
    w = random_head(cfg, seed=1, aux_layers=(0, 1, 5))
    with pytest.raises(ValueError, match=r"auxiliary layer ids \[0, 1, 5\] must be distinct layers"):
        _eagle(tiny_models["llama"].path, write_flat(w, tmp_path / "aux"))
    w = random_head(cfg, seed=1)
    w.tensors["d2t"] = w.tensors["d2t"] + 200
    with pytest.raises(ValueError, match="d2t maps draft ids outside the target's vocabulary"):
        _eagle(tiny_models["llama"].path, write_flat(w, tmp_path / "d2t"))
    w = random_head(cfg, seed=1, norm_before_fc=True)
    path = write_speculators(w, tmp_path / "both-norms")
    import json
    from pathlib import Path

    raw = json.loads((Path(path) / "config.json").read_text())
    (Path(path) / "config.json").write_text(json.dumps({**raw, "fc_norm": True}))
    with pytest.raises(ValueError, match="norm_before_fc and fc_norm exclude each other"):
        _eagle(tiny_models["llama"].path, path)
    # A head whose config asks for norms its checkpoint lacks is refused by the loader, not run with unit norms.
    path = write_speculators(random_head(cfg, seed=1), tmp_path / "no-norms")
    raw = json.loads((Path(path) / "config.json").read_text())
    (Path(path) / "config.json").write_text(json.dumps({**raw, "fc_norm": True}))
    with pytest.raises(ValueError, match=r"missing 3 tensors.*fc_norm\.0\.weight"):
        _eagle(tiny_models["llama"].path, path)
