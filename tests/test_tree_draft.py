"""Tree-batched pre-drafting (engine/speculation/ahead/tree_draft.py) against drafting each branch on its own.

The tree's forwards (tree attention over the committed prefix, read in place from the paged cache, and over each
row's own chain of nodes in scratch slots) must give every branch the logits and tokens that the ordinary path gives
when it prefills the branch's whole sequence into blocks of its own and decodes it token by token. A Llama draft,
and a Gemma 3 hybrid (a sliding-window and a full KV-cache group) whose window (5) is smaller than a block (8), with
the prefix's blocks that lie wholly outside the window released (NULL_BLOCK), as the KV manager leaves them.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import random_prompts

from engine.config import EngineConfig
from engine.kv_cache.block_pool import NULL_BLOCK
from engine.model_config import ModelConfig
from engine.parallel import TensorParallelGroup, set_tp_group
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk
from engine.speculation.ahead.tree_draft import TreeDraftRequest, draft_tree, num_tree_nodes
from engine.speculation.ahead.tree_roots import top_f_roots

NUM_BLOCKS = 96
REF_FIRST = 48  # blocks 48.. hold the reference runs' sequences
SCRATCH_FIRST = 72  # blocks 72.. the trees' scratch slots
ATOL, RTOL = 2e-4, 1e-4


def tree_runner(path: str, block_size: int, device: str = "cpu", backend: str = "torch") -> ModelRunner:
    ec = EngineConfig(device=torch.device(device), dtype=torch.float32, max_model_len=128, block_size=block_size,
                      num_kv_blocks=NUM_BLOCKS, attention_backend=backend)
    mc = ModelConfig.from_path(path)
    mc.max_model_len = ec.max_model_len
    return ModelRunner(mc, ec, "draft")


def _tables(runner: ModelRunner, first: int, n: int) -> list[list[int]]:
    return [list(range(first, first + n)) for _ in runner.kv_groups]


def _request(runner: ModelRunner, first_block: int, prefix: list[int], window: list[int], roots: list[list[int]],
             depth: int, scratch_first: int, seed: int, **sampling: object) -> TreeDraftRequest:
    """Prefill the prefix into the request's own blocks; scratch slots are a shuffled run of slots (any order
    works), from their own blocks; a sliding-window group's blocks wholly outside the window are released."""
    bs = runner.config.block_size
    tables = _tables(runner, first_block, 8)
    runner.forward_chunks([Chunk(prefix, 0, 1, tables)])
    p = len(prefix)
    for g in runner.kv_groups:
        w = g.spec.sliding_window
        if w is not None:  # the first row sits at position p and sees keys > p - w
            for b in range((p - w + 1) // bs):
                tables[g.group_id][b] = NULL_BLOCK
    n = num_tree_nodes(len(window), sum(len(r) for r in roots), depth)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    slots = (scratch_first * bs + perm).tolist()
    return TreeDraftRequest(p, tables, window, roots, [list(slots) for _ in runner.kv_groups], **sampling)


def _branch_alone(runner: ModelRunner, seq: list[int], depth: int) -> tuple[torch.Tensor, list[int]]:
    """The ordinary path: prefill the branch's whole sequence into fresh blocks, then greedy decode one token a step.
    Returns the logits of each of the `depth` drafts [depth, V] and the drafts."""
    tables = _tables(runner, REF_FIRST, 16)
    logits = [runner.forward_chunks([Chunk(seq, 0, 1, tables)])[0]]
    toks = [int(logits[-1].argmax())]
    for j in range(1, depth):
        logits.append(runner.forward_chunks([Chunk([toks[-1]], len(seq) + j - 1, 1, tables)])[0])
        toks.append(int(logits[-1].argmax()))
    return torch.stack(logits), toks


CASES = [("llama-1l", 4), ("gemma3-2l", 8)]  # gemma3-2l: sliding window 5 < block size 8


def padded_tree_forwards(runner: ModelRunner, capture: bool = False) -> None:
    """Run the runner's tree forwards through the padded buffers of engine/runner/tree_graphs.py (CUDA graphs where
    `capture` and the runner captures them, else the same padded forward eagerly): rows a tree padded to 4 or 8,
    nodes to 32, so every forward below has padding rows and nodes."""
    runner.build_tree_graphs([4, 8], 32, 16, capture=capture)


def check_tree_equals_branches_alone(runner: ModelRunner) -> None:
    prefixes = random_prompts([13, 22], seed=5)
    k, depth = 3, 3
    windows = random_prompts([k, k], seed=6)
    # Outcome a: F_a candidates (a capped geometric schedule's shape: more where rejection is likelier).
    roots = [[[30, 41, 52], [63, 74], [85], [96]], [[17, 28], [39], [40, 51], [62]]]
    reqs = [_request(runner, 1 + 16 * i, p, w, r, depth, SCRATCH_FIRST + 12 * i, seed=i)
            for i, (p, w, r) in enumerate(zip(prefixes, windows, roots))]
    own = [runner.kv_caches[g][0][:, 1:33].clone() for g in range(len(runner.kv_groups))]
    trees = draft_tree(runner, reqs, depth)  # both requests' trees in one forward per depth
    for g in range(len(runner.kv_groups)):  # the requests' own KV is only read
        assert torch.equal(own[g], runner.kv_caches[g][0][:, 1:33])
    for req, prefix, tree in zip(reqs, prefixes, trees):
        assert tree.tokens.shape == (sum(len(r) for r in req.roots), depth)
        for b, (a, root) in enumerate(zip(tree.outcome, tree.root)):
            ref_logits, ref_toks = _branch_alone(runner, prefix + req.window[:a] + [root], depth)
            torch.testing.assert_close(tree.logits[b], ref_logits, atol=ATOL, rtol=RTOL)
            assert tree.tokens[b].tolist() == ref_toks, f"outcome {a}, root {root}"
            # Greedy: q is one-hot at the draft.
            assert torch.equal(tree.probs[b].argmax(-1), tree.tokens[b])
            assert torch.all(tree.probs[b].max(-1).values == 1.0)
        # The window's logits: those of the ordinary prefill of prefix + window, at the window's positions.
        tables = _tables(runner, REF_FIRST, 16)
        seq = prefix + req.window
        ref = runner.forward_chunks([Chunk(seq, 0, len(req.window), tables)])
        torch.testing.assert_close(tree.window_logits, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize("model,block_size", CASES)
def test_tree_draft_equals_each_branch_drafted_alone(tiny_drafts, one_thread, model, block_size, padded):
    """Exact: each forward's metadata holds the real rows only. Padded: the layout of the CUDA graphs of tree
    forwards (trees and rows padded to a bucket), run eagerly on the CPU."""
    runner = tree_runner(tiny_drafts[model].path, block_size)
    if padded:
        padded_tree_forwards(runner)
    check_tree_equals_branches_alone(runner)


def _tp_rank(rank: int, port: int, path: str, errors: mp.Queue) -> None:
    """One rank of a draft at tensor parallel 2 (gloo), in a forked process: the same check as at TP 1."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        set_tp_group(TensorParallelGroup(rank, 2, dist.group.WORLD))
        runner = tree_runner(path, 8)
        assert all(a.num_heads == 2 and a.num_kv_heads == 1 for a in runner.model.attention_layers())  # sharded
        check_tree_equals_branches_alone(runner)
        errors.put(None)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_tree_draft_equals_each_branch_drafted_alone_tp2(tiny_drafts):
    """The Gemma 3 hybrid draft at tensor parallel 2 (heads sharded over two ranks, gloo): every rank's tree draft
    equals its own branches drafted alone."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")  # no re-import: the ranks start in well under a second
    errors = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, port, tiny_drafts["gemma3-2l"].path, errors)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [errors.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results == [None, None], results


@pytest.mark.parametrize("model,block_size", CASES)
def test_branches_never_see_their_siblings(tiny_drafts, one_thread, model, block_size):
    """Changing one branch's root changes that branch's logits and no other branch's."""
    runner = tree_runner(tiny_drafts[model].path, block_size)
    prefix = random_prompts([14], seed=8)[0]
    window = [20, 21, 22]
    roots = [[30, 31], [32, 33], [34], [35]]
    depth = 3
    req = _request(runner, 1, prefix, window, roots, depth, SCRATCH_FIRST, seed=0)
    before = draft_tree(runner, [req], depth)[0]
    req.roots = [[30, 31], [99, 33], [34], [35]]  # branch 2 (outcome 1, first candidate)
    after = draft_tree(runner, [req], depth)[0]
    changed = 2
    assert not torch.allclose(before.logits[changed], after.logits[changed], atol=1e-2)
    keep = [b for b in range(len(before.root)) if b != changed]
    torch.testing.assert_close(after.logits[keep], before.logits[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after.window_logits, before.window_logits, atol=1e-5, rtol=1e-5)


def test_sampled_tree_draws_from_its_q(tiny_drafts, one_thread):
    """A request with a temperature: q is the softmax of the tree's logits at that temperature, and every draft was
    drawn where q is positive (top_k 3: only the three likeliest tokens)."""
    runner = tree_runner(tiny_drafts["llama-1l"].path, 4)
    prefix = random_prompts([9], seed=9)[0]
    req = _request(runner, 1, prefix, [20, 21], [[30, 31], [32], [33, 34]], 4, SCRATCH_FIRST, seed=1,
                   temperature=0.8, top_k=3)
    tree = draft_tree(runner, [req], 4, generator=torch.Generator().manual_seed(0))[0]
    assert torch.all(tree.probs.gather(-1, tree.tokens[..., None]) > 0)
    torch.testing.assert_close(tree.probs.sum(-1), torch.ones(tree.tokens.shape))
    assert torch.all((tree.probs > 0).sum(-1) <= 3)
    top3 = (tree.logits / 0.8).topk(3, dim=-1)
    ref = torch.zeros_like(tree.probs).scatter_(-1, top3.indices, top3.values.softmax(-1))
    torch.testing.assert_close(tree.probs, ref)


def test_top_f_roots_exclude_the_drafted_token():
    """Outcome a < k: the likeliest F_a tokens other than d_{a+1}; the bonus outcome k: the likeliest F_k."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    window = logits[:3].argmax(-1).tolist()  # the drafts were each position's argmax
    window[1] = int(logits[1].argsort()[-3])  # one was not (a sampled draft): its third likeliest token
    roots = top_f_roots(logits, window, [2, 3, 1, 4])
    order = logits.argsort(dim=-1, descending=True).tolist()
    for a, (row, f) in enumerate(zip(order, [2, 3, 1, 4])):
        expect = [t for t in row if a == 3 or t != window[a]][:f]
        assert roots[a] == expect
        assert a == 3 or window[a] not in roots[a]


@pytest.mark.parametrize("model,block_size,padded", [(*CASES[0], False), (*CASES[1], True)])
def test_roots_chosen_from_the_window_logits(tiny_drafts, one_thread, model, block_size, padded):
    """choose_roots (speculation ahead's tree mode): a first forward feeds the windows alone, and the roots chosen
    from its logits give the branches that the same roots given up front give (one more forward, the same KV
    nowhere but the scratch slots). The window is led by the prefix's last token, so its logits cover every outcome;
    nothing hangs off the prefix's end."""
    runner = tree_runner(tiny_drafts[model].path, block_size)
    if padded:  # two layouts in one draft: the windows alone, then the whole trees
        padded_tree_forwards(runner)
    prefixes = random_prompts([13, 20], seed=15)
    windows = [[7, 20, 21, 22], [9, 40, 41]]  # [c, d_1..d_k]
    fans = [[2, 1, 1, 2], [1, 2, 2]]
    depth = 3
    seen: list[list[torch.Tensor]] = []

    def choose(logits: list[torch.Tensor]) -> list[list[list[int]]]:
        seen.append(logits)
        return [[[], *top_f_roots(x, w[1:], f)] for x, w, f in zip(logits, windows, fans)]

    nodes = [num_tree_nodes(len(w), sum(f), depth) for w, f in zip(windows, fans)]
    reqs = [_request(runner, 1 + 16 * i, p, w, [], depth, SCRATCH_FIRST + 12 * i, seed=i)
            for i, (p, w) in enumerate(zip(prefixes, windows))]
    for i, (r, n) in enumerate(zip(reqs, nodes)):  # _request sized the slots for no roots: enough for all of them
        first = (SCRATCH_FIRST + 12 * i) * block_size
        r.scratch_slots = [list(range(first, first + n))] * len(runner.kv_groups)
    chosen = draft_tree(runner, reqs, depth, choose_roots=choose)
    assert len(seen) == 1 and [x.shape[0] for x in seen[0]] == [4, 3]
    for r, tree in zip(reqs, chosen):
        r.roots = [[], *[[t for a, t in zip(tree.outcome, tree.root) if a == j] for j in range(1, len(r.window) + 1)]]
    given = draft_tree(runner, reqs, depth)
    # The same roots picked on the device (root_fanouts: the layout loaded once, no host round trip between the
    # window's forward and the branches') give the same tree.
    on_device = draft_tree(runner, reqs, depth, root_fanouts=fans)
    for c, d in zip(chosen, on_device):
        assert d.root == c.root and d.outcome == c.outcome
        assert torch.equal(d.tokens, c.tokens)
        torch.testing.assert_close(d.logits, c.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d.window_logits, c.window_logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="root_fanouts"):
        draft_tree(runner, reqs, depth, root_fanouts=[f[:-1] for f in fans])
    with pytest.raises(ValueError, match="give one"):
        draft_tree(runner, reqs, depth, choose_roots=choose, root_fanouts=fans)
    for c, g, w, f in zip(chosen, given, windows, fans):
        assert c.root == g.root and len(c.root) == sum(f) and all(a >= 1 for a in c.outcome)
        assert torch.equal(c.tokens, g.tokens)
        torch.testing.assert_close(c.logits, g.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c.window_logits, g.window_logits, atol=1e-5, rtol=1e-5)
        for a in range(1, len(w)):  # a rejection's roots never hold the rejected draft
            assert w[a] not in [t for o, t in zip(c.outcome, c.root) if o == a]
