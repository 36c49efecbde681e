"""The input norm, qkv product and attention's prologue in one kernel on CUDA (see tests/test_norm_qkv_rope_store.py):
against its torch reference on the Qwen3-0.6B and 8B shapes, the split of K summed the same way every run and in
graph replays, and greedy tokens with EngineConfig.fused_qkv_prologue on equal to it off."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from test_norm_qkv_rope_store import check_norm_qkv_rope_store, check_rotary_half_split, rotary_tables

from engine import LLM, SamplingParams
from engine.kernels import norm_qkv_rope_store as nq

pytestmark = pytest.mark.gpu

# (q heads, kv heads, head_dim, hidden) of Qwen3-0.6B and Qwen3-8B
QWEN3_SHAPES = ((16, 8, 128, 1024), (32, 8, 128, 4096))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_qkv_rope_store_matches_reference_on_qwen3_shapes(dtype):
    """The default config (K split for about two programs per SM), one program per head (SPLIT_K=1) and an odd
    split with a narrower K tile, at 1, 2 and 4 rows; plus the small shapes of the CPU test."""
    check_norm_qkv_rope_store("cuda", dtype, shapes=QWEN3_SHAPES, rows=(1, 2, 4),
                              configs=(None, dict(SPLIT_K=1), dict(SPLIT_K=3, BLOCK_K=32)))
    check_norm_qkv_rope_store("cuda", dtype)


def test_wrong_rotary_half_split_is_caught_on_cuda():
    check_rotary_half_split("cuda")


@pytest.mark.parametrize("shape", QWEN3_SHAPES)
def test_split_k_is_deterministic_and_graph_safe(shape):
    """bfloat16, one row: the last program of each head sums the partials in slice order, so every launch gives
    the same bits whichever program finishes last; graph replays give them too, and leave the counters at zero."""
    hq, hk, d, hidden = shape
    g = torch.Generator().manual_seed(2)

    def rand(*s: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*s, generator=g) * scale).to("cuda", torch.bfloat16)

    x, res, nw = rand(1, hidden, scale=2.0), rand(1, hidden), rand(hidden, scale=0.1) + 1.0
    w = rand((hq + 2 * hk) * d, hidden, scale=hidden ** -0.5)
    qw, kw = rand(d, scale=0.2) + 1.0, rand(d, scale=0.2) + 1.0
    cos, sin = rotary_tables(d, 64, "cuda")
    cache = torch.zeros(2, 4, 16, hk, d, device="cuda", dtype=torch.bfloat16)
    pos, slots = torch.tensor([37], device="cuda"), torch.tensor([21], device="cuda")
    cfg = nq._config(1, hq + 2 * hk, d // 2, hidden, x.device)
    assert cfg["SPLIT_K"] > 1

    def run() -> torch.Tensor:
        q, _ = nq.norm_qkv_rope_store(x, res, nw, 1e-6, 0.0, w, None, hq, hk, pos, cos, sin, cache[0], cache[1],
                                      slots, qw, kw, 1e-6, 0.0)
        return q

    first = run()
    kv = cache.clone()
    for _ in range(50):
        assert torch.equal(run(), first) and torch.equal(cache, kv)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(20):
        cache.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first) and torch.equal(cache, kv)
    assert not nq._COUNTERS[x.device].any()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_fused_qkv_prologue_greedy_equals_unfused(tiny_models, tiny_drafts, family):
    """float32, with a draft: graph replays with fused_qkv_prologue (single rows, and up to 4 rows; K split or
    not) give the tokens of the separate prologue kernel, eager and in graphs."""
    target = tiny_models[family]
    draft = tiny_drafts[{"llama": "llama-1l", "qwen3": "qwen3-1l", "gemma3": "gemma3-2l"}[family]]
    prompts = random_prompts([5, 17, 30], seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = {}
    default = nq._config
    for name, fused, rows, eager, split in (("eager", False, 1, True, None), ("graphs", False, 4, False, None),
                                            ("fused", True, 1, False, None), ("fused-4", True, 4, False, None),
                                            ("fused-split", True, 4, False, 2)):
        nq._config = (lambda *a, split=split: {**default(*a), "SPLIT_K": split, "BLOCK_K": 16}) if split else default
        try:
            llm = LLM(model=target.path, draft_model=draft.path, num_speculative_tokens=3, device="cuda",
                      dtype="float32", enforce_eager=eager, max_model_len=256, block_size=16, num_kv_blocks=256,
                      max_num_seqs=4, cuda_graph_batch_sizes=(1, 2, 4), small_m_rows=rows, fused_qkv_prologue=fused)
            runs[name] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            nq._config = default
    for name, tokens in runs.items():
        assert tokens == runs["eager"], name
