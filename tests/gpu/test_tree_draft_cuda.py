"""Tree-batched pre-drafting on CUDA (see tests/test_tree_draft.py): the eager forwards give every branch the
logits and tokens of drafting it alone, for a Llama and a Gemma 3 hybrid draft, on the torch path and on the kernel
path (the Triton tree kernel, engine/kernels/attention/tree.py), eagerly and as CUDA graphs of tree forwards
(engine/runner/tree_graphs.py)."""

from __future__ import annotations

import pytest
from test_tree_draft import check_tree_equals_branches_alone, padded_tree_forwards, tree_runner

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("model,block_size", [("llama-1l", 4), ("gemma3-2l", 8)])
def test_tree_draft_on_cuda_equals_each_branch_drafted_alone(tiny_drafts, model, block_size, backend):
    check_tree_equals_branches_alone(tree_runner(tiny_drafts[model].path, block_size, device="cuda", backend=backend))


@pytest.mark.parametrize("model,block_size", [("llama-1l", 4), ("gemma3-2l", 8)])
def test_tree_draft_graphs_on_cuda_equal_each_branch_drafted_alone(tiny_drafts, model, block_size):
    """The tree forwards replayed from CUDA graphs of their (trees, rows a tree) buckets, padded rows and nodes."""
    runner = tree_runner(tiny_drafts[model].path, block_size, device="cuda", backend="triton")
    padded_tree_forwards(runner, capture=True)
    assert runner.tree_graphs.graphs, "no tree graph captured"
    check_tree_equals_branches_alone(runner)
    # Depths 1 and 2 (7 and 6 rows a tree: bucket 8) replayed graphs; depth 0 (the windows and the roots, 10 rows a
    # tree) fits no bucket and ran eagerly: one draft mixes both.
    assert runner.tree_graphs.num_replays == 2
