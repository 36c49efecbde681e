"""The fused decode attention kernel (attention's prologue, split-KV attention and its combine in one launch)
against the unfused kernels' torch references, on CPU under Triton's interpreter (in a child process, as in
test_kernels.py). The interpreter's tl.dot mishandles bfloat16: fp32 and fp16 here, bf16 in
tests/gpu/test_decode_attention_cuda.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_support import check_decode_attention, decode_case

from engine.kernels import decode_attention
from engine.kernels.triton_compat import HAS_TRITON, interpreting

if not HAS_TRITON:
    pytest.skip("triton is not installed (the `test` extra installs it on Linux)", allow_module_level=True)

interpreted = pytest.mark.skipif(not interpreting(), reason="runs in the TRITON_INTERPRET=1 child process")

# Decode requests after contexts that end inside and at the edges of blocks, padding requests (query length 0),
# and contexts long enough for several key tiles per split.
DECODE = ([1, 1, 0, 1], [33, 15, 5, 70])
LONG = ([1, 0, 1, 1], [300, 0, 190, 0])


@pytest.mark.skipif(interpreting(), reason="already under the interpreter")
def test_decode_attention_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-x",
                           "-p", "no:cacheprovider", "--noconftest"],
                          cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


@interpreted
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(2, 2, 64), (8, 2, 128), (4, 1, 80), (4, 2, 256),
                                                                 (4, 2, 16)])
def test_decode_attention_matches_unfused_reference(num_heads, num_kv_heads, head_dim):
    cases = [(DECODE, None, "llama", 1), (DECODE, 7, "gemma", 4), (LONG, None, None, 4), (LONG, 100, "llama", 8),
             (LONG, None, "gemma", 1)]
    for i, (lens, window, norm, splits) in enumerate(cases):
        dtype = torch.float32 if i % 2 == 0 else torch.float16
        tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)
        case = decode_case(num_heads, num_kv_heads, head_dim, 16, *lens, window, dtype, norm, seed=head_dim + i)
        for tickets in (None, True):  # the splits combined by a second kernel / by the last program
            check_decode_attention(case, splits=splits, tickets=tickets, **tol)


@interpreted
def test_decode_attention_of_a_first_token_and_int64_metadata():
    """A one-token prompt (no context: the new key is the only one) and int64 layout tensors."""
    case = decode_case(4, 2, 64, 16, [1, 1], [0, 16], None, torch.float32, "llama", seed=5)
    case.attention.query_start_loc = case.attention.query_start_loc.long()
    case.attention.seq_lens = case.attention.seq_lens.long()
    case.attention.block_table = case.attention.block_table.long()
    check_decode_attention(case, atol=2e-5, rtol=1e-4, splits=2)


def test_decode_attention_rejects_bad_arguments():
    case = decode_case(4, 2, 64, 16, *DECODE, None, torch.float32, "llama")
    kv = case.attention.kv_cache
    out = torch.empty(case.qkv.shape[0], 4, 64)
    with pytest.raises(ValueError, match="split_counters holds 3 counters"):
        decode_attention.decode_attention_ref(*case.args(out, kv, torch.zeros(3, dtype=torch.int32)))
    with pytest.raises(ValueError, match="split_counters must be a 1-D int32"):
        decode_attention.decode_attention_ref(*case.args(out, kv, torch.zeros(8, dtype=torch.int64)))
    with pytest.raises(ValueError, match="out must be"):
        decode_attention.decode_attention_ref(*case.args(out[:, :2], kv, torch.zeros(8, dtype=torch.int32)))
    case.attention.sliding_window = 0
    with pytest.raises(ValueError, match="sliding_window"):
        decode_attention.decode_attention_ref(*case.args(out, kv, torch.zeros(8, dtype=torch.int32)))
