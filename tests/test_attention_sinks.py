"""Attention sinks (GPT-OSS): the Triton paged and tree attention kernels with sinks against their torch references
under Triton's interpreter (prefill, decode, verify, trees, sliding windows, flash-decoding splits), a tiny GPT-OSS
on the kernel path, the reference against a direct softmax with the sink column, and the torch backend's sink paths
against the references."""

from __future__ import annotations

import pytest
import torch
from interpreter_children import assert_pytest_children_pass, split_by
from kernel_support import attention_case, check_sink_attention

from engine.kernels.attention import paged as paged_attention
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
    # Two children side by side (tests/interpreter_children.py): the GPT-OSS model on the kernel path, and the kernels.
    assert_pytest_children_pass(__file__, split_by("gpt_oss"))


@interpreted
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), (6, 2, 32)])
def test_paged_attention_with_sinks_matches_reference(num_heads, num_kv_heads, head_dim):
    for lens, window, splits, dtype in ((MIXED, None, None, torch.float32), (MIXED, 3, None, torch.float32),
                                        (DECODE, None, 4, torch.float32), (LONG, 100, 8, torch.float32),
                                        (LONG, None, 1, torch.float16), (DECODE, 7, 4, torch.float16)):
        case = attention_case(num_heads, num_kv_heads, head_dim, 16, *lens, window, dtype, seed=head_dim)
        check_sink_attention(case, _sinks(num_heads, head_dim), splits, 2e-5 if dtype == torch.float32 else 2e-3)


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


@interpreted
def test_gpt_oss_on_the_kernel_path_equals_the_torch_path(tmp_path):
    """A tiny GPT-OSS through the Triton kernels (sinks in prefill, decode and a verify of k + 1 tokens; the
    sliding-window group's window under a KV block; q/k/v biases and YaRN tables in the fused rotary store; the
    verify's and the draft's rows through the folded norm+qkv and o_proj+residual products, and the router kernel):
    the torch path's greedy tokens, which tests/test_gpt_oss.py checks against HF."""
    from conftest import random_prompts
    from moe_support import gpt_oss_config, make_model

    from engine import LLM, SamplingParams

    torch.set_num_threads(1)
    m = make_model(tmp_path, "gpt-oss", gpt_oss_config())
    prompts = random_prompts([5, 9], seed=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=2)
    res = {}
    for backend, rows in (("torch", 0), ("triton", 8)):  # 8: a verify of 2 x 3 tokens folds its norms and adds
        llm = LLM(m.path, draft_model=m.path, num_speculative_tokens=2, attention_backend=backend,
                  adaptive_draft_length=False, small_m_rows=rows, **kw)  # a fixed k: a verify every step
        outs = llm.generate(prompts, params)
        res[backend] = [o.token_ids for o in outs]
        assert llm.spec_stats(outs).acceptance_rate == 1.0
    assert res["triton"] == res["torch"]


@interpreted
def test_tree_attention_with_sinks_matches_reference():
    from kernel_support import tree_case

    from engine.kernels.attention import tree as tree_attention

    for window, splits, dtype in ((None, None, torch.float32), (5, None, torch.float32), (None, 4, torch.float16),
                                  (7, 2, torch.float16)):
        case = tree_case(4, 2, 32, 8, [37, 32, 17, 0], [13, 6, 9, 4], [8, 3, 9, 2], window, dtype,
                         seed=3 + (window or 0))
        sinks = _sinks(4, 9)
        out, ref, plain = (torch.full_like(case.query, 7.0) for _ in range(3))
        tree_attention.tree_attention_ref(*case.args(ref), sinks=sinks)
        tree_attention.tree_attention_ref(*case.args(plain))
        tree_attention.tree_attention(*case.args(out), num_kv_splits=splits, sinks=sinks)
        tol = 2e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        assert (ref - plain).abs().max() > 10 * tol


def test_torch_backend_tree_sinks_match_reference():
    from kernel_support import tree_case

    from engine.attention import torch_backend
    from engine.attention.metadata import GroupAttentionMetadata
    from engine.kernels.attention import tree as tree_attention

    for window in (None, 5):
        case = tree_case(4, 2, 32, 8, [37, 32, 17, 0], [13, 6, 9, 4], [8, 3, 9, 2], window, torch.float32, seed=7)
        sinks = _sinks(4, 11)
        ref = torch.empty_like(case.query)
        tree_attention.tree_attention_ref(*case.args(ref), sinks=sinks)
        group = GroupAttentionMetadata(case.group_id, case.block_table.long(), torch.empty(0, dtype=torch.int64),
                                       window, 8)
        got = torch_backend.tree_attention(case.query, torch.nan_to_num(case.kv_cache), case.tree, group, case.scale,
                                           sinks)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
