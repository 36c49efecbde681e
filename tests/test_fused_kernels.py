"""The fused elementwise kernels of the model layers (RMSNorm with and without the residual add, act(gate) * up,
rotary embedding, attention's prologue of q/k norm + rotary + KV store) and a greedy step's argmax against their
torch references, on CPU
under Triton's interpreter (in child processes, tests/interpreter_children.py: the interpreter must be switched on
before triton is first imported). CUDA runs them in tests/gpu/test_fused_kernels_cuda.py."""

from __future__ import annotations

import pytest
import torch
from interpreter_children import assert_pytest_children_pass, split_by

from engine.kernels import activation, rms_norm
from engine.kernels.attention import qk_norm_rope_store, rotary
from engine.kernels.speculation import argmax, draft_advance
from engine.kernels.triton_compat import HAS_TRITON, interpreting

if not HAS_TRITON:
    pytest.skip("triton is not installed (the `test` extra installs it on Linux)", allow_module_level=True)

interpreted = pytest.mark.skipif(not interpreting(), reason="runs in the TRITON_INTERPRET=1 child process")


@pytest.mark.skipif(interpreting(), reason="already under the interpreter")
def test_fused_kernels_under_interpreter():
    # Two children side by side (tests/interpreter_children.py), of about equal work: the float16 kernel checks, and
    # the float32 ones with the rest.
    assert_pytest_children_pass(__file__, split_by("fused_kernels_match_references and dtype1"))


def check_fused_kernels(device: str, dtype: torch.dtype) -> None:
    """Every fused kernel against its reference; shared with the CUDA test."""
    g = torch.Generator().manual_seed(0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    for rows, dim in ((1, 64), (5, 576), (3, 1000)):
        x, res = rand(rows, dim, scale=3.0), rand(rows, dim)
        for offset in (0.0, 1.0):
            w = rand(dim) * 0.1 + (0.0 if offset else 1.0)
            torch.testing.assert_close(rms_norm.rms_norm(x, w, 1e-6, offset),
                                       rms_norm.rms_norm_ref(x, w, 1e-6, offset), **tol)
            out, s = rms_norm.add_rms_norm(x, res, w, 1e-6, offset)
            ref_out, ref_s = rms_norm.add_rms_norm_ref(x, res, w, 1e-6, offset)
            assert torch.equal(s, ref_s)  # the residual sum is rounded exactly as torch's add
            torch.testing.assert_close(out, ref_out, **tol)
        # per-head norms (Qwen3 / Gemma 3 q_norm) on a strided [tokens, heads, head_dim] view
        qkv = rand(rows, 3 * dim)
        heads = qkv[:, :dim].reshape(rows, dim // 8, 8) if dim % 8 == 0 else qkv[:, :dim].reshape(rows, 1, dim)
        w = rand(heads.shape[-1]) + 1.0
        torch.testing.assert_close(rms_norm.rms_norm(heads, w, 1e-6), rms_norm.rms_norm_ref(heads, w, 1e-6), **tol)
    # Greedy tokens: exact; ties (rounded copies of one value) go to the first column, a row of -inf to column 0.
    for rows, n in ((1, 32000), (3, 2049), (2, 100)):
        x = rand(rows, n, scale=3.0)
        x[:, n // 3] = x[:, n - 1] = x.max() + 1  # a tie across slices: the first wins
        if rows > 1:
            x[-1] = float("-inf")
        assert torch.equal(argmax.argmax_rows(x), argmax.argmax_rows_ref(x))
        # A NaN (random weights overflow) wins, as in torch: never a column past the row.
        x[0, n // 2] = float("nan")
        assert torch.equal(argmax.argmax_rows(x), argmax.argmax_rows_ref(x))
    for act in activation.ACTIVATIONS:
        for rows, inter in ((1, 64), (4, 1536), (2, 1000)):
            x = rand(rows, 2 * inter, scale=3.0)
            torch.testing.assert_close(activation.act_and_mul(x, act), activation.act_and_mul_ref(x, act), **tol)
    positions = torch.tensor([0, 5, 17, 511, 3], device=device)
    for hq, hk, d in ((4, 2, 16), (9, 3, 64), (16, 4, 128), (8, 1, 256)):
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(512).float(), inv)
        cos, sin = freqs.cos().to(device), freqs.sin().to(device)
        qkv = rand(5, (hq + 2 * hk) * d)
        q = qkv[:, :hq * d].view(5, hq, d)  # strided, as split from a fused qkv projection
        k = qkv[:, hq * d:(hq + hk) * d].view(5, hk, d)
        got, ref = rotary.rotary_embedding(positions, q, k, cos, sin), rotary.rotary_embedding_ref(positions, q, k,
                                                                                                   cos, sin)
        torch.testing.assert_close(got[0], ref[0], **tol)
        torch.testing.assert_close(got[1], ref[1], **tol)
        check_qk_norm_rope_store(qkv, hq, hk, positions, cos, sin, rand, tol)


def check_draft_advance(device: str) -> None:
    """The draft loop's input rebuild against its reference: two KV-cache groups, rows that stop drafting, a
    padding row, and positions that open a new block."""
    g = torch.Generator().manual_seed(1)
    b, max_k, groups, blocks, bs = 5, 4, 2, 6, 4
    num_draft = torch.tensor([4, 1, 3, 4, 0], device=device)
    seq_lens = torch.tensor([7, 12, 3, 16, 0], dtype=torch.int32, device=device)  # 7 -> 8 opens block 2, ...
    tables = (torch.randperm(groups * 8 * blocks, generator=g)[:groups * 8 * blocks].reshape(groups, 8, blocks)
              .to(torch.int32).to(device))
    for step in (0, 2, 3):
        bufs = [dict(tok=torch.randint(0, 1000, (b,), generator=g).to(device),
                     ids=torch.zeros(8, max_k, dtype=torch.int64, device=device),
                     step_idx=torch.tensor([step], device=device), num_draft=num_draft.clone(),
                     input_ids=torch.full((8,), 9, device=device), positions=torch.full((8,), 9, device=device),
                     seq_lens=torch.cat([seq_lens, torch.full((3,), 9, dtype=torch.int32, device=device)]),
                     query_start_loc=torch.full((9,), 9, dtype=torch.int32, device=device),
                     logits_indices=torch.full((8,), 9, device=device), block_tables=tables,
                     slot_mappings=torch.full((groups, 8), 9, device=device), block_size=bs)]
        bufs.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in bufs[0].items()})
        draft_advance.advance_draft_inputs(**bufs[0])
        draft_advance.advance_draft_inputs_ref(**bufs[1])
        for name in bufs[0]:
            assert torch.equal(torch.as_tensor(bufs[0][name]), torch.as_tensor(bufs[1][name])), (step, name)
        assert int(bufs[0]["step_idx"]) == step + 1
        assert bufs[0]["seq_lens"][5:].eq(9).all()  # rows past b are left alone


def check_qk_norm_rope_store(qkv: torch.Tensor, hq: int, hk: int, positions: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, rand, tol: dict) -> None:
    """Without norms, with Llama-form and with Gemma-form (offset) norms; token 2 is padding (slot -1): the cache
    around the written slots must stay as it was."""
    n, d = qkv.shape[0], cos.shape[-1] * 2
    block_size, num_blocks = 4, 6
    slots = torch.tensor([5, 0, -1, 22, 9], device=qkv.device)[:n]  # blocks 1, 0, -, 5, 2
    cache0 = rand(2, num_blocks, block_size, hk, d)
    for norm in (None, 0.0, 1.0):
        weights = (rand(d) * 0.2 + (0.0 if norm else 1.0), rand(d) * 0.2 + (0.0 if norm else 1.0)) \
            if norm is not None else (None, None)
        caches = cache0.clone(), cache0.clone()
        outs = [fn(qkv, hq, hk, positions, cos, sin, c[0], c[1], slots, *weights, 1e-6, norm or 0.0)
                for fn, c in zip((qk_norm_rope_store.qk_norm_rope_store, qk_norm_rope_store.qk_norm_rope_store_ref),
                                 caches)]
        torch.testing.assert_close(outs[0], outs[1], **tol)
        assert outs[0].shape == (n, hq, d) and outs[0].is_contiguous()
        assert torch.equal(caches[0][1], caches[1][1])  # values are copied as they are
        torch.testing.assert_close(caches[0][0], caches[1][0], **tol)
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=qkv.device)
        untouched[slots[slots >= 0]] = False
        flat = caches[0].reshape(2, num_blocks * block_size, hk, d)
        assert torch.equal(flat[:, untouched], cache0.reshape(2, -1, hk, d)[:, untouched])
        assert not torch.equal(flat[0, ~untouched], cache0.reshape(2, -1, hk, d)[0, ~untouched])
    with pytest.raises(ValueError, match="qkv width"):
        qk_norm_rope_store.qk_norm_rope_store(qkv[:, :-d], hq, hk, positions, cos, sin, cache0[0], cache0[1], slots)
    with pytest.raises(ValueError, match="both q and k norm"):
        qk_norm_rope_store.qk_norm_rope_store(qkv, hq, hk, positions, cos, sin, cache0[0], cache0[1], slots,
                                              torch.ones(d, device=qkv.device, dtype=qkv.dtype))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_kernels_match_references(dtype):
    check_fused_kernels("cpu", dtype)


@interpreted
def test_draft_advance_matches_reference():
    check_draft_advance("cpu")


def test_cpu_without_interpreter_keeps_the_torch_path():
    """Plain CPU tensors never reach a kernel: the layers use the references (exact HF comparisons rely on it)."""
    assert rms_norm.use_fused_kernels(torch.zeros(1)) == interpreting()
