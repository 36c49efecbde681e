"""The Triton tree-attention kernel compiled for CUDA against its torch reference (bf16 and fp32, draft-sized and
target-sized heads, prefixes of hundreds to thousands of keys, split and unsplit), and draft_tree on the kernel path
against the torch path on CUDA (a Llama and a Gemma 3 hybrid draft)."""

from __future__ import annotations

import pytest
import torch
from kernel_support import tree_case
from test_tree_draft import SCRATCH_FIRST, _request, tree_runner

from engine.kernels.attention.tree import tree_attention, tree_attention_ref
from engine.speculation.ahead.tree_draft import draft_tree

pytestmark = pytest.mark.gpu
TOLERANCE = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# (num_heads, num_kv_heads, head_dim): Qwen3-0.6B / 8B, Gemma 3 270M, no grouping.
SHAPES = [(16, 8, 128), (32, 8, 128), (4, 1, 256), (8, 8, 64)]
# (prefix lengths, nodes, rows per tree): one tree of a 15-row first forward, several trees of a later depth's
# forward, a wide tree (more than one row block).
TREES = {
    "one15": ([700], [15], [15]),
    "four": ([1500, 33, 0, 260], [40, 20, 12, 30], [8, 4, 2, 6]),
    "wide60": ([2000], [80], [60]),
}


# (tree, sliding window, KV splits): every tree unsplit and split, with no window, a window shorter than a block
# and one that cuts the longer prefixes. Each (tree, window) reference is computed once: the torch reference, one
# row at a time, and a compile per kernel variant are what this test's time goes to (about a minute a shape when it
# ran every combination).
CASES = [("one15", None, None), ("one15", None, 1), ("one15", 5, None), ("four", None, None), ("four", 512, 1),
         ("four", 5, 1), ("wide60", None, 1), ("wide60", 512, None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tree_kernel_sweep(dtype, shape):
    refs = {}
    for name, window, splits in CASES:
        prefixes, nodes, rows = TREES[name]
        case = tree_case(*shape, 16, prefixes, nodes, rows, window, dtype, device="cuda", seed=len(name))
        if (name, window) not in refs:
            refs[name, window] = torch.full_like(case.query, 7.0)
            tree_attention_ref(*case.args(refs[name, window]))
        out = torch.full_like(case.query, 7.0)
        tree_attention(*case.args(out), num_kv_splits=splits)
        try:
            torch.testing.assert_close(out.float(), refs[name, window].float(), **TOLERANCE[dtype])
        except AssertionError as e:
            raise AssertionError(f"{name}, window {window}, splits {splits}: {e}") from e


def _outputs(runner) -> list:
    prefixes = [list(range(3, 30)), list(range(40, 53))]  # within the 8 blocks _request gives a prefix
    windows, roots = [[5, 6, 7], [8, 9, 10]], [[[30, 41, 52], [63, 74], [85], [96]], [[17, 28], [39], [40, 51], [62]]]
    reqs = [_request(runner, 1 + 16 * i, p, w, r, 3, SCRATCH_FIRST + 12 * i, seed=i)
            for i, (p, w, r) in enumerate(zip(prefixes, windows, roots))]
    return draft_tree(runner, reqs, 3)


@pytest.mark.parametrize("model,block_size", [("llama-1l", 4), ("gemma3-2l", 8)])
def test_draft_tree_kernel_path_equals_torch_path_on_cuda(tiny_drafts, model, block_size):
    want = _outputs(tree_runner(tiny_drafts[model].path, block_size, device="cuda", backend="torch"))
    got = _outputs(tree_runner(tiny_drafts[model].path, block_size, device="cuda", backend="triton"))
    for w, g in zip(want, got):
        torch.testing.assert_close(g.logits, w.logits, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(g.window_logits, w.window_logits, atol=2e-4, rtol=1e-4)
        assert torch.equal(g.tokens, w.tokens)
