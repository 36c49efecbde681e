"""The few-row products on FP8 weights on CUDA (the checks of tests/test_small_m_fp8.py) at a Qwen3-8B layer's
shapes in 128 x 128 blocks, and an FP8 model's steps through them replayed from CUDA graphs equal to eager steps."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from test_small_m_fp8 import check_small_m_fp8

from engine import LLM, SamplingParams
from engine.kernels.small_m import tiles as small_m_tiles

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_m_fp8_matches_references_on_cuda(dtype):
    check_small_m_fp8("cuda", dtype, rows=(1, 2, 4, 5, 17, 64), shapes=((96, 40), (4096, 6144), (12288, 4096)),
                      blocks=(None, (128, 128)))


def test_fp8_model_graphs_equal_eager_through_the_folded_products(tiny_models, monkeypatch):
    """A bf16 Qwen3 target quantized to FP8 at load (a scale a row) beside an FP8 draft, this GPU model listed as
    folding FP8 weights: the folded products run (the layers' small_m_rows set), and greedy output replayed from
    CUDA graphs equals eager steps', with and without speculation. Not listed, the layers stay unfolded."""
    monkeypatch.setattr(small_m_tiles, "FP8_FOLDED_MEASURED", {small_m_tiles.device_name(torch.device("cuda"))})
    target = tiny_models["qwen3"]
    kw = dict(device="cuda", quantization="fp8", max_model_len=256, block_size=16, num_kv_blocks=256,
              max_num_seqs=4, cuda_graph_batch_sizes=(1, 2, 4))
    prompts = random_prompts([5, 17, 40], seed=11)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        for spec in (False, True):
            extra = dict(draft_model=target.path, draft_quantization="fp8", num_speculative_tokens=3,
                         adaptive_draft_length=False) if spec else {}
            llm = LLM(model=target.path, enforce_eager=eager, **kw, **extra)
            assert llm.executor.target.model.model.layers[0].small_m_rows > 0
            outs[eager, spec] = [o.token_ids for o in llm.generate(prompts, params)]
            del llm
            torch.cuda.empty_cache()
    assert outs[False, False] == outs[True, False]
    assert outs[False, True] == outs[True, True]
    monkeypatch.setattr(small_m_tiles, "FP8_FOLDED_MEASURED", set())
    llm = LLM(model=target.path, **kw)
    assert llm.executor.target.model.model.layers[0].small_m_rows == 0
