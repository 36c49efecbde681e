"""The Triton tree-attention kernel (engine/kernels/attention/tree.py) against its torch reference, and tree
drafting on the kernel path against the torch path, on CPU under Triton's interpreter.

As in tests/test_kernels.py, the interpreted tests run in a child pytest process started with TRITON_INTERPRET=1
(tests/interpreter_children.py); here they are skipped and `test_tree_kernel_under_interpreter` runs the children.
bf16 is covered on CUDA (tests/gpu/test_tree_attention_cuda.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from interpreter_children import assert_pytest_children_pass, split_by
from kernel_support import tree_case
from test_tree_draft import SCRATCH_FIRST, _request, tree_runner

from engine.attention import torch_backend
from engine.attention.metadata import GroupAttentionMetadata
from engine.kernels.attention import tree as tree_attention
from engine.kernels.triton_compat import HAS_TRITON, interpreting
from engine.speculation.ahead.tree_draft import draft_tree

if not HAS_TRITON:
    pytest.skip("triton is not installed (the `test` extra installs it on Linux)", allow_module_level=True)

INTERPRETED = interpreting()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process started "
                                                         "by test_tree_kernel_under_interpreter")

# Three trees: prefixes that end inside, at the edge of and one token into a block; different widths (the narrower
# trees have padding rows) and a tree whose prefix is empty.
PREFIXES, NODES, ROWS = [37, 32, 17, 0], [13, 6, 9, 4], [8, 3, 9, 2]


def check_tree_kernel(case, atol: float, rtol: float, splits: int | None = None) -> None:
    out = torch.full_like(case.query, 7.0)
    ref = torch.full_like(case.query, 7.0)
    tree_attention.tree_attention_ref(*case.args(ref))
    tree_attention.tree_attention(*case.args(out), num_kv_splits=splits)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.skipif(INTERPRETED, reason="already under the interpreter: the kernel tests run in this process")
def test_tree_kernel_under_interpreter(tiny_drafts, tmp_path, monkeypatch):
    """Runs this file's interpreted tests in two children side by side (the kernel, and draft_tree). draft_tree's
    torch-path results are computed here (no interpreter: fast) and reach the child, with the draft's path,
    through the environment."""
    runner = tree_runner(tiny_drafts[DRAFT].path, DRAFT_BLOCK_SIZE, backend="torch")
    torch.save(_tree_outputs(runner), tmp_path / "torch_path.pt")
    monkeypatch.setenv("TREE_TEST_DRAFT", tiny_drafts[DRAFT].path)
    monkeypatch.setenv("TREE_TEST_TORCH_PATH", str(tmp_path / "torch_path.pt"))
    assert_pytest_children_pass(__file__, split_by("draft_tree"))


@interpreted
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 128), (3, 3, 32)])
def test_tree_kernel_matches_reference(num_heads, num_kv_heads, head_dim):
    # Windows: none, one smaller than a block (5 < 16), one that reaches into the prefix.
    for window in (None, 5, 20):
        case = tree_case(num_heads, num_kv_heads, head_dim, 16, PREFIXES, NODES, ROWS, window, torch.float32,
                         seed=head_dim + (window or 0))
        check_tree_kernel(case, atol=2e-5, rtol=1e-4)
    # fp16; and the prefix split over programs (some splits see no prefix key at all).
    for window, splits in ((None, 4), (7, 2), (40, 1)):
        case = tree_case(num_heads, num_kv_heads, head_dim, 8, [70, 9, 30], [5, 12, 3], [5, 4, 1], window,
                         torch.float16, seed=splits)
        check_tree_kernel(case, atol=2e-3, rtol=2e-3, splits=splits)


@interpreted
def test_tree_kernel_wide_tree_takes_several_row_blocks():
    """More (row, head) pairs than one program's 64: the tree's rows span M blocks, each over the whole prefix."""
    case = tree_case(4, 1, 64, 16, [21, 40], [30, 5], [24, 5], 9, torch.float32, seed=2)
    check_tree_kernel(case, atol=2e-5, rtol=1e-4)


def test_reference_equals_torch_backend():
    """The kernel's reference (a loop over each row's keys) and the torch backend's tree attention (a mask over
    the gathered prefix and nodes) are two independent readings of the same metadata."""
    for window in (None, 5):
        case = tree_case(4, 2, 32, 8, PREFIXES, NODES, ROWS, window, torch.float32, seed=7)
        ref = torch.empty_like(case.query)
        tree_attention.tree_attention_ref(*case.args(ref))
        group = GroupAttentionMetadata(case.group_id, case.block_table.long(), torch.empty(0, dtype=torch.int64),
                                       window, 8)
        # The torch backend multiplies masked keys by zero: the NaN that poisons keys outside the window stays out.
        kv = torch.nan_to_num(case.kv_cache)
        got = torch_backend.tree_attention(case.query, kv, case.tree, group, case.scale)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_tree_kernel_rejects_bad_shapes():
    case = tree_case(4, 2, 32, 8, [9], [3], [2], None, torch.float32)
    with pytest.raises(ValueError, match="out must have the query's shape"):
        tree_attention.tree_attention_ref(*case.args(torch.empty(1, 4, 32)))
    case.tree.visible = case.tree.visible.int()
    with pytest.raises(ValueError, match="visible must be bool"):
        tree_attention.tree_attention_ref(*case.args(torch.empty_like(case.query)))


DRAFT, DRAFT_BLOCK_SIZE = "gemma3-2l", 8  # a sliding window (5) smaller than a block, two KV-cache groups


def _tree_outputs(runner) -> list[dict[str, torch.Tensor]]:
    """Two requests' trees, two depths: prefixes of 14 tokens (block 0 wholly outside the window: released) and 6."""
    prefixes, windows = [list(range(3, 17)), list(range(40, 46))], [[5, 6, 7], [8, 9]]
    roots = [[[30, 41], [63], [85], [96]], [[17], [39, 40], [62]]]
    reqs = [_request(runner, 1 + 16 * i, p, w, r, 2, SCRATCH_FIRST + 12 * i, seed=i)
            for i, (p, w, r) in enumerate(zip(prefixes, windows, roots))]
    return [dict(logits=t.logits, window_logits=t.window_logits, tokens=t.tokens) for t in draft_tree(runner, reqs, 2)]


@interpreted
def test_draft_tree_on_kernel_path_equals_torch_path():
    """draft_tree with the Triton kernels (tree attention; the fused prologue storing the rows' KV into their scratch
    slots) gives the torch path's logits and tokens, for the Gemma 3 hybrid draft."""
    if "TREE_TEST_DRAFT" not in os.environ:
        pytest.skip("the draft and the torch path's results come from test_tree_kernel_under_interpreter")
    torch.set_num_threads(1)
    want = torch.load(os.environ["TREE_TEST_TORCH_PATH"])
    got = _tree_outputs(tree_runner(os.environ["TREE_TEST_DRAFT"], DRAFT_BLOCK_SIZE, backend="triton"))
    for w, g in zip(want, got):
        torch.testing.assert_close(g["logits"], w["logits"], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(g["window_logits"], w["window_logits"], atol=2e-4, rtol=1e-4)
        assert torch.equal(g["tokens"], w["tokens"])
