"""EAGLE-3 heads on CUDA, eagerly (the kernel path: Triton attention, the few-row products): fp32 greedy with the head
equals HF's greedy on the same GPU for a Llama and a Qwen3 target, in both checkpoint formats; the graphed path is
refused with a clear error until the head's k-step loop is captured."""

from __future__ import annotations

import pytest
from conftest import hf_greedy_cuda, random_prompts
from eagle3_support import random_head, write_flat, write_speculators

from engine import LLM, SamplingParams
from engine.speculation.eagle3_proposer import Eagle3Proposer

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=256, max_num_seqs=8, device="cuda", dtype="float32")


@pytest.mark.parametrize("family,fmt", [("llama", "flat"), ("qwen3", "speculators")])
def test_eager_head_greedy_matches_hf_on_cuda(tiny_models, tmp_path, family, fmt):
    m = tiny_models[family]
    w = random_head(m.config, seed=1, layer_type="qwen3" if fmt == "speculators" else "llama")
    head = write_flat(w, tmp_path / "head") if fmt == "flat" else write_speculators(w, tmp_path / "head")
    llm = LLM(m.path, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3},
              enforce_eager=True, adaptive_draft_length=False, **KW)
    assert isinstance(llm.executor.proposer, Eagle3Proposer)
    prompts = random_prompts([5, 17, 40], seed=1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy_cuda(m.hf, p, 24)
    assert llm.spec_stats(outs).num_draft_tokens > 0


def test_graphed_head_refused(tiny_models, tmp_path):
    m = tiny_models["llama"]
    head = write_flat(random_head(m.config, seed=1), tmp_path / "head")
    with pytest.raises(ValueError, match="EAGLE-3 heads run eagerly so far"):
        LLM(m.path, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3}, **KW)
