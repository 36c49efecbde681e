"""Attention metadata: built once per step, one entry per KV-cache group, passed down to every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.kv_cache.block_pool import NULL_BLOCK

if TYPE_CHECKING:
    from engine.attention.tree_metadata import TreeAttentionMetadata


@dataclass
class DenseQueryLayout:
    """The torch reference backend's view of the queries: one padded row per request."""

    query_index: torch.Tensor  # [num_reqs, max_query_len] int64; flat token index, padding -> 0
    query_valid: torch.Tensor  # [num_reqs, max_query_len] bool
    query_positions: torch.Tensor  # [num_reqs, max_query_len] int64; padding -> -1


@dataclass
class CommonAttentionMetadata:
    """Query layout of the step, shared by every KV-cache group.

    Tokens of all requests are flattened; request i owns tokens query_start_loc[i]:query_start_loc[i+1],
    which sit at positions seq_lens[i] - query_len .. seq_lens[i] - 1 of its sequence. On the kernel path
    these are views into the runner's input buffers (fixed addresses that CUDA graphs read); requests with
    no query tokens and tokens past query_start_loc[num_reqs] are padding.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32 (kernel path) or int64 (torch path)
    seq_lens: torch.Tensor  # [num_reqs] int32 or int64; KV length after this step's tokens are stored
    positions: torch.Tensor  # [num_tokens] int64
    num_reqs: int
    num_tokens: int
    max_query_len: int  # upper bound; sizes the kernel grid
    max_seq_len: int  # upper bound
    dense: DenseQueryLayout | None = None  # torch backend only


@dataclass
class GroupAttentionMetadata:
    """Where one KV-cache group's keys and values live for this step."""

    group_id: int
    block_table: torch.Tensor  # [num_reqs, max_num_blocks] int64 (int32 on the kernel path); NULL_BLOCK for released
    slot_mapping: torch.Tensor  # [num_tokens] int64; flat slot (block * block_size + offset); -1: padding token
    sliding_window: int | None
    block_size: int
    # Backend-private tensors derived from the above (e.g. the torch backend's mask), built by the
    # first layer of the group that needs them and reused by the group's other layers this step.
    cache: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    common: CommonAttentionMetadata
    groups: list[GroupAttentionMetadata]  # [num_kv_groups], indexed by group id
    backend: str = "torch"  # "torch" (reference, any device) | "triton" (engine/kernels, CUDA graphs)
    # A forward over trees of branches (engine/attention/tree_metadata.py): the groups' block tables are then each
    # tree's committed prefix and their slot mappings the rows' scratch slots. None: the ordinary layout.
    tree: TreeAttentionMetadata | None = None


def build_common_metadata(query_lens: list[int], seq_lens: list[int], device: torch.device
                          ) -> CommonAttentionMetadata:
    """Query layout from per-request (new tokens, total KV length after the step)."""
    num_reqs = len(query_lens)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    max_q = max(query_lens)
    positions: list[int] = []
    q_index = torch.zeros(num_reqs, max_q, dtype=torch.int64)
    q_valid = torch.zeros(num_reqs, max_q, dtype=torch.bool)
    q_pos = torch.full((num_reqs, max_q), -1, dtype=torch.int64)
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(s - q, s)
        positions.extend(range(s - q, s))
        q_index[i, :q] = torch.arange(qsl[i], qsl[i + 1])
        q_valid[i, :q] = True
        q_pos[i, :q] = pos
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        num_reqs=num_reqs, num_tokens=qsl[-1], max_query_len=max_q, max_seq_len=max(seq_lens),
        dense=DenseQueryLayout(q_index.to(device), q_valid.to(device), q_pos.to(device)))


def build_group_metadata(group_id: int, block_tables: list[list[int]], query_lens: list[int],
                         seq_lens: list[int], block_size: int, sliding_window: int | None,
                         device: torch.device) -> GroupAttentionMetadata:
    """Block table and slot mapping of one group. Every new token gets a slot in its own block; a
    request's block table must already cover its seq_len (the KV manager allocated it)."""
    num_reqs = len(block_tables)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    table = torch.full((num_reqs, max_blocks), NULL_BLOCK, dtype=torch.int64)
    slots: list[int] = []
    for i, (bt, q, s) in enumerate(zip(block_tables, query_lens, seq_lens)):
        n = min(len(bt), max_blocks)
        table[i, :n] = torch.tensor(bt[:n], dtype=torch.int64)
        for p in range(s - q, s):
            blk = bt[p // block_size]
            if blk == NULL_BLOCK:
                raise RuntimeError(f"position {p} maps to a released block in group {group_id}")
            slots.append(blk * block_size + p % block_size)
    return GroupAttentionMetadata(
        group_id=group_id, block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        sliding_window=sliding_window, block_size=block_size)
