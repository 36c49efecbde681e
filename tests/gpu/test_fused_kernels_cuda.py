"""The fused elementwise kernels on CUDA against their torch references (see tests/test_fused_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from test_fused_kernels import check_draft_advance, check_fused_kernels

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_match_references_on_cuda(dtype):
    check_fused_kernels("cuda", dtype)


def test_draft_advance_matches_reference_on_cuda():
    check_draft_advance("cuda")
