"""MXFP4 in the gpt-oss release format: the unpacking against transformers' own dequantization, quantization round
trips, bad input refused, and a packed GPT-OSS checkpoint (experts' *_blocks / *_scales, quantization_config mxfp4)
run from its packed bytes giving the logits of its dequantized copy and of HF on that copy."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from moe_support import (
    ATOL,
    RELEASE_NOT_CONVERTED,
    RTOL,
    decode_tokens,
    engine_logits,
    gpt_oss_config,
    hf_logits,
    make_model,
    runner,
    save_packed_copy,
)
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine.models.moe import FusedExperts
from engine.quantization import mxfp4

pytestmark = pytest.mark.usefixtures("one_thread")

def _random_packed(*shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(127 - 8, 127 + 8, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_matches_transformers():
    blocks, scales = _random_packed(3, 40, 4)  # [E, out, in / 32, 16]
    ours = mxfp4.dequantize(blocks, scales, torch.float32)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]: gpt-oss's layout
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.bfloat16),
                       convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).transpose(1, 2))


def test_low_nibble_first():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x2 | (0xF << 4)  # value 0: nibble 2 (1.0); value 1: nibble 15 (-6.0)
    out = mxfp4.dequantize(blocks, torch.tensor([128], dtype=torch.uint8))  # scale 2
    assert out[:2].tolist() == [2.0, -12.0] and not out[2:].any()


def test_quantize_round_trip():
    blocks, scales = _random_packed(5, 2, seed=1)
    w = mxfp4.dequantize(blocks, scales)
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(w)), w)  # representable values come back exactly
    x = torch.randn(7, 64)
    q = mxfp4.dequantize(*mxfp4.quantize(x))
    # the nearest e2m1 value, within a block's scale (half the widest step, 2) below 6 x scale, and values in
    # [6, 8) x scale clipped to 6 x scale: an error under 2 x scale
    scale = 2.0 ** (torch.floor(torch.log2(x.abs().unflatten(-1, (-1, 32)).amax(-1))) - 2)
    err = (q - x).abs().unflatten(-1, (-1, 32))
    scaled = x.abs().unflatten(-1, (-1, 32)) / scale[..., None]
    assert (err[scaled <= 6] <= scale[..., None].expand_as(err)[scaled <= 6] + 1e-6).all()
    assert (err <= 2 * scale[..., None] + 1e-6).all()
    assert (q - x).abs().mean() < 0.2 * x.abs().mean()  # 4 bits: about a tenth on Gaussian weights


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.int32), torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[\.\.\., G, 16\]"):
        mxfp4.dequantize(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.zeros(4, 48))


def test_modules_to_not_convert():
    cfg = gpt_oss_config(quantization_config={"quant_method": "mxfp4",
                                              "modules_to_not_convert": list(RELEASE_NOT_CONVERTED)})
    assert mxfp4.quantized(cfg, "model.layers.3.mlp.experts")
    assert not mxfp4.quantized(cfg, "model.layers.3.mlp.router")
    assert not mxfp4.quantized(cfg, "model.layers.0.self_attn.q_proj")
    cfg.quantization_config["modules_to_not_convert"].append("model.layers.1.mlp")
    assert not mxfp4.quantized(cfg, "model.layers.1.mlp.experts")
    assert not mxfp4.quantized(gpt_oss_config(), "model.layers.3.mlp.experts")


def test_packed_checkpoint_equals_its_dequantized_copy(tmp_path):
    """The release layout: gate_up_proj_blocks [E, 2I, H / 32, 16] (out x in, gate and up interleaved as in the
    unquantized [E, H, 2I]) and down_proj_blocks [E, H, I / 32, 16]; biases unquantized."""
    m = make_model(tmp_path, "source", gpt_oss_config())
    packed, dequantized = save_packed_copy(m, tmp_path)

    prompts, decodes = random_prompts([5, 11, 18], seed=3), decode_tokens(6, 3)
    r_packed, r_copy = runner(packed), runner(dequantized)
    experts = [mod for mod in r_packed.model.modules() if isinstance(mod, FusedExperts)]
    assert len(experts) == 3 and all(e.packed for e in experts)
    # kept packed: the experts hold their bytes and scales only (plus the small float biases)
    for e in experts:
        assert {n for n, p in e.named_parameters() if p.dtype == torch.uint8} == {
            "gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"}
        assert not hasattr(e, "gate_up_proj") and not hasattr(e, "down_proj")
    ours = engine_logits(r_packed, prompts, decodes)
    copy = engine_logits(r_copy, prompts, decodes)
    ref = hf_logits(m.hf, prompts, decodes)
    for a, b, c in zip(ours, copy, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(a, c, atol=ATOL, rtol=RTOL)
    # the quantization was not a no-op: the source model's logits differ
    source = runner(str(tmp_path / "source"))
    assert (torch.cat(engine_logits(source, prompts, decodes[:1])) - torch.cat(ours[:2])).abs().max() > 100 * ATOL


def test_packed_checkpoint_of_the_wrong_shape_is_refused(tmp_path):
    cfg = gpt_oss_config(num_hidden_layers=1, layer_types=["full_attention"], intermediate_size=48,
                         architectures=["GptOssForCausalLM"],
                         quantization_config={"quant_method": "mxfp4",
                                              "modules_to_not_convert": list(RELEASE_NOT_CONVERTED)})
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="multiples of 32"):
        runner(str(tmp_path))
