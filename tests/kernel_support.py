"""Inputs for the Triton kernel tests (tests/test_kernels.py on CPU, tests/gpu/test_kernels_cuda.py on CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.tree_metadata import TreeAttentionMetadata, build_tree_metadata
from engine.sample.sampler import exponential_race


@dataclass
class AttentionCase:
    query: torch.Tensor  # [num_tokens + padding, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]; block 0 is the null block
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    max_query_len: int
    scale: float
    sliding_window: int | None

    def args(self, out: torch.Tensor, kv_cache: torch.Tensor | None = None) -> tuple:
        kv = self.kv_cache if kv_cache is None else kv_cache
        return (self.query, kv[0], kv[1], out, self.query_start_loc, self.seq_lens, self.block_table, self.scale,
                self.sliding_window, self.max_query_len)

    @property
    def num_valid_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def attention_case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, query_lens: list[int],
                   context_lens: list[int], sliding_window: int | None, dtype: torch.dtype, device: str = "cpu",
                   seed: int = 0, padding_tokens: int = 3, extra_blocks: int = 2) -> AttentionCase:
    """Requests with the given query lengths after cached prefixes of the given lengths (q_len 0: a padding
    request, which the kernel must skip). Blocks are shuffled over the cache and unused blocks hold large
    values, so a read of a wrong block shows; block-table entries past a request's length are null."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + extra_blocks
    num_blocks = 1 + sum(blocks_per_req) + 4
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 50
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        table[i, :n] = order[used:used + n]
        used += n
    kv[:, order[:used]] /= 50  # blocks in use: N(0, 1); the others stay large
    kv[:, 0] = 0  # null block
    kv = kv.to(dtype)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1] + padding_tokens, num_heads, head_dim, generator=g).to(dtype)
    return AttentionCase(query.to(device), kv.to(device), torch.tensor(qsl, dtype=torch.int32, device=device),
                         torch.tensor(seq_lens, dtype=torch.int32, device=device), table.to(device),
                         max(query_lens), head_dim ** -0.5, sliding_window)


def poison_outside_window(case: AttentionCase) -> torch.Tensor:
    """A copy of the cache whose keys/values before every request's earliest window start are NaN and whose
    block-table entries entirely before it are released (null), as a sliding-window group frees them. A
    kernel that reads any of them returns NaN."""
    kv = case.kv_cache.clone()
    block_size = kv.shape[2]
    starts = case.query_start_loc.tolist()
    for i, seq_len in enumerate(case.seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        first_visible = seq_len - q_len - case.sliding_window + 1  # of the request's first query token
        if q_len == 0 or first_visible <= 0:
            continue
        pos = torch.arange(first_visible, device=kv.device)
        kv[:, case.block_table[i, pos // block_size].long(), pos % block_size] = float("nan")
        case.block_table[i, :first_visible // block_size] = 0
    kv[:, 0] = 0
    return kv


@dataclass
class RejectionCase:
    draft_token_ids: torch.Tensor  # [num_reqs, max_k] int64
    num_draft_tokens: torch.Tensor  # [num_reqs] int64
    draft_probs: torch.Tensor | None  # [num_reqs, max_k, V] float32
    target_probs: torch.Tensor  # [num_reqs, max_k + 1, V]
    mode: str
    rate: float | None
    uniforms: torch.Tensor | None  # [num_reqs, max_k]
    exponentials: torch.Tensor | None  # [num_reqs, max_k + 1 or 1, V]

    def args(self) -> tuple:
        return (self.draft_token_ids, self.num_draft_tokens, self.draft_probs, self.target_probs, self.mode,
                self.rate, self.uniforms, self.exponentials)


def rejection_case(mode: str, num_reqs: int, max_k: int, vocab: int, noise: bool, seed: int = 0,
                   device: str = "cpu", ties: bool = False, raw_logits: bool = False) -> RejectionCase:
    """Random peaked p and q; about half the drafts are the target's own tokens (so prefixes get accepted),
    the rest random. ties: p quantised to a few levels, so argmax ties are common. raw_logits: greedy
    scores with negative values (what the sampler passes for all-greedy strict/synthetic batches)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, max_k + 1, (num_reqs,), generator=g)
    p = torch.rand(num_reqs, max_k + 1, vocab, generator=g) ** 8
    p[torch.rand(p.shape, generator=g) < 0.3] = 0  # outside top-k / top-p
    if ties:
        p = (torch.rand(p.shape, generator=g) * 2).floor() + 1  # half the tokens share the maximum
    p = p / p.sum(-1, keepdim=True)
    if raw_logits:
        p = torch.randn(num_reqs, max_k + 1, vocab, generator=g) * 3 - 10
    q = torch.rand(num_reqs, max_k, vocab, generator=g) ** 8
    q = q / q.sum(-1, keepdim=True)
    # Every other request's draft puts half its mass on the target's top token: its residual max(0, p - q)
    # then peaks elsewhere, so sampling p instead of the residual after a rejection shows.
    top = torch.nn.functional.one_hot(p[:, :max_k].argmax(-1), vocab).float()
    q[::2] = 0.5 * q[::2] + 0.5 * top[::2]
    if max_k > 1:
        q[0, 1] = p[0, 1]  # p == q at a position: an all-zero residual there samples p
    exps = None
    if noise:
        positions = max_k + 1 if mode == "strict" else 1
        exps = torch.empty(num_reqs, positions, vocab).exponential_(generator=g)
        exps.clamp_(min=torch.finfo(torch.float32).tiny)
    own = exponential_race(p[:, :max_k], exps[:, :max_k] if (exps is not None and mode == "strict") else None)
    drafts = torch.where(torch.rand(num_reqs, max_k, generator=g) < 0.6, own,
                         torch.randint(0, vocab, (num_reqs, max_k), generator=g))
    if mode == "probabilistic" and max_k > 0:
        # Some drafts the draft model could not have sampled (q(x) = 0): accepted iff p(x) > 0.
        q[:, 0].scatter_(-1, drafts[:, :1], 0.0)
    drafts = torch.where(torch.arange(max_k) < k[:, None], drafts, -1)
    uniforms = torch.rand(num_reqs, max_k, generator=g) if mode != "strict" else None
    t = {"device": device}
    return RejectionCase(drafts.to(**t), k.to(**t), q.to(**t) if mode == "probabilistic" else None, p.to(**t), mode,
                         0.7 if mode == "synthetic" else None, None if uniforms is None else uniforms.to(**t),
                         None if exps is None else exps.to(**t))


@dataclass
class TreeCase:
    """One KV-cache group's view of a tree forward (engine/attention/tree_metadata.py) for the tree kernel."""

    query: torch.Tensor  # [num_rows, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]; block 0 is the null block
    block_table: torch.Tensor  # [num_trees, max_blocks] int32; the prefixes' blocks
    tree: TreeAttentionMetadata
    group_id: int
    scale: float
    sliding_window: int | None

    def args(self, out: torch.Tensor, kv_cache: torch.Tensor | None = None) -> tuple:
        kv = self.kv_cache if kv_cache is None else kv_cache
        t = self.tree
        return (self.query, kv[0], kv[1], out, self.block_table, t.row_index, t.row_positions, t.prefix_lens,
                t.node_positions, t.node_slots[self.group_id], t.visible, self.scale, self.sliding_window)


def random_parents(num_nodes: int, g: torch.Generator) -> list[int]:
    """A random tree: each node hangs off the prefix's end (-1) or an earlier node."""
    return [int(torch.randint(-1, i, (1,), generator=g)) for i in range(num_nodes)]


def tree_case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, prefix_lens: list[int],
              num_nodes: list[int], num_rows: list[int], sliding_window: int | None, dtype: torch.dtype,
              device: str = "cpu", seed: int = 0, num_groups: int = 2, group_id: int = 1) -> TreeCase:
    """Trees with the given prefix lengths, node counts and fed rows (the last num_rows[t] nodes of tree t, as a
    later depth's forward feeds them; the earlier nodes' KV is in their slots already). Prefix blocks are shuffled,
    scratch slots are a shuffled run of their own blocks, and `num_groups` groups get different slots (the kernel
    must read group `group_id`'s). Unused blocks hold large values, so a read of a wrong block or slot shows; with a
    window, prefix keys before every row's window are NaN and blocks wholly before it released (null), as a
    sliding-window group leaves them."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_tree = [-(-p // block_size) for p in prefix_lens]
    total_nodes = sum(num_nodes)
    scratch_blocks = -(-total_nodes // block_size)
    num_blocks = 1 + sum(blocks_per_tree) + num_groups * scratch_blocks + 3
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 50
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    table = torch.zeros(len(prefix_lens), max(blocks_per_tree + [1]) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_tree):
        table[i, :n] = order[used:used + n]
        used += n
    slots_per_group = []
    for _ in range(num_groups):
        blocks = order[used:used + scratch_blocks]
        used += scratch_blocks
        flat = (blocks[:, None] * block_size + torch.arange(block_size)).view(-1)
        slots_per_group.append(flat[torch.randperm(flat.numel(), generator=g)][:total_nodes].tolist())
    parents, slots, rows = [], [], []
    first = 0
    for n, m in zip(num_nodes, num_rows):
        parents.append(random_parents(n, g))
        slots.append([s[first:first + n] for s in slots_per_group])
        rows.append(list(range(n - m, n)))
        first += n
    kv[:, 0] = 0  # null block
    kv_in_use = kv[:, order[:used]] / 50  # N(0, 1); the rest stays large
    kv[:, order[:used]] = kv_in_use
    tree = build_tree_metadata(prefix_lens, parents, slots, rows, torch.device(device))
    if sliding_window is not None:
        for t, p in enumerate(prefix_lens):
            valid = tree.row_positions[t] >= 0
            first_visible = int(tree.row_positions[t][valid].min()) - sliding_window + 1 if valid.any() else 0
            if first_visible <= 0:
                continue
            pos = torch.arange(min(first_visible, p))
            kv[:, table[t, pos // block_size].long(), pos % block_size] = float("nan")
            table[t, :first_visible // block_size] = 0
        kv[:, 0] = 0
    query = torch.randn(sum(num_rows), num_heads, head_dim, generator=g).to(dtype)
    return TreeCase(query.to(device), kv.to(dtype).to(device), table.to(device), tree, group_id, head_dim ** -0.5,
                    sliding_window)


def check_sink_attention(case: AttentionCase, sinks: torch.Tensor, splits: int | None, tol: float,
                         min_effect: float | None = None) -> None:
    """The paged-attention kernel with attention sinks (GPT-OSS) against its reference within `tol`, keys outside a
    window poisoned; and the sinks must move the reference's output by more than `min_effect` somewhere (ten times
    the tolerance unless given), or a kernel that dropped them would pass."""
    from engine.kernels.attention import paged as paged_attention

    out, ref, plain = (torch.full_like(case.query, 7.0) for _ in range(3))
    paged_attention.paged_attention_ref(*case.args(ref), sinks=sinks)
    paged_attention.paged_attention_ref(*case.args(plain))
    kv = poison_outside_window(case) if case.sliding_window is not None else case.kv_cache
    paged_attention.paged_attention(*case.args(out, kv), num_kv_splits=splits, sinks=sinks)
    n = case.num_valid_tokens
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=tol, rtol=tol)
    assert (ref[:n].float() - plain[:n].float()).abs().max() > (10 * tol if min_effect is None else min_effect)
