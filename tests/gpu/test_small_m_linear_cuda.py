"""The few-row products with folded norms, activation and residual adds on CUDA against their torch references
(see tests/test_small_m_linear.py), and graph replays through them equal to eager steps without them."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from test_small_m_linear import check_small_m_linear

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_m_linear_matches_references_on_cuda(dtype):
    check_small_m_linear("cuda", dtype, rows=(1, 5), shapes=((64, 40), (3072, 1024)))


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_small_m_graphs_equal_eager_without_them(tiny_models, tiny_drafts, family):
    """float32, with a draft: graph replays through the few-row kernels (the default, single rows; and decode,
    verify and draft steps up to 16 rows) give the tokens of eager steps on cuBLAS and the separate kernels."""
    target = tiny_models[family]
    draft = tiny_drafts["gemma3-2l" if family == "gemma3" else "qwen3-1l"]
    prompts = random_prompts([5, 17, 30], seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = {}
    for rows, eager in ((0, True), (1, False), (16, False)):
        llm = LLM(model=target.path, draft_model=draft.path, num_speculative_tokens=3, device="cuda",
                  dtype="float32", enforce_eager=eager, max_model_len=256, block_size=16, num_kv_blocks=256,
                  max_num_seqs=4, cuda_graph_batch_sizes=(1, 2, 4), small_m_rows=rows)
        runs[rows] = [o.token_ids for o in llm.generate(prompts, params)]
    assert runs[1] == runs[0] and runs[16] == runs[0]
