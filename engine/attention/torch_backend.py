"""Reference attention over the paged KV cache in plain torch (CPU and GPU).

One code path serves prefill, chunked prefill, decode and multi-token verify queries: each request's
keys are gathered from its block table into a dense [max_seq_len] window and a boolean mask applies
causality, the request's length and the sliding window. Attention sinks (GPT-OSS: one learned logit per query head
that joins the softmax's denominator and attends to no value) take an explicit softmax instead of SDPA, which has
no such term. A forward over trees of branches
(engine/attention/tree_metadata.py) takes `tree_attention` instead: each tree's prefix keys, then its nodes' keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import CommonAttentionMetadata, GroupAttentionMetadata
from engine.attention.tree_metadata import TreeAttentionMetadata


def store_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; key/value: [num_tokens, heads, dim]."""
    nb, bs, h, d = kv_cache.shape[1:]
    keep = slot_mapping >= 0
    if not bool(keep.all()):  # SYNC: the reference path only; padding rows (slot -1) store nothing, as on the kernels'
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    kv_cache[0].view(nb * bs, h, d).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(nb * bs, h, d).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def attention_mask(common: CommonAttentionMetadata, group: GroupAttentionMetadata) -> torch.Tensor:
    """[num_reqs, 1, max_query_len, max_num_blocks * block_size] bool: True where a query sees a key."""
    cached = group.cache.get("torch_mask")
    if cached is not None:
        return cached
    num_keys = group.block_table.shape[1] * group.block_size
    k_pos = torch.arange(num_keys, device=common.dense.query_positions.device)[None, None, :]
    q_pos = common.dense.query_positions[:, :, None]
    mask = (k_pos <= q_pos) & (k_pos < common.seq_lens[:, None, None])
    if group.sliding_window is not None:
        mask &= k_pos > q_pos - group.sliding_window
    # Padded query rows see key 0 so softmax stays finite; their outputs are dropped.
    mask[:, :, 0] |= ~common.dense.query_valid
    mask = mask[:, None]
    group.cache["torch_mask"] = mask
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """q: [b, heads, rows, dim], k/v: [b, kv_heads, keys, dim], mask: [b, 1, rows, keys] bool -> [b, heads, rows, dim].
    SDPA without sinks; with sinks ([heads]) the sink logit is one more column of the softmax, dropped after it."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # [b, heads, rows, keys] fp32
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return (probs @ v.float()).to(q.dtype)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, common: CommonAttentionMetadata,
                    group: GroupAttentionMetadata, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]; sinks: [num_heads] or None."""
    r, mb = group.block_table.shape
    _, _, bs, h_kv, d = kv_cache.shape
    k = kv_cache[0][group.block_table].view(r, mb * bs, h_kv, d).transpose(1, 2)
    v = kv_cache[1][group.block_table].view(r, mb * bs, h_kv, d).transpose(1, 2)
    q = query[common.dense.query_index].transpose(1, 2)  # [num_reqs, heads, max_query_len, dim]
    out = attend(q.to(k.dtype), k, v, attention_mask(common, group), scale, sinks)
    out = out.transpose(1, 2)  # [num_reqs, max_query_len, heads, dim]
    return out[common.dense.query_valid].to(query.dtype)


def tree_mask(tree: TreeAttentionMetadata, group: GroupAttentionMetadata) -> torch.Tensor:
    """[num_trees, 1, max_rows, max_num_blocks * block_size + max_nodes] bool: the prefix's keys, then the nodes'.
    A row sees the committed prefix and its own chain of nodes (never a sibling branch), each only within the
    group's sliding window counted back from the row's own position."""
    cached = group.cache.get("torch_tree_mask")
    if cached is not None:
        return cached
    num_keys = group.block_table.shape[1] * group.block_size
    k_pos = torch.arange(num_keys, device=tree.row_positions.device)[None, None, :]
    q_pos = tree.row_positions[:, :, None]
    prefix = (k_pos < tree.prefix_lens[:, None, None]).expand(-1, q_pos.shape[1], -1)
    nodes = tree.visible
    if group.sliding_window is not None:
        prefix = prefix & (k_pos > q_pos - group.sliding_window)
        nodes = nodes & (tree.node_positions[:, None, :] > q_pos - group.sliding_window)
    mask = torch.cat([prefix, nodes], dim=2)
    # Padded rows see key 0 so softmax stays finite; their outputs are dropped.
    mask[:, :, 0] |= ~tree.row_valid
    mask = mask[:, None]
    group.cache["torch_tree_mask"] = mask
    return mask


def tree_attention(query: torch.Tensor, kv_cache: torch.Tensor, tree: TreeAttentionMetadata,
                   group: GroupAttentionMetadata, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query: [num_rows, num_heads, head_dim] -> the same shape. Keys: each tree's prefix gathered from its block
    table in place, then its nodes' scratch slots (the rows' own KV is already stored there)."""
    t, mb = group.block_table.shape
    _, nb, bs, h_kv, d = kv_cache.shape
    slots = tree.node_slots[group.group_id]  # [num_trees, max_nodes]

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [num_trees, h_kv, mb * bs + max_nodes, d]
        prefix = cache[group.block_table].view(t, mb * bs, h_kv, d)
        nodes = cache.view(nb * bs, h_kv, d)[slots]
        return torch.cat([prefix, nodes], dim=1).transpose(1, 2)

    k, v = gather(kv_cache[0]), gather(kv_cache[1])
    q = query[tree.row_index].transpose(1, 2)  # [num_trees, heads, max_rows, dim]
    out = attend(q.to(k.dtype), k, v, tree_mask(tree, group), scale, sinks)
    out = out.transpose(1, 2).reshape(-1, *query.shape[1:])  # [num_trees * max_rows, heads, dim]
    return out[tree.row_flat].to(query.dtype)
