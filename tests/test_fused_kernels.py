"""The fused elementwise kernels of the model layers (RMSNorm with and without the residual add, act(gate) * up,
rotary embedding) against their torch references, on CPU under Triton's interpreter (in a child process, as in
test_kernels.py: the interpreter must be switched on before triton is first imported). CUDA runs them in
tests/gpu/test_fused_kernels_cuda.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import activation, rms_norm, rotary
from engine.kernels.triton_compat import HAS_TRITON, interpreting

if not HAS_TRITON:
    pytest.skip("triton is not installed (the `test` extra installs it on Linux)", allow_module_level=True)

interpreted = pytest.mark.skipif(not interpreting(), reason="runs in the TRITON_INTERPRET=1 child process")


@pytest.mark.skipif(interpreting(), reason="already under the interpreter")
def test_fused_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-x",
                           "-p", "no:cacheprovider", "--noconftest"],
                          cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


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
    for act in activation.ACTIVATIONS:
        for rows, inter in ((1, 64), (4, 1536), (2, 1000)):
            x = rand(rows, 2 * inter, scale=3.0)
            torch.testing.assert_close(activation.act_and_mul(x, act), activation.act_and_mul_ref(x, act), **tol)
    positions = torch.tensor([0, 5, 17, 511, 3], device=device)
    for hq, hk, d in ((4, 2, 16), (9, 3, 64), (8, 1, 256)):
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


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_kernels_match_references(dtype):
    check_fused_kernels("cpu", dtype)


def test_cpu_without_interpreter_keeps_the_torch_path():
    """Plain CPU tensors never reach a kernel: the layers use the references (exact HF comparisons rely on it)."""
    assert rms_norm.use_fused_kernels(torch.zeros(1)) == interpreting()
