"""The input norm, qkv product and attention's prologue in one kernel (engine/kernels/norm_qkv_rope_store.py)
against its torch reference (norm_linear_ref then qk_norm_rope_store_ref), KV-cache contents included, and greedy
decoding with EngineConfig.fused_qkv_prologue on equal to it off, on CPU under Triton's interpreter (in a child
process, as in test_fused_kernels.py). CUDA runs them in tests/gpu/test_norm_qkv_rope_store_cuda.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import norm_qkv_rope_store as nq
from engine.kernels.triton_compat import HAS_TRITON, interpreting

if not HAS_TRITON:
    pytest.skip("triton is not installed (the `test` extra installs it on Linux)", allow_module_level=True)

interpreted = pytest.mark.skipif(not interpreting(), reason="runs in the TRITON_INTERPRET=1 child process")
HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(interpreting(), reason="already under the interpreter")
def test_norm_qkv_rope_store_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    proc = subprocess.run([sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-x",
                           "-p", "no:cacheprovider", "--noconftest"],
                          cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


def rotary_tables(head_dim: int, positions: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(positions).float(), inv)
    return freqs.cos().to(device), freqs.sin().to(device)


def interleaved_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A wrong rotary for the negative control: pairs (2i, 2i + 1) instead of (i, i + D/2)."""
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)

    return rot(q), rot(k)


def check_norm_qkv_rope_store(device: str, dtype: torch.dtype,
                              shapes: tuple[tuple[int, int, int, int], ...] = ((4, 2, 16, 64), (3, 1, 12, 40)),
                              rows: tuple[int, ...] = (1, 2, 3, 4),
                              configs: tuple[dict | None, ...] = (None, dict(SPLIT_K=3, BLOCK_K=16)),
                              residual: bool = True) -> None:
    """Per shape (q heads, kv heads, head_dim, hidden), row count and config (the default, a forced split of K):
    without q/k norms (with residual and bias), Llama-form and Gemma-form (offset) norms, against the reference:
    q, the residual sum and the whole KV cache (slots written, padding token not stored, the rest untouched). The
    last shape has a head_dim whose half is not a power of two and a K the split does not divide; shared with the
    CUDA test. residual=False: no residual add anywhere (Triton's interpreter adds bfloat16 tensors wrongly)."""
    g = torch.Generator().manual_seed(0)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    block_size, num_blocks = 4, 6
    for hq, hk, d, hidden in shapes:
        width = (hq + 2 * hk) * d
        cos, sin = rotary_tables(d, 64, device)
        w, bias = rand(width, hidden, scale=hidden ** -0.5), rand(width)
        cache0 = rand(2, num_blocks, block_size, hk, d)
        for m in rows:
            x, res = rand(m, hidden, scale=2.0), rand(m, hidden) if residual else None
            positions = torch.tensor([3, 17, 0, 63], device=device)[:m]
            slots = torch.tensor([5, -1, 22, 9], device=device)[:m]  # blocks 1, -, 5, 2; row 1 is padding
            # (input norm offset, q/k norm offset or None, residual, bias)
            for offset, qk, r, b in ((0.0, None, res, bias), (0.0, 0.0, None, None), (1.0, 1.0, res, None)):
                nw = rand(hidden, scale=0.1) + (0.0 if offset else 1.0)
                qk_w = ((rand(d) * 0.2 + (0.0 if qk else 1.0), rand(d) * 0.2 + (0.0 if qk else 1.0))
                        if qk is not None else (None, None))
                for cfg in configs:
                    caches = cache0.clone(), cache0.clone()
                    args = (nw, 1e-6, offset, w, b, hq, hk, positions, cos, sin)
                    q, s = nq.norm_qkv_rope_store(x, r, *args, caches[0][0], caches[0][1], slots, *qk_w, 1e-6,
                                                  qk or 0.0, config=cfg)
                    ref_q, ref_s = nq.norm_qkv_rope_store_ref(x, r, *args, caches[1][0], caches[1][1], slots, *qk_w,
                                                              1e-6, qk or 0.0)
                    where = (hq, hk, d, hidden, m, offset, qk, cfg)
                    assert q.shape == (m, hq, d) and q.is_contiguous(), where
                    torch.testing.assert_close(q, ref_q, **tol, msg=lambda e, where=where: f"{where}: {e}")
                    assert torch.equal(s, ref_s), where  # the residual sum is rounded once, as torch rounds it
                    torch.testing.assert_close(caches[0], caches[1], **tol, msg=lambda e, where=where: f"{where}: {e}")
                    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
                    written[slots[slots >= 0]] = True
                    flat, flat0 = caches[0].reshape(2, -1, hk, d), cache0.reshape(2, -1, hk, d)
                    assert torch.equal(flat[:, ~written], flat0[:, ~written]), where
                    assert not torch.equal(flat[:, written], flat0[:, written]), where
    x, w = rand(1, 64), rand(8 * 16, 64)
    counters = nq._COUNTERS.get(x.device)
    assert counters is not None and not counters.any()  # split launches left their counters at zero
    cache = rand(2, 4, 4, 2, 16)
    cos, sin = rotary_tables(16, 8, device)
    one = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        nq.norm_qkv_rope_store(rand(5, 64), None, rand(64), 1e-6, 0.0, w, None, 4, 2, one.repeat(5), cos, sin,
                               cache[0], cache[1], one.repeat(5))
    with pytest.raises(ValueError, match="qkv width"):
        nq.norm_qkv_rope_store(x, None, rand(64), 1e-6, 0.0, w[:-16], None, 4, 2, one, cos, sin, cache[0], cache[1],
                               one)


def check_rotary_half_split(device: str) -> None:
    """Negative control: the kernel matches the rotate-half reference and is far from the same pipeline with an
    interleaved rotary, so a test against the reference would catch a wrong pairing."""
    from engine.kernels import qk_norm_rope_store as prologue

    g = torch.Generator().manual_seed(1)
    hq, hk, d, hidden = 2, 1, 16, 32
    x = torch.randn(1, hidden, generator=g).to(device)
    w = (torch.randn((hq + 2 * hk) * d, hidden, generator=g) * hidden ** -0.5).to(device)
    nw = torch.ones(hidden, device=device)
    cos, sin = rotary_tables(d, 32, device)
    pos, slots = torch.tensor([29], device=device), torch.tensor([3], device=device)
    caches = [torch.zeros(2, 2, 4, hk, d, device=device) for _ in range(3)]
    args = (nw, 1e-6, 0.0, w, None, hq, hk, pos, cos, sin)
    q, _ = nq.norm_qkv_rope_store(x, None, *args, caches[0][0], caches[0][1], slots)
    ref, _ = nq.norm_qkv_rope_store_ref(x, None, *args, caches[1][0], caches[1][1], slots)
    original = prologue.rotary_embedding_ref
    prologue.rotary_embedding_ref = interleaved_rotary_ref
    try:
        wrong, _ = nq.norm_qkv_rope_store_ref(x, None, *args, caches[2][0], caches[2][1], slots)
    finally:
        prologue.rotary_embedding_ref = original
    torch.testing.assert_close(q, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[0], caches[1], atol=1e-5, rtol=1e-5)
    assert (q - wrong).abs().max() > 0.1 and (caches[0][0] - caches[2][0]).abs().max() > 0.1
    assert torch.equal(caches[1][1], caches[2][1])  # values are not rotated


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_norm_qkv_rope_store_matches_reference(dtype):
    # The interpreter's bfloat16 x + residual gives NaN (small_m_linear's norm_linear too): bfloat16 without the
    # residual add here, with it on CUDA.
    check_norm_qkv_rope_store("cpu", dtype, rows=(1, 2, 3, 4) if dtype == torch.float32 else (1, 4),
                              residual=dtype != torch.bfloat16)


@interpreted
def test_wrong_rotary_half_split_is_caught():
    check_rotary_half_split("cpu")


@interpreted
@pytest.mark.parametrize("family,split", [("llama", False), ("qwen2", False), ("qwen3", True), ("gemma3", True)])
def test_greedy_with_fused_qkv_prologue_equals_without(tmp_path, monkeypatch, family, split):
    """float32 greedy tokens with fused_qkv_prologue on equal those with it off (norm+qkv, then the separate
    prologue kernel), for Llama (no q/k norm), Qwen2 (qkv bias), Qwen3 (q/k norm) and Gemma 3 (offset norms,
    sliding and full layers in two KV-cache groups); decode batches shrink from 4 rows to 1. `split`: K split over
    two programs per head (the tiny models' grid would otherwise not split)."""
    from conftest import TINY_CONFIGS, make_tiny_model, random_prompts

    from engine import LLM, SamplingParams

    torch.set_num_threads(1)
    model = make_tiny_model(tmp_path, family, TINY_CONFIGS[family])
    prompts = random_prompts([5, 9, 14, 3], seed=4)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 3, 4, 5)]
    if split:
        default = nq._config
        monkeypatch.setattr(nq, "_config", lambda *a: {**default(*a), "SPLIT_K": 2, "BLOCK_K": 16})
    launches = []
    fused = nq.norm_qkv_rope_store
    monkeypatch.setattr(nq, "norm_qkv_rope_store", lambda *a, **kw: launches.append(a[0].shape[0]) or fused(*a, **kw))
    runs = {}
    for on in (False, True):
        llm = LLM(model.path, attention_backend="triton", device="cpu", block_size=4, num_kv_blocks=64,
                  max_num_seqs=4, small_m_rows=4, fused_qkv_prologue=on)
        assert all(layer.fused_qkv_prologue == on for layer in llm.executor.target.model.model.layers)
        runs[on] = [o.token_ids for o in llm.generate(prompts, params)]
        assert bool(launches) == on
    assert runs[True] == runs[False]
    layers = TINY_CONFIGS[family].num_hidden_layers
    assert launches == [4] * layers + [3] * layers + [2] * layers + [1] * layers, launches  # one launch a layer
