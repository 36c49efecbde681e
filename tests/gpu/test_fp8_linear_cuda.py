"""The FP8 few-row product on CUDA against its torch reference (the checks of tests/test_fp8_linear.py), on a
Qwen3-8B layer's qkv shape too."""

from __future__ import annotations

import pytest
import torch
from test_fp8_linear import check_fp8_linear

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_reference_on_cuda(dtype):
    check_fp8_linear("cuda", dtype, rows=(1, 4, 8, 16, 40, 130), shapes=((70, 300), (6144, 4096)))


def test_fp8_scaled_mm_matches_reference_on_cuda():
    from test_fp8_linear import check_scaled_mm

    check_scaled_mm("cuda")


def test_e4m3_to_bf16_conversion_is_exact_on_cuda():
    """The kernel's own FP8 -> bfloat16 conversion (engine/kernels/e4m3.py: bit operations and a bf16 multiply)
    against torch's for every byte but the two NaNs, subnormals and zeros of both signs included: bit for bit."""
    from engine.kernels.e4m3 import e4m3_to_bf16
    from engine.kernels.triton_compat import tl, triton

    @triton.jit
    def convert(src, dst, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(dst + i, e4m3_to_bf16(tl.load(src + i, mask=i < n, other=0)), mask=i < n)

    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8, device="cuda")
    out = torch.empty(codes.numel(), dtype=torch.bfloat16, device="cuda")
    convert[(1,)](codes, out, codes.numel(), BLOCK=256)
    want = codes.view(torch.float8_e4m3fn).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (codes[out != want], out[out != want])
