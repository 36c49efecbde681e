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

import numpy as np
import torch

from engine.host_copy import tensor_to_device


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


class TreeNodes:
    """Every node of a batch of trees, on the host, computed once per layout (not once per forward): each tree's
    parents, each node's position and scratch slots, and which nodes each node sees. A forward then feeds some of
    the nodes (`metadata`, or a CUDA graph's buffers: engine/runner/tree_graphs.py) without walking the trees again.

    parents[t]: every node of tree t, fed or not, in an order where parents come first (-1: the prefix's end);
    slots[t]: [num_kv_groups][num_nodes] flat scratch slots."""

    def __init__(self, prefix_lens: list[int], parents: list[list[int]], slots: list[list[list[int]]]) -> None:
        num_trees = len(parents)
        self.num_groups = len(slots[0]) if slots else 0
        self.prefix_lens = np.asarray(prefix_lens, dtype=np.int64)  # [num_trees]
        self.num_nodes = np.fromiter((len(p) for p in parents), dtype=np.int64, count=num_trees)  # [num_trees]
        n = max(int(self.num_nodes.max(initial=0)), 1)
        par = np.full((num_trees, n), -1, dtype=np.int64)  # [num_trees, max_nodes]; padding -> -1
        self.node_slots = np.zeros((self.num_groups, num_trees, n), dtype=np.int64)  # [groups, trees, max_nodes]
        for t, p in enumerate(parents):
            m = len(p)
            par[t, :m] = p
            if len(slots[t]) != self.num_groups or any(len(s) != m for s in slots[t]):
                raise ValueError(f"tree {t}: {m} nodes need one scratch slot each in each of {self.num_groups} "
                                 "group(s)")
            self.node_slots[:, t, :m] = slots[t]
        idx = np.arange(n)
        valid = idx[None, :] < self.num_nodes[:, None]  # [num_trees, max_nodes]
        if (valid & (par >= idx[None, :])).any():
            t, i = map(int, np.argwhere(valid & (par >= idx[None, :]))[0])
            raise ValueError(f"tree {t}: node {i}'s parent {int(par[t, i])} is not an earlier node")
        # Walk every node's chain up at once, one level a pass: seen[t, i, j] iff j is i or an ancestor of i.
        seen = np.zeros((num_trees, n, n), dtype=bool)  # [num_trees, max_nodes, max_nodes]
        depth = np.zeros((num_trees, n), dtype=np.int64)  # [num_trees, max_nodes]; 0: a child of the prefix's end
        tt = np.broadcast_to(np.arange(num_trees)[:, None], (num_trees, n))
        ii = np.broadcast_to(idx[None, :], (num_trees, n))
        cur = np.where(valid, ii, -1)
        while (cur >= 0).any():
            on = cur >= 0
            seen[tt[on], ii[on], cur[on]] = True
            cur = np.where(on, par[tt, np.maximum(cur, 0)], -1)
            depth += cur >= 0
        self.seen = seen
        # [num_trees, max_nodes]; padding -> -1
        self.node_positions = np.where(valid, depth + self.prefix_lens[:, None], -1)

    def fed(self, rows: list[list[int]], width: int | None = None) -> FedRows:
        """The rows of one forward feeding rows[t] of tree t, padded to `width` rows a tree (None: the longest)."""
        if len(rows) != len(self.prefix_lens):
            raise ValueError(f"{len(rows)} row lists for {len(self.prefix_lens)} trees")
        counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        width = max(int(counts.max(initial=0)), 1) if width is None else width
        node = np.full((len(rows), width), -1, dtype=np.int64)
        for t, r in enumerate(rows):
            node[t, :len(r)] = r
        valid = node >= 0
        t_idx = np.broadcast_to(np.arange(len(rows))[:, None], node.shape)
        safe = np.maximum(node, 0)
        return FedRows(counts=counts, valid=valid,
                       positions=np.where(valid, self.node_positions[t_idx, safe], -1),
                       visible=self.seen[t_idx, safe] & valid[:, :, None],
                       slots=np.where(valid, self.node_slots[:, t_idx, safe], -1))

    def metadata(self, fed: FedRows, device: torch.device) -> TreeAttentionMetadata:
        """The metadata of one forward feeding `fed` (its flat rows: tree 0's first, then tree 1's...)."""
        valid = fed.valid
        num_trees, width = valid.shape
        starts = np.concatenate([[0], np.cumsum(fed.counts)[:-1]])
        row_index = np.where(valid, starts[:, None] + np.arange(width)[None, :], 0)
        row_flat = (np.arange(num_trees * width).reshape(num_trees, width))[valid]
        # Built on the host, then queued behind the GPU's work (no sync: engine/host_copy.py).
        return TreeAttentionMetadata(
            row_index=_dev(row_index, device), row_valid=_dev(valid, device),
            row_positions=_dev(fed.positions, device), row_flat=_dev(row_flat, device),
            positions=_dev(fed.positions[valid], device), prefix_lens=_dev(self.prefix_lens, device),
            node_positions=_dev(self.node_positions, device), node_slots=_dev(self.node_slots, device),
            visible=_dev(fed.visible, device))


@dataclass
class FedRows:
    """The rows one forward feeds, tree by tree, padded to a width R (host NumPy; left-packed: a tree's real rows
    first). What both the eager metadata and the CUDA graphs' buffers (engine/runner/tree_graphs.py) are built from."""

    counts: np.ndarray  # [num_trees] int64; real rows of each tree
    valid: np.ndarray  # [num_trees, R] bool
    positions: np.ndarray  # [num_trees, R] int64; the row's sequence position, padding -> -1
    visible: np.ndarray  # [num_trees, R, max_nodes] bool; the row's ancestors and itself
    slots: np.ndarray  # [num_kv_groups, num_trees, R] int64; the row's scratch slot, padding -> -1


def _dev(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return tensor_to_device(torch.from_numpy(np.ascontiguousarray(a)), device)


def build_tree_metadata(prefix_lens: list[int], parents: list[list[int]], slots: list[list[list[int]]],
                        rows: list[list[int]], device: torch.device) -> TreeAttentionMetadata:
    """Metadata of one forward over several trees. Per tree t: parents[t] (every node of the tree, fed or not, in
    an order where parents come first), slots[t] ([num_kv_groups][num_nodes] flat scratch slots) and rows[t] (the
    nodes this forward feeds, in the order of its flattened rows: tree 0's rows first, then tree 1's...)."""
    nodes = TreeNodes(prefix_lens, parents, slots)
    return nodes.metadata(nodes.fed(rows), device)
