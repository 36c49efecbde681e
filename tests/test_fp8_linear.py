"""The FP8 few-row product (engine/quantization/fp8_linear.py) against its dequantizing torch reference, on CPU under
Triton's interpreter (in a child process, tests/interpreter_children.py); tests/gpu/test_fp8_linear_cuda.py runs the
same checks on CUDA."""

from __future__ import annotations

import pytest
import torch
from interpreter_children import assert_pytest_children_pass, in_parent, interpreted, skip_without_triton, split_by

from engine.quantization import fp8_linear as fl
from engine.quantization.fp8 import quantize_fp8

skip_without_triton()


@in_parent
def test_fp8_linear_under_interpreter():
    # Two children side by side (tests/interpreter_children.py): the kernel checks, and greedy decoding through it.
    assert_pytest_children_pass(__file__, split_by("greedy"))


def scale_rows(scale: torch.Tensor, n: int, block: tuple[int, int] | None) -> torch.Tensor:
    return scale if block is None else scale.repeat_interleave(block[0], 0)[:n]


def check_fp8_linear(device: str, dtype: torch.dtype, rows: tuple[int, ...] = (1, 3, 16, 40, 130),
                     shapes: tuple[tuple[int, int], ...] = ((70, 300), (96, 256))) -> None:
    """Per-channel scales and 128 x 128 blocks (partial at the edges: N 70, K 300), with and without a bias, each
    row count (one block of rows, and several: 130 rows are three of 64, the last partial) against the reference
    (which dequantizes to the activations' dtype): a tolerance of one rounding of the output in `dtype` (float32:
    1e-4) for sums over K of a few hundred."""
    g = torch.Generator().manual_seed(0)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * k ** -0.5
        bias = torch.randn(n, generator=g).to(device=device, dtype=dtype)
        for block in (None, (128, 128)):
            q, s = quantize_fp8(w, block)
            q, s = q.to(device), scale_rows(s, n, block).contiguous().to(device)
            group_k = k if block is None else block[1]
            for m in rows:
                x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
                for b in (None, bias):
                    # K in slices (what these few output tiles get), and whole once a shape
                    for splits in ((None, 1) if m == rows[0] else (None,)):
                        out = fl.fp8_linear_kernel(x, q, s, group_k, b, num_splits=splits)
                        torch.testing.assert_close(out, fl.fp8_linear_ref(x, q, s, group_k, b), **tol)
            # the reference against a dequantization written apart: each 128-column group times its scales
            qc, sc = q.float().cpu(), s.cpu()
            dq = qc * sc[:, :1] if block is None else torch.cat(
                [qc[:, j:j + 128] * sc[:, j // 128:j // 128 + 1] for j in range(0, k, 128)], dim=1)
            x = torch.randn(2, k, generator=g)
            torch.testing.assert_close(fl.fp8_linear_ref(x, q.cpu(), s.cpu(), group_k), x @ dq.T, atol=1e-5,
                                       rtol=1e-5)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_linear_kernel_matches_reference(dtype):
    check_fp8_linear("cpu", dtype)


@interpreted
def test_fp8_linear_dispatch(monkeypatch):
    """A few rows go through the kernel (also with leading batch dimensions), more rows and scale groups the kernel
    cannot step through (not a multiple of 16 columns) through the reference; both equal the reference. How many
    rows take the kernel depends on the scales' form."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=g)
    for block in ((16, 32), (8, 40)):
        q, s = quantize_fp8(w, block)
        s = scale_rows(s, 40, block)
        for shape in ((2, 3, 64), (fl.FEW_ROWS + 1, 64)):
            x = torch.randn(*shape, generator=g)
            ref = fl.fp8_linear_ref(x.reshape(-1, 64), q, s, block[1]).reshape(*shape[:-1], 40)
            torch.testing.assert_close(fl.fp8_linear(x, q, s, block[1]), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=f"at most {fl.FEW_ROWS} rows"):
        fl.fp8_linear_kernel(torch.randn(fl.FEW_ROWS + 1, 64), q, s, 40)
    # A scale a row: the kernel up to one block of rows, more through the FP8 tensor cores on a GPU
    # (torch._scaled_mm, one read of W as well; the reference here). Block scales: the kernel past one block too.
    calls: list[int] = []
    real = fl.fp8_linear_kernel
    monkeypatch.setattr(fl, "fp8_linear_kernel", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    q_row, s_row = quantize_fp8(w, None)
    s_row = scale_rows(s_row, 40, None)
    for m in (fl.MAX_BLOCK_M, fl.MAX_BLOCK_M + 1):
        x = torch.randn(m, 64, generator=g)
        torch.testing.assert_close(fl.fp8_linear(x, q_row, s_row, 64), fl.fp8_linear_ref(x, q_row, s_row, 64),
                                   atol=1e-4, rtol=1e-4)
    q_blk, s_blk = quantize_fp8(w, (16, 32))
    fl.fp8_linear(torch.randn(fl.MAX_BLOCK_M + 1, 64, generator=g), q_blk, scale_rows(s_blk, 40, (16, 32)), 32)
    assert calls == [fl.MAX_BLOCK_M, fl.MAX_BLOCK_M + 1]


def check_scaled_mm(device: str) -> None:
    """The prefill product through torch._scaled_mm against a reference written apart that rounds the activations
    to FP8 per token as it should (a scale a row, the row's largest magnitude at 448) and multiplies in float32:
    equal within the bf16 output's rounding (2^-8 of the largest output)."""
    g = torch.Generator().manual_seed(2)
    n, k = 96, 256
    q, s = quantize_fp8(torch.randn(n, k, generator=g), None)
    q, s = q.to(device), s.to(device)
    bias = torch.randn(n, generator=g).to(device=device, dtype=torch.bfloat16)
    for b in (None, bias):
        x = torch.randn(fl.FEW_ROWS + 7, k, generator=g).to(device=device, dtype=torch.bfloat16)
        xs = x.float().abs().amax(dim=1, keepdim=True) / 448.0
        ref = ((x.float() / xs).to(torch.float8_e4m3fn).float() * xs) @ (q.float() * s).T
        ref = ref if b is None else ref + b.float()
        out = fl.fp8_linear_scaled_mm(x, q, s, b)
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref, rtol=0, atol=2 ** -8 * ref.abs().max().item())
        # and near the weight-only reference: the activations' FP8 rounding, 1/16 of a value at most
        assert (out.float() - fl.fp8_linear_ref(x.float(), q, s, k, None if b is None else b.float())).abs().max() \
            < ref.abs().max() / 16


def test_fp8_scaled_mm_matches_reference():
    check_scaled_mm("cpu")  # torch's CPU _scaled_mm: the same product the GPU's FP8 tensor cores run


@interpreted
def test_greedy_through_the_fp8_kernel_equals_hf(tmp_path):
    """A 1-layer Qwen2 (q/k/v biases: the kernel's bias epilogue) in block FP8, its prefill and decode steps (up to
    FEW_ROWS rows) through the kernel, float32: token for token HF's greedy output on the dequantized weights."""
    from conftest import TINY_CONFIGS, hf_greedy, make_tiny_model, random_prompts
    from fp8_checkpoints import write_fp8_checkpoint

    from engine import LLM, SamplingParams

    torch.set_num_threads(1)
    from transformers import Qwen2Config

    cfg = Qwen2Config(**{**TINY_CONFIGS["qwen2"].to_dict(), "num_hidden_layers": 1, "layer_types": None})
    m = make_tiny_model(tmp_path, "qwen2", cfg)
    oracle = write_fp8_checkpoint(m.hf, cfg, tmp_path / "fp8", "fp8-block", (16, 32))
    # small_m_rows=0: the decode steps' products through this kernel, not the folded ones (tests/test_small_m_fp8.py)
    llm = LLM(str(tmp_path / "fp8"), device="cpu", block_size=4, max_model_len=64, small_m_rows=0)
    calls = []
    real = fl.fp8_linear_kernel
    fl.fp8_linear_kernel = lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k)
    try:
        prompts = random_prompts([5, 11], seed=3)
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finally:
        fl.fp8_linear_kernel = real
    assert [o.token_ids for o in outs] == [hf_greedy(oracle, p, 6) for p in prompts]
    assert max(calls) > 1 and min(calls) <= 2  # the prefill's rows and the decode steps' went through the kernel
