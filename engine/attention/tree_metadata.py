"""Tree attention metadata: query rows that belong to one request's tree of branches over its committed prefix.

A tree is the request's committed prefix (its KV in the request's own paged blocks, read in place) plus nodes: tokens
that hang off the prefix's end or off another node (`parents`). A node's KV lives in a scratch slot the caller gives
(one flat slot per node and KV-cache group); its position is the prefix length plus its depth. One forward feeds some
of the nodes as query rows (e.g. every branch's node at one depth); each row attends to the prefix (as far as its
group's sliding window reaches back from the row's own position) and to the nodes on its own parent chain, itself
included, never to another branch. Nodes not on a row's chain, fed in earlier forwards or not yet fed, are masked.

The per-group prefix block tables and the slots the rows' KV is stored to are the ordinary GroupAttentionMetadata
(one entry per KV-cache group: block_table [num_trees, max_blocks], slot_mapping [num_rows]); what is tree-specific is
here, with the KV-cache group as an explicit dimension of the node slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.host_copy import tensor_to_device, to_device


@dataclass
class TreeAttentionMetadata:
    """Where the rows of one forward sit in their trees (both attention backends read it)."""

    row_index: torch.Tensor  # [num_trees, max_rows] int64; flat row (token) index of the forward, padding -> 0
    row_valid: torch.Tensor  # [num_trees, max_rows] bool
    row_positions: torch.Tensor  # [num_trees, max_rows] int64; the row's sequence position, padding -> -1
    row_flat: torch.Tensor  # [num_rows] int64; each flat row's place in [num_trees * max_rows] (no masked select)
    positions: torch.Tensor  # [num_rows] int64; each flat row's sequence position
    prefix_lens: torch.Tensor  # [num_trees] int64; committed tokens in the request's own blocks
    node_positions: torch.Tensor  # [num_trees, max_nodes] int64; padding -> -1
    node_slots: torch.Tensor  # [num_kv_groups, num_trees, max_nodes] int64; flat scratch slot per group, padding -> 0
    visible: torch.Tensor  # [num_trees, max_rows, max_nodes] bool; the row's ancestors and itself (node order)


def ancestor_mask(parents: list[int]) -> list[list[bool]]:
    """[n][n]: node i sees node j iff j is i or one of its ancestors. parents[i] < i, or -1 (the prefix's end)."""
    seen: list[list[bool]] = []
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"node {i}'s parent {p} is not an earlier node")
        row = list(seen[p]) if p >= 0 else [False] * len(parents)
        row[i] = True
        seen.append(row)
    return seen


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node: 0 for a child of the prefix's end (it sits at position prefix_len)."""
    depths: list[int] = []
    for p in parents:
        depths.append(depths[p] + 1 if p >= 0 else 0)
    return depths


def build_tree_metadata(prefix_lens: list[int], parents: list[list[int]], slots: list[list[list[int]]],
                        rows: list[list[int]], device: torch.device) -> TreeAttentionMetadata:
    """Metadata of one forward over several trees. Per tree t: parents[t] (every node of the tree, fed or not, in
    an order where parents come first), slots[t] ([num_kv_groups][num_nodes] flat scratch slots) and rows[t] (the
    nodes this forward feeds, in the order of its flattened rows: tree 0's rows first, then tree 1's...)."""
    num_trees = len(parents)
    num_groups = len(slots[0]) if slots else 0
    max_rows = max((len(r) for r in rows), default=1)
    max_nodes = max((len(p) for p in parents), default=1)
    row_index = torch.zeros(num_trees, max_rows, dtype=torch.int64)
    row_valid = torch.zeros(num_trees, max_rows, dtype=torch.bool)
    row_pos = torch.full((num_trees, max_rows), -1, dtype=torch.int64)
    node_pos = torch.full((num_trees, max_nodes), -1, dtype=torch.int64)
    node_slots = torch.zeros(num_groups, num_trees, max_nodes, dtype=torch.int64)
    visible = torch.zeros(num_trees, max_rows, max_nodes, dtype=torch.bool)
    flat = 0
    row_flat: list[int] = []
    for t in range(num_trees):
        n = len(parents[t])
        seen = torch.tensor(ancestor_mask(parents[t]), dtype=torch.bool).view(n, n)
        pos = torch.tensor(node_depths(parents[t]), dtype=torch.int64) + prefix_lens[t]
        node_pos[t, :n] = pos
        if len(slots[t]) != num_groups or any(len(s) != n for s in slots[t]):
            raise ValueError(f"tree {t}: {n} nodes need one scratch slot each in each of {num_groups} group(s)")
        node_slots[:, t, :n] = torch.tensor(slots[t], dtype=torch.int64)
        r = torch.tensor(rows[t], dtype=torch.int64)
        m = len(rows[t])
        row_index[t, :m] = torch.arange(flat, flat + m)
        row_valid[t, :m] = True
        row_pos[t, :m] = pos[r]
        row_flat.extend(range(t * max_rows, t * max_rows + m))
        visible[t, :m, :n] = seen[r]
        flat += m
    # Built on the host, then queued behind the GPU's work (no sync: engine/host_copy.py).
    return TreeAttentionMetadata(
        row_index=tensor_to_device(row_index, device), row_valid=tensor_to_device(row_valid, device),
        row_positions=tensor_to_device(row_pos, device),
        row_flat=to_device(row_flat, torch.int64, device),
        positions=tensor_to_device(row_pos.view(-1)[row_flat], device),
        prefix_lens=to_device(prefix_lens, torch.int64, device),
        node_positions=tensor_to_device(node_pos, device), node_slots=tensor_to_device(node_slots, device),
        visible=tensor_to_device(visible, device))
