"""GPT-OSS against HF transformers: logits at every prefill and decode position and greedy generation (sliding
window 3 under a KV block of 4, alternating with full layers: two KV-cache groups; attention sinks; YaRN; the clamped
SwiGLU experts), a wrong sink or clamp caught by the same tolerance, and greedy speculation with a GPT-OSS draft equal
to the target alone, sync and async."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TinyModel, hf_greedy, random_prompts
from moe_support import ATOL, RTOL, decode_tokens, engine_logits, gpt_oss_config, hf_logits, make_model, runner
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.quantization import mxfp4

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = random_prompts([5, 11, 18], seed=3)
DECODES = decode_tokens(10, len(PROMPTS))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> TinyModel:
    return make_model(tmp_path_factory.mktemp("gpt_oss"), "gpt-oss", gpt_oss_config())


@pytest.fixture(scope="module")
def near_gpt_oss(gpt_oss, tmp_path_factory) -> TinyModel:
    """A GPT-OSS draft that agrees with the target often: its weights plus 5% noise, one layer fewer (a sliding
    one, so the draft has both groups too)."""
    cfg = copy.deepcopy(gpt_oss.config)
    cfg.num_hidden_layers, cfg.layer_types = 2, ["sliding_attention", "full_attention"]
    model = AutoModelForCausalLM.from_config(cfg).eval()
    target = gpt_oss.hf.state_dict()
    torch.manual_seed(3)
    with torch.no_grad():
        model.load_state_dict({n: w + 0.05 * w.std() * torch.randn_like(w) if w.dim() >= 2 else w.clone()
                               for n, w in target.items() if n in model.state_dict()})
    path = tmp_path_factory.mktemp("gpt_oss_draft") / "near"
    model.save_pretrained(path)
    return TinyModel("gpt-oss-near", str(path), model, cfg)


def test_logits_match_hf_prefill_and_decode(gpt_oss):
    r = runner(gpt_oss.path)
    assert [(g.layer_ids, g.spec.sliding_window) for g in r.kv_groups] == [((0, 2), 3), ((1,), None)]
    for ours, ref in zip(engine_logits(r, PROMPTS, DECODES), hf_logits(gpt_oss.hf, PROMPTS, DECODES), strict=True):
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


def test_greedy_matches_hf_generate(gpt_oss):
    prompts = random_prompts([3, 9, 17, 6], seed=7)
    outs = LLM(model=gpt_oss.path, max_model_len=256, block_size=4, num_kv_blocks=128).generate(
        prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(gpt_oss.hf, p, 16), f"prompt of {len(p)} tokens diverged"


@pytest.mark.parametrize("fault", ["sinks ignored", "no clamp", "softmax before top-k"])
def test_a_wrong_sink_clamp_or_routing_is_caught(gpt_oss, fault):
    """The tolerance of the comparisons above is far below what each GPT-OSS detail changes in these logits."""
    r = runner(gpt_oss.path)
    for layer in r.model.model.layers:
        if fault == "sinks ignored":
            layer.self_attn.sinks.data.fill_(-1e9)
        elif fault == "no clamp":
            layer.mlp.experts.limit = 1e9
        elif fault == "softmax before top-k":
            layer.mlp.softmax_first = True
    ours = torch.cat(engine_logits(r, PROMPTS, DECODES[:3]))
    ref = torch.cat(hf_logits(gpt_oss.hf, PROMPTS, DECODES[:3]))
    assert (ours - ref).abs().max() > 100 * ATOL


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("draft", ["near", "self"])
def test_greedy_speculation_with_gpt_oss_draft_equals_target(gpt_oss, near_gpt_oss, draft, async_scheduling):
    prompts = random_prompts([3, 9, 17], seed=11)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    kw = dict(block_size=4, max_model_len=64, max_num_batched_tokens=20)
    alone = [o.token_ids for o in LLM(gpt_oss.path, **kw).generate(prompts, params)]
    assert alone == [hf_greedy(gpt_oss.hf, p, 20) for p in prompts]
    draft_path = near_gpt_oss.path if draft == "near" else gpt_oss.path
    llm = LLM(gpt_oss.path, draft_model=draft_path, num_speculative_tokens=3, async_scheduling=async_scheduling,
              adaptive_draft_length=False, **kw)  # a fixed k: the acceptance is checked
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    stats = llm.spec_stats(outs)
    if draft == "self":
        assert stats.acceptance_rate == 1.0, stats
    else:  # both accepted and rejected drafts took part
        assert 0.0 < stats.acceptance_rate < 1.0, stats


def test_dummy_weights_load(gpt_oss):
    """load_format "dummy" (benchmarks of the real shapes): the experts drawn in transformers' [E, in, out] layout."""
    outs = LLM(gpt_oss.path, load_format="dummy", max_model_len=64, block_size=4).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(outs[0].token_ids) == 3


def test_dummy_weights_load_packed_when_the_config_says_mxfp4(tmp_path):
    """load_format "dummy" of an MXFP4 config (benchmarks of gpt-oss's real shapes): the experts are held packed,
    as a real checkpoint gives them, and they decode to the random weights' scale (finite logits)."""
    cfg = gpt_oss_config()
    cfg.architectures = ["GptOssForCausalLM"]
    cfg.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    cfg.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), load_format="dummy", max_model_len=64, block_size=4)
    experts = llm.executor.target.model.model.layers[0].mlp.experts
    assert experts.packed and experts.gate_up_proj_blocks.dtype == torch.uint8
    w = mxfp4.dequantize(experts.gate_up_proj_blocks, experts.gate_up_proj_scales)
    assert torch.isfinite(w).all() and 0.01 < w.std() < 0.04  # the dummy weights' std 0.02, through e2m1 rounding
    outs = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(outs[0].token_ids) == 3
