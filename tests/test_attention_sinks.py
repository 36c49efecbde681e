"""Attention sinks (GPT-OSS): the Triton paged-attention kernel with sinks against its torch reference under Triton's
interpreter (prefill, decode, verify, sliding windows, flash-decoding splits), the reference against a direct
softmax with the sink column, and the torch backend's sink path against the same reference."""

from __future__ import annotations

import pytest
import torch
from interpreter_children import assert_pytest_children_pass
from kernel_support import attention_case, poison_outside_window

from engine.kernels import paged_attention
from engine.kernels.triton_compat import HAS_TRITON, interpreting

INTERPRETED = interpreting()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process started "
                                                         "by test_sink_kernels_under_interpreter")

MIXED = ([1, 3, 0, 17, 1, 5], [40, 14, 0, 29, 0, 59])  # padding, decode, verify, prefill after cached prefixes
DECODE = ([1, 1, 0, 1], [33, 16, 5, 70])
LONG = ([1, 4, 0, 1], [300, 190, 0, 64])  # several key tiles a request: for splits of the keys


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    # Large enough to take much of each row's mass: a sink counted twice, once a split, or dropped shows.
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="starts the interpreted child")
def test_sink_kernels_under_interpreter():
    assert_pytest_children_pass(__file__)


@interpreted
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), (6, 2, 32)])
def test_paged_attention_with_sinks_matches_reference(num_heads, num_kv_heads, head_dim):
    for lens, window, splits, dtype in ((MIXED, None, None, torch.float32), (MIXED, 3, None, torch.float32),
                                        (DECODE, None, 4, torch.float32), (LONG, 100, 8, torch.float32),
                                        (LONG, None, 1, torch.float16), (DECODE, 7, 4, torch.float16)):
        case = attention_case(num_heads, num_kv_heads, head_dim, 16, *lens, window, dtype, seed=head_dim)
        sinks = _sinks(num_heads, head_dim)
        out, ref, plain = (torch.full_like(case.query, 7.0) for _ in range(3))
        paged_attention.paged_attention_ref(*case.args(ref), sinks=sinks)
        paged_attention.paged_attention_ref(*case.args(plain))
        kv = poison_outside_window(case) if window is not None else case.kv_cache
        paged_attention.paged_attention(*case.args(out, kv), num_kv_splits=splits, sinks=sinks)
        n = case.num_valid_tokens
        tol = 2e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=tol, rtol=tol)
        assert (ref[:n] - plain[:n]).abs().max() > 10 * tol  # the sinks changed the output past the tolerance


def test_reference_sink_is_one_more_softmax_column():
    """One request, every key visible to its last token: out = sum_j softmax([s, sink])_j v_j over the keys."""
    case = attention_case(2, 1, 8, 4, [1], [6], None, torch.float32, seed=1)
    sinks = torch.tensor([1.5, -0.5])
    out = torch.zeros_like(case.query)
    paged_attention.paged_attention_ref(*case.args(out), sinks=sinks)
    blocks = case.block_table[0].long()[torch.arange(7) // 4]
    k, v = case.kv_cache[0][blocks, torch.arange(7) % 4, 0], case.kv_cache[1][blocks, torch.arange(7) % 4, 0]
    for h in range(2):
        scores = case.query[0, h] @ k.T * case.scale
        p = torch.cat([scores, sinks[h:h + 1]]).softmax(0)[:-1]
        torch.testing.assert_close(out[0, h], p @ v, atol=1e-6, rtol=1e-5)


def test_torch_backend_sinks_match_reference():
    """The engine's torch backend (engine/attention/torch_backend.py) on a mixed batch, window and none."""
    from engine.attention import torch_backend
    from engine.attention.metadata import build_common_metadata, build_group_metadata

    for window in (None, 5):
        case = attention_case(4, 2, 16, 4, *MIXED, window, torch.float32, seed=2)
        q_lens = MIXED[0]
        seq_lens = case.seq_lens.tolist()
        keep = [i for i, q in enumerate(q_lens) if q > 0]
        tables = [case.block_table[i].tolist() for i in keep]
        common = build_common_metadata([q_lens[i] for i in keep], [seq_lens[i] for i in keep], torch.device("cpu"))
        group = build_group_metadata(0, tables, [q_lens[i] for i in keep], [seq_lens[i] for i in keep], 4, window,
                                     torch.device("cpu"))
        sinks = _sinks(4, 5)
        n = case.num_valid_tokens
        ours = torch_backend.paged_attention(case.query[:n], case.kv_cache, common, group, case.scale, sinks)
        ref = torch.zeros_like(case.query)
        paged_attention.paged_attention_ref(*case.args(ref), sinks=sinks)
        torch.testing.assert_close(ours, ref[:n], atol=1e-5, rtol=1e-5)


def test_bad_sinks_are_refused():
    case = attention_case(4, 2, 16, 4, [1], [3], None, torch.float32)
    with pytest.raises(ValueError, match=r"sinks must be \[num_heads\] = \[4\] float"):
        paged_attention.paged_attention_ref(*case.args(torch.zeros_like(case.query)), sinks=torch.zeros(2))
