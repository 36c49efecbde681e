"""Every model family against HF transformers: logits at every prefill and decode position, and greedy
generation over batches of mixed lengths (sliding windows shorter than prompt + output)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS, hf_greedy, random_prompts
from moe_support import engine_logits, hf_logits, runner

from engine import LLM, SamplingParams

FAMILIES = list(TINY_CONFIGS)
# fp32 on CPU: the same math in a different order (fused QKV, paged gather, SDPA); differences stay
# at float rounding, far below the gaps between competing logits.
ATOL, RTOL = 2e-4, 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_prefill_and_decode(tiny_models, family):
    """Logits at every position of every prompt (one batched prefill), then at each of 12 single-token decode
    steps (past the sliding windows)."""
    m = tiny_models[family]
    prompts = random_prompts([5, 11, 18], seed=3)
    decodes = [[int(torch.randint(3, 100, (1,))) for _ in prompts] for _ in range(12)]
    ours = engine_logits(runner(m.path), prompts, decodes)
    for logits, ref in zip(ours, hf_logits(m.hf, prompts, decodes), strict=True):
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate(tiny_models, family):
    m = tiny_models[family]
    prompts = random_prompts([3, 9, 17, 6], seed=7)
    llm = LLM(model=m.path, max_model_len=256, block_size=4, num_kv_blocks=128)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(m.hf, p, 24), f"{family}: prompt of {len(p)} tokens diverged"
        assert o.finish_reason == "length"
    window = getattr(m.config, "sliding_window", None)
    if family in ("mistral", "gemma3"):
        assert window is not None and window < 3 + 24  # the window really is shorter than the sequence


def test_chunked_prefill_matches_unchunked(tiny_models):
    m = tiny_models["gemma3"]
    prompts = random_prompts([37, 5, 22], seed=11)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    whole = LLM(model=m.path, max_model_len=256, block_size=4, num_kv_blocks=128).generate(prompts, params)
    chunked = LLM(model=m.path, max_model_len=256, block_size=4, num_kv_blocks=128,
                  max_num_batched_tokens=7).generate(prompts, params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    assert [o.token_ids for o in whole] == [hf_greedy(m.hf, p, 10) for p in prompts]


def test_weights_that_do_not_fit_the_config_are_rejected(tiny_models, tmp_path):
    import json
    import shutil
    src = tiny_models["llama"].path
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["intermediate_size"] = 96  # the checkpoint's MLP is 128 wide
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not fit"):
        LLM(model=str(dst), max_model_len=64)
    cfg["intermediate_size"] = 128
    cfg["num_hidden_layers"] = 5  # layers 3 and 4 are not in the checkpoint
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        LLM(model=str(dst), max_model_len=64)


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(model=str(tmp_path / "gpt2"))
