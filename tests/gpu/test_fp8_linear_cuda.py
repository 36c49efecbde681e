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
