"""The Triton kernels compiled for CUDA against their torch references: a larger sweep than the CPU tests
(tests/test_kernels.py), in bf16 and fp32, plus replays of CUDA graphs whose inputs change in place."""

from __future__ import annotations

import pytest
import torch
from kernel_support import attention_case, poison_outside_window, rejection_case

from engine.kernels.attention.kv_store import store_kv, store_kv_ref
from engine.kernels.attention.paged import paged_attention, paged_attention_ref
from engine.kernels.speculation.rejection import rejection_sample_from_noise
from engine.speculation import rejection_sampler

pytestmark = pytest.mark.gpu
# fp32: products in IEEE fp32 (no TF32), only the summation order differs from the reference. bf16: the
# kernel rounds softmax probabilities to bf16 before P @ V, and the output is bf16 (relative step 2^-8).
TOLERANCE = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# (num_heads, num_kv_heads, head_dim): Qwen3-8B, Gemma 3 270M, a GQA ratio of 3, and no grouping.
SHAPES = [(32, 8, 128), (4, 1, 256), (12, 4, 64), (8, 8, 128)]


def _batches(seed: int) -> dict[str, tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    ctx = lambda n: torch.randint(0, 2000, (n,), generator=g).tolist()  # noqa: E731
    verify_lens = torch.randint(1, 9, (8,), generator=g).tolist()
    return {
        "decode32": ([1] * 30 + [0, 1], ctx(32)),
        "verify8": (verify_lens, ctx(8)),
        "prefill300": ([300, 0, 300, 1, 5], [0, 0, 1500, 700, 33]),
    }


def _check(case, dtype) -> None:
    sentinel = 7.0
    ref = torch.full_like(case.query, sentinel)
    out = torch.full_like(case.query, sentinel)
    paged_attention_ref(*case.args(ref))
    kv = poison_outside_window(case) if case.sliding_window is not None else case.kv_cache
    paged_attention(*case.args(out, kv))
    n = case.num_valid_tokens
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), **TOLERANCE[dtype])
    pad = out[n:]
    assert bool(((pad == sentinel) | (pad == 0)).all())


@pytest.mark.parametrize("dtype,block_size", [(torch.bfloat16, 16), (torch.bfloat16, 32), (torch.float32, 16)],
                         ids=["bf16-b16", "bf16-b32", "fp32-b16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_paged_attention_sweep(dtype, block_size, shape):
    num_heads, num_kv_heads, head_dim = shape
    for i, (name, (q_lens, ctx)) in enumerate(_batches(block_size + head_dim).items()):
        for window in (None, 512, 100):
            case = attention_case(num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx, window, dtype,
                                  device="cuda", seed=i)
            try:
                _check(case, dtype)
            except AssertionError as e:
                raise AssertionError(f"{name}, window {window}: {e}") from e


def _copy_case(case, q: torch.Tensor, kv: torch.Tensor, qsl: torch.Tensor, seq_lens: torch.Tensor,
               table: torch.Tensor) -> None:
    """Write an attention case into the fixed buffers a captured graph reads (caches and tables zero past it)."""
    kv.zero_()
    kv[:, :case.kv_cache.shape[1]].copy_(case.kv_cache)
    table.zero_()
    table[:, :case.block_table.shape[1]].copy_(case.block_table)
    q.copy_(case.query)
    qsl.copy_(case.query_start_loc)
    seq_lens.copy_(case.seq_lens)


def test_paged_attention_in_cuda_graph_follows_inputs_changed_in_place():
    """Captured once over fixed buffers (the grid comes from max_query_len alone); replays after other
    lengths, block tables, keys and queries were copied into those buffers must equal the reference."""
    dtype, max_q, num_tokens = torch.bfloat16, 5, 12
    shape = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
    kv = torch.zeros(2, 200, 16, 8, 128, dtype=dtype, device="cuda")
    q = torch.zeros(num_tokens, 32, 128, dtype=dtype, device="cuda")
    out = torch.zeros_like(q)
    qsl = torch.zeros(5, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(4, dtype=torch.int32, device="cuda")
    table = torch.zeros(4, 64, dtype=torch.int32, device="cuda")

    def load(q_lens: list[int], ctx: list[int], seed: int) -> None:
        case = attention_case(**shape, query_lens=q_lens, context_lens=ctx, sliding_window=None, dtype=dtype,
                              device="cuda", seed=seed, padding_tokens=num_tokens - sum(q_lens))
        _copy_case(case, q, kv, qsl, seq_lens, table)

    args = (q, kv[0], kv[1], out, qsl, seq_lens, table, 128 ** -0.5, None, max_q)
    load([5, 1, 3, 0], [10, 200, 47, 0], seed=1)
    paged_attention(*args)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*args)
    for seed, (q_lens, ctx) in enumerate([([1, 4, 2, 5], [300, 17, 64, 90]), ([2, 0, 1, 1], [15, 0, 511, 640])]):
        load(q_lens, ctx, seed=10 + seed)
        out.zero_()
        graph.replay()
        ref = torch.zeros_like(q)
        paged_attention_ref(q, kv[0], kv[1], ref, qsl, seq_lens, table, 128 ** -0.5, None, max_q)
        n = sum(q_lens)
        torch.testing.assert_close(out[:n].float(), ref[:n].float(), **TOLERANCE[dtype])
        assert float(out[:n].abs().sum()) > 0


def test_wide_split_grid_in_cuda_graph_uses_each_requests_own_splits():
    """Batch 1 of an 8-KV-head model gets a wide grid (more than 16 splits, sized for a 4096-key block table). Replays
    over 3000, 40, 1500 and again 40 keys use 47, 1, 24 and 1 of its splits: each must equal the reference, the short
    ones reading none of the partial results a longer replay left in the workspace."""
    from engine.kernels.attention.launch import kernel_variant

    dtype, shape = torch.bfloat16, dict(num_heads=16, num_kv_heads=8, head_dim=128, block_size=16)
    kv = torch.zeros(2, 300, 16, 8, 128, dtype=dtype, device="cuda")
    q = torch.zeros(1, 16, 128, dtype=dtype, device="cuda")
    out = torch.zeros_like(q)
    qsl = torch.zeros(2, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(1, dtype=torch.int32, device="cuda")
    table = torch.zeros(1, 256, dtype=torch.int32, device="cuda")
    splits = kernel_variant(1, 1, 2, 8, 128, 256 * 16, q.device, kv_bytes=q.element_size())[2]
    assert splits > 16, splits

    def load(ctx: int, seed: int) -> None:
        case = attention_case(**shape, query_lens=[1], context_lens=[ctx], sliding_window=None, dtype=dtype,
                              device="cuda", seed=seed, padding_tokens=0)
        _copy_case(case, q, kv, qsl, seq_lens, table)

    args = (q, kv[0], kv[1], out, qsl, seq_lens, table, 128 ** -0.5, None, 1)
    load(3000, seed=1)
    paged_attention(*args)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*args)
    for seed, ctx in enumerate([2999, 39, 1499, 39]):
        load(ctx, seed=10 + seed)
        out.zero_()
        graph.replay()
        ref = torch.zeros_like(q)
        paged_attention_ref(*args[:3], ref, *args[4:])
        torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[dtype])
        assert float(out.abs().sum()) > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("batch,context", [(1, 20000), (8, 10000)], ids=["b1-20k", "b8-10k"])
@pytest.mark.parametrize("shape", [(16, 8, 128), (4, 1, 256), (9, 3, 64)], ids=lambda s: "x".join(map(str, s)))
def test_long_context_launches_match_reference(shape, batch, context, dtype):
    """Decode steps at long context take the launches measured for each head dim (attention_launch: wide splits, 128-
    key tiles at head dims 64 and 128, 64-key tiles with 8 warps or 32 with 2 at head dim 256; float32 caches the
    tiles their shared memory holds): each against the reference."""
    from engine.kernels.attention.launch import kernel_variant

    num_heads, num_kv_heads, head_dim = shape
    case = attention_case(num_heads, num_kv_heads, head_dim, 16, [1] * batch, [context - 1 - i for i in range(batch)],
                          None, dtype, device="cuda", seed=batch + head_dim, padding_tokens=0)
    launch = kernel_variant(batch, 1, num_heads // num_kv_heads, num_kv_heads, head_dim,
                            case.block_table.shape[1] * 16, case.query.device, kv_bytes=dtype.itemsize)
    assert launch.splits > 1, launch
    try:
        _check(case, dtype)
    except AssertionError as e:
        raise AssertionError(f"{launch}: {e}") from e


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_sweep_and_graph_replay(dtype, slot_dtype):
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 300, 16, 8, 128, 512
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype).cuda()
    want = kv.clone()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=g)[:50]] = -1
    slots = slots.to(slot_dtype).cuda()
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).cuda()
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).cuda()
    store_kv(key, value, kv[0], kv[1], slots)
    store_kv_ref(key, value, want[0], want[1], slots)
    assert torch.equal(kv, want)

    # In a graph: new slots (other padding) and new values, replayed.
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(key, value, kv[0], kv[1], slots)
    slots.copy_(torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(slot_dtype).cuda())
    slots[:7] = -1
    key.normal_()
    value.normal_()
    graph.replay()
    store_kv_ref(key, value, want[0], want[1], slots)
    assert torch.equal(kv, want)


@pytest.mark.parametrize("mode", ["strict", "probabilistic", "synthetic"])
@pytest.mark.parametrize("noise", [False, True], ids=["greedy", "random"])
@pytest.mark.parametrize("vocab", [151936, 262144, 1000])
def test_rejection_bit_identical_on_cuda(mode, noise, vocab):
    accepted = 0
    for max_k in (0, 1, 4, 7):
        case = rejection_case(mode, 32, max_k, vocab, noise, seed=max_k, device="cuda")
        want = rejection_sampler.rejection_sample_from_noise(*case.args())
        got = rejection_sample_from_noise(*case.args())
        assert torch.equal(got.output_token_ids, want.output_token_ids), f"max_k {max_k}"
        assert torch.equal(got.num_accepted, want.num_accepted)
        assert torch.equal(got.num_output, want.num_output)
        accepted += int(want.num_accepted.sum())
    assert accepted > 0


@pytest.mark.parametrize("mode", ["strict", "synthetic"])
def test_rejection_on_raw_bf16_logits_and_ties(mode):
    case = rejection_case(mode, 16, 4, 50000, noise=False, raw_logits=True, device="cuda")
    case.target_probs = case.target_probs.bfloat16()  # many exact ties after rounding
    want = rejection_sampler.rejection_sample_from_noise(*case.args())
    got = rejection_sample_from_noise(*case.args())
    assert torch.equal(got.output_token_ids, want.output_token_ids)
