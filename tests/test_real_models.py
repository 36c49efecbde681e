"""The real bundled models against HF transformers: greedy tokens (64 new tokens for SmolLM2, 32 for Gemma 3) and
logits along prompt and output."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from engine.runner.step_input import Chunk

pytestmark = pytest.mark.slow

SMOL_PROMPTS = [
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "Explain what a hash map is to a beginner programmer."}],
    [{"role": "user", "content": "List three uses of Python decorators."}],
]
GEMMA_PROMPTS = ["The history of the printing press", "def fibonacci(n):\n", "In a distant galaxy, astronomers found"]


def _hf(path: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare 64 tokens even past an EOS (engine: ignore_eos)
    return model


def _hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    # An explicit mask: SmolLM2's pad id is <|im_end|>, which HF would otherwise mask out of chat prompts.
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def _compare(path: str, prompt_ids: list[list[int]], max_model_len: int, new_tokens: int = 64) -> None:
    hf = _hf(path)
    llm = LLM(model=path, max_model_len=max_model_len)
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    for ids, out in zip(prompt_ids, outs):
        assert out.token_ids == _hf_greedy(hf, ids, new_tokens)
        # Logits along prompt + generated tokens agree within fp32 rounding of a different op order.
        full = ids + out.token_ids
        with torch.no_grad():
            ref_logits = hf(torch.tensor([full])).logits[0]
        kv = llm.engine.target_kv
        kv.allocate("check", 0, len(full))
        tables = [kv.block_table("check", g) for g in range(kv.num_groups)]
        logits = llm.executor.target.forward_chunks([Chunk(full, 0, len(full), tables)])
        kv.free("check")
        torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=1e-3)


def test_smollm2_greedy_and_logits_match_hf(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
           for m in SMOL_PROMPTS]
    _compare(smollm2_path, ids, max_model_len=512)


def test_gemma3_greedy_and_logits_match_hf(gemma3_path):
    tok = AutoTokenizer.from_pretrained(gemma3_path)
    ids = [tok(p)["input_ids"] for p in GEMMA_PROMPTS]
    # 32 new tokens: every HF step projects onto Gemma 3's 262k-token vocabulary in fp32, which made this the
    # suite's slowest model test at 64; the long-context case is test_gemma3_window_shorter_than_sequence's.
    _compare(gemma3_path, ids, max_model_len=512, new_tokens=32)


def test_gemma3_window_shorter_than_sequence(gemma3_path):
    """Gemma 3 270M has a 512-token window; a 600-token context crosses it, prefill and decode both."""
    tok = AutoTokenizer.from_pretrained(gemma3_path)
    text = " ".join(f"item {i}: the value is {i * 7 % 13}." for i in range(60))
    ids = tok(text)["input_ids"][:560]
    assert len(ids) == 560
    hf = _hf(gemma3_path)
    llm = LLM(model=gemma3_path, max_model_len=1024)
    out = llm.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert out.token_ids == _hf_greedy(hf, ids, 16)


def test_smollm2_text_and_chat(smollm2_path):
    llm = LLM(model="smollm2-135m-instruct", max_model_len=512)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32))
    assert "Paris" in out.text and out.finish_reason == "stop"
    stopped = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(max_tokens=32, stop=["Paris"]))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Paris" and "Paris" not in stopped.text
