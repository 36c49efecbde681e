"""The fused decode attention kernel on CUDA (see tests/test_decode_attention.py): bf16 and fp32 against the unfused
kernels' references at the splits the GPU picks itself, in a CUDA graph replayed several times (the split counters
must be back at zero after every replay), and one-token engine steps with and without it."""

from __future__ import annotations

import pytest
import torch
from kernel_support import check_decode_attention, decode_case

from engine.kernels import decode_attention
from engine.kernels.paged_attention import kernel_variant

pytestmark = pytest.mark.gpu

# (heads, KV heads, head_dim, norm, window): Qwen3-0.6B, Qwen3-8B, Gemma 3 270M's sliding and full layers, Llama.
SHAPES = [(16, 8, 128, "llama", None), (32, 8, 128, "llama", None), (4, 1, 256, "gemma", 512),
          (4, 1, 256, "gemma", None), (32, 8, 64, None, None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_attention_matches_reference_on_cuda(shape, dtype):
    heads, kv_heads, head_dim, norm, window = shape
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for lens in (([1], [700]), ([1, 0, 1, 1, 1], [1030, 0, 63, 0, 300]), ([1] * 24, list(range(5, 2400, 100)))):
        case = decode_case(heads, kv_heads, head_dim, 16, *lens, window, dtype, norm, device="cuda", seed=len(lens[0]))
        for splits in (None, 1, 16):  # None: what the kernel picks on this GPU (split at small batches)
            check_decode_attention(case, splits=splits, **tol)
    _, _, auto = kernel_variant(1, 1, heads // kv_heads, kv_heads, head_dim, 2048, torch.device("cuda"))
    assert auto > 1, "a batch of one should split its keys on a GPU: the combine path went untested"


def test_decode_attention_in_a_replayed_cuda_graph():
    """Captured once and replayed with new lengths: outputs follow every replay and the counters stay at zero."""
    case = decode_case(16, 8, 128, 16, [1, 1, 1], [200, 40, 600], None, torch.bfloat16, "llama", device="cuda")
    a = case.attention
    kv = a.kv_cache.clone()
    out = torch.zeros(case.qkv.shape[0], 16, 128, dtype=torch.bfloat16, device="cuda")
    counters = torch.zeros(3 * 8, dtype=torch.int32, device="cuda")
    args = case.args(out, kv, counters)
    decode_attention.decode_attention(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention.decode_attention(*args)
    for step in range(4):
        a.seq_lens += 1  # one more key each step, written where the next position's slot points
        case.positions[:3] += 1
        for i in range(3):
            pos = int(a.seq_lens[i]) - 1
            case.slot_mapping[i] = int(a.block_table[i, pos // 16]) * 16 + pos % 16
        case.qkv.normal_()
        kv_ref, ref = kv.clone(), torch.zeros_like(out)
        decode_attention.decode_attention_ref(*case.args(ref, kv_ref, torch.zeros_like(counters)))
        graph.replay()
        torch.cuda.synchronize()
        assert int(counters.abs().sum()) == 0, f"counters left set after replay {step}"
        torch.testing.assert_close(out[:3].float(), ref[:3].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(kv.float(), kv_ref.float(), atol=2e-2, rtol=2e-2)


def test_one_token_steps_fused_equal_unfused(tiny_models):
    """Greedy tokens of a graph-captured engine equal with the fused decode kernel and with the unfused kernels,
    target alone (Gemma 3 style: two KV-cache groups with a sliding window, per-head norms with an offset)."""
    from conftest import random_prompts

    from engine import LLM, SamplingParams

    prompts = random_prompts([5, 30, 17, 60], seed=4)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    runs = {}
    for fused in (False, True):
        decode_attention.set_decode_fusion(fused)
        try:
            llm = LLM(model=tiny_models["gemma3"].path, device="cuda", dtype="float32", max_model_len=256,
                      block_size=16, num_kv_blocks=256, max_num_seqs=4, cuda_graph_batch_sizes=(1, 2, 4))
            runs[fused] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            decode_attention.set_decode_fusion(True)
    assert runs[True] == runs[False]
