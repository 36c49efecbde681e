"""Qwen3-MoE against HF transformers: logits at every prefill and decode position and greedy generation, with dense
layers among the MoE ones (mlp_only_layers, decoder_sparse_step); greedy speculation with a dense Qwen3 draft equal to
the target alone, sync and async; and speculative sampling on an MoE target following the target's distribution
(chi-square against its exact joint, with a negative control)."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyModel, hf_greedy, random_prompts
from moe_support import (
    ATOL,
    RTOL,
    decode_tokens,
    engine_logits,
    hf_logits,
    make_model,
    qwen3_dense_config,
    qwen3_moe_config,
    runner,
)
from spec_support import P_VALUE_THRESHOLD, chi_square_p_value, first_three_counts
from transformers import AutoModelForCausalLM, Qwen3Config

from engine import LLM, SamplingParams
from engine.models.llama import GatedMLP
from engine.models.qwen3_moe import Qwen3SparseMoE
from engine.sample.metadata import SamplingMetadata
from engine.sample.processing import logits_to_probs

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = random_prompts([5, 11, 18], seed=3)
DECODES = decode_tokens(8, len(PROMPTS))
# Which layers are dense under each config (transformers' rule), checked on the engine's model.
CONFIGS = {"mlp_only_layers": (dict(mlp_only_layers=[1], decoder_sparse_step=1), [False, True, False, False]),
           "sparse_step": (dict(mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False),
                           [True, False, True, False])}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, TinyModel]:
    root = tmp_path_factory.mktemp("qwen3_moe")
    return {name: make_model(root, name, qwen3_moe_config(**kw)) for name, (kw, _) in CONFIGS.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_hf_prefill_and_decode(moe_models, name):
    m = moe_models[name]
    r = runner(m.path)
    dense = [isinstance(layer.mlp, GatedMLP) for layer in r.model.model.layers]
    assert dense == CONFIGS[name][1]
    assert all(isinstance(layer.mlp, Qwen3SparseMoE) for layer, d in zip(r.model.model.layers, dense) if not d)
    for ours, ref in zip(engine_logits(r, PROMPTS, DECODES), hf_logits(m.hf, PROMPTS, DECODES), strict=True):
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


def test_greedy_matches_hf_generate(moe_models):
    m = moe_models["mlp_only_layers"]
    prompts = random_prompts([3, 9, 17, 6], seed=7)
    outs = LLM(model=m.path, max_model_len=256, block_size=4, num_kv_blocks=128).generate(
        prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(m.hf, p, 16), f"prompt of {len(p)} tokens diverged"


def test_wrong_routing_normalisation_is_caught(moe_models, monkeypatch):
    """norm_topk_prob read the other way round moves these logits far past the tolerance above."""
    m = moe_models["mlp_only_layers"]
    r = runner(m.path)
    for layer in r.model.model.layers:
        if isinstance(layer.mlp, Qwen3SparseMoE):
            layer.mlp.normalize = not layer.mlp.normalize
    ours = torch.cat(engine_logits(r, PROMPTS, DECODES[:2]))
    assert (ours - torch.cat(hf_logits(m.hf, PROMPTS, DECODES[:2]))).abs().max() > 100 * ATOL


@pytest.fixture(scope="module")
def dense_draft(tmp_path_factory) -> TinyModel:
    return make_model(tmp_path_factory.mktemp("qwen3_dense"), "qwen3-1l", qwen3_dense_config(), seed=1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_speculation_with_dense_draft_equals_target(moe_models, dense_draft, async_scheduling):
    m = moe_models["mlp_only_layers"]
    prompts = random_prompts([3, 9, 17], seed=11)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    kw = dict(block_size=4, max_model_len=64, max_num_batched_tokens=20)
    alone = [o.token_ids for o in LLM(m.path, **kw).generate(prompts, params)]
    assert alone == [hf_greedy(m.hf, p, 20) for p in prompts]
    llm = LLM(m.path, draft_model=dense_draft.path, num_speculative_tokens=3, async_scheduling=async_scheduling,
              adaptive_draft_length=False, **kw)  # a fixed k: the drafts are counted
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert llm.spec_stats(outs).num_draft_tokens > 0


# --------------------------------------------------------------------------------------------------------
# The output distribution at temperature 1 (the pattern of tests/test_spec_distribution.py, an MoE target)
# --------------------------------------------------------------------------------------------------------

SMALL_VOCAB = 8
DIST_PROMPT = [5]
DIST_SAMPLES = 10000


def _small(path, config, seed: int, head_scale: float) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".experts." in n or n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # routing and experts that change the next-token law
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path)
    return model


@torch.no_grad()
def _exact_joint(model: torch.nn.Module) -> torch.Tensor:
    """[V, V, V] exact law of the first three tokens after DIST_PROMPT at temperature 1 (the engine's processing)."""
    v = SMALL_VOCAB
    seqs = torch.tensor([DIST_PROMPT + [a, b] for a in range(v) for b in range(v)])
    probs = logits_to_probs(model(seqs).logits[:, len(DIST_PROMPT) - 1:],
                            SamplingMetadata.from_lists([1.0] * v * v, [1.0] * v * v, [0] * v * v)).double()
    return probs[0, 0][:, None, None] * probs[::v, 1][:, :, None] * probs[:, 2].view(v, v, v)


def test_speculative_sampling_on_moe_target_follows_its_distribution(tmp_path):
    common = dict(vocab_size=SMALL_VOCAB, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                  max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    target = _small(tmp_path / "t", qwen3_moe_config(**common, hidden_size=16, intermediate_size=32,
                                                     moe_intermediate_size=16, num_hidden_layers=2,
                                                     mlp_only_layers=[]), seed=0, head_scale=8.0)
    draft = _small(tmp_path / "d", Qwen3Config(**common, hidden_size=32, intermediate_size=64, num_hidden_layers=1),
                   seed=1, head_scale=8.0)
    llm = LLM(str(tmp_path / "t"), draft_model=str(tmp_path / "d"), num_speculative_tokens=2, seed=1234,
              block_size=4, max_model_len=16, max_num_seqs=DIST_SAMPLES, max_num_batched_tokens=3 * DIST_SAMPLES,
              adaptive_draft_length=False)
    counts, outs = first_three_counts(llm, DIST_PROMPT, DIST_SAMPLES, SMALL_VOCAB)
    stats = llm.spec_stats(outs)
    assert 0.05 < stats.acceptance_rate < 0.95, stats
    p_value = chi_square_p_value(counts, _exact_joint(target))
    assert p_value > P_VALUE_THRESHOLD, f"output does not follow the target (p = {p_value:.2e})"
    wrong = _exact_joint(draft)  # negative control: the same counts reject the draft's law
    support = wrong > 0
    assert chi_square_p_value(counts[support], wrong[support] / wrong[support].sum()) < 1e-6


def test_stacked_or_dummy_weights_load_and_a_missing_expert_is_refused(moe_models, tmp_path):
    """load_format "dummy" draws the experts as transformers holds them (stacked [E, 2I, H]); a checkpoint without
    one expert's tensors is refused, naming them."""
    import shutil

    from safetensors.torch import load_file, save_file

    m = moe_models["mlp_only_layers"]
    outs = LLM(m.path, load_format="dummy", max_model_len=64, block_size=4).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(outs[0].token_ids) == 3
    dst = tmp_path / "missing"
    shutil.copytree(m.path, dst)
    state = load_file(str(dst / "model.safetensors"))
    del state["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers\.2\.mlp\.experts\.gate_up_proj#\(3, 1\)"):
        LLM(str(dst), max_model_len=64)
