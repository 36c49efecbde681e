"""Tree-batched pre-drafting on CUDA (see tests/test_tree_draft.py): the eager torch path gives every branch the
logits and tokens of drafting it alone, for a Llama and a Gemma 3 hybrid draft; a runner on the kernel path refuses
a tree (no Triton tree attention yet) instead of running it wrong."""

from __future__ import annotations

import pytest
from test_tree_draft import check_tree_equals_branches_alone, tree_runner

from engine.speculation.tree_draft import TreeDraftRequest, draft_tree

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model,block_size", [("llama-1l", 4), ("gemma3-2l", 8)])
def test_tree_draft_on_cuda_equals_each_branch_drafted_alone(tiny_drafts, model, block_size):
    check_tree_equals_branches_alone(tree_runner(tiny_drafts[model].path, block_size, device="cuda"))


def test_kernel_path_refuses_a_tree(tiny_drafts):
    runner = tree_runner(tiny_drafts["llama-1l"].path, 4, device="cuda", backend="triton")
    req = TreeDraftRequest(4, [list(range(1, 9))], [20], [[30], [31]], [list(range(300, 304))])
    with pytest.raises(NotImplementedError):
        draft_tree(runner, [req], 2)
