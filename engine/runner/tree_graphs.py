"""CUDA graphs of tree forwards (speculation ahead's tree mode: engine/speculation/ahead/tree_draft.py), one per (trees,
rows a tree) bucket.

Eager, a tree forward of a 0.6B draft costs the host one launch per kernel, about 3 ms, and a tree is k + 1 such
forwards: longer than the target's verify it hides behind, so the ahead budget skipped the trees. A graph replays
the same forward in one launch.

Layout: a graph of bucket (T, R) feeds T trees of R rows each, padded: tree t's row r is flat row t x R + r, every
row past a tree's real ones is padding (position -1, KV slot -1: the attention kernels skip it, nothing is stored).
Its logits are every flat row's; the real rows are gathered out in the eager forward's order (tree 0's rows first).
The tree kernel's grid depends only on host ints (the number of trees, R, the nodes a tree may have and the width of
the block tables, all fixed per bucket), every length and mask is read from the device, so one graph runs any
batch of trees that fits its bucket.

Buffers sit at fixed addresses: the metadata of a batch's nodes (prefix lengths, node positions and scratch slots,
block tables, per KV-cache group) is written once per batch (`load_nodes`), what changes from forward to forward
(the rows fed, their positions, slots and masks, the input ids) once per forward (`run`). Graphs are captured
largest first into a memory pool of their own, so their logits stay apart from the proposal's, which the draft
loop's graphs return.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata, CommonAttentionMetadata, GroupAttentionMetadata
from engine.attention.tree_metadata import TreeAttentionMetadata, TreeNodes
from engine.kv_cache.block_pool import NULL_BLOCK
from engine.kv_cache.spec import KVCacheGroupSpec
from engine.runner.cuda_graphs import GraphPool, no_gc_while_capturing
from engine.runner.input_buffers import update_block_table_row
from engine.runner.step_input import StepInput

logger = logging.getLogger("specserve")


def tree_row_buckets(window: int, max_rows: int) -> list[int]:
    """Rows-a-tree buckets: powers of two up to max_rows and max_rows itself, and `window` (the k + 1 rows of a
    forward that feeds each tree's window)."""
    sizes = {window, max_rows} | {1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows}
    return sorted(s for s in sizes if 1 <= s <= max_rows)


class TreeGraphs:
    """Padded static buffers of tree forwards and their graphs (or, with capture off, the same padded forward run
    eagerly: what CPU tests check the layout with)."""

    def __init__(self, groups: list[KVCacheGroupSpec], forward: Callable[[StepInput], torch.Tensor],
                 tree_counts: list[int], row_buckets: list[int], max_nodes: int, max_total_rows: int,
                 max_blocks: int, backend: str, device: torch.device) -> None:
        """forward: logits of every row [T x R, V] float32; tree_counts / row_buckets: the T and R buckets (a graph
        for each pair whose T x R <= max_total_rows); max_nodes: nodes a tree may have; max_blocks: block-table
        width."""
        self.groups, self.forward, self.backend, self.device = groups, forward, backend, device
        self.keys = sorted((t, r) for t in set(tree_counts) for r in set(row_buckets) if t * r <= max_total_rows)
        self._key_set = set(self.keys)
        self.tree_counts = sorted({t for t, _ in self.keys})
        self.row_buckets = sorted({r for _, r in self.keys})
        self.max_trees = max(self.tree_counts, default=0)
        self.max_nodes = max_nodes
        self.max_blocks = max_blocks
        flat = max((t * r for t, r in self.keys), default=0)
        g, tm, n, i64 = len(groups), self.max_trees, max_nodes, torch.int64
        self._dev = {  # device buffers; the 2-D/3-D ones flat, viewed per bucket, so each bucket's part is a prefix
            "input_ids": torch.zeros(flat, dtype=i64, device=device),  # [T x R] int64
            "positions": torch.zeros(flat, dtype=i64, device=device),  # [T x R] int64
            "slot_mappings": torch.full((g, flat), -1, dtype=i64, device=device),  # [groups, T x R] int64
            "row_positions": torch.full((flat,), -1, dtype=i64, device=device),  # [T x R] int64, padding -1
            "row_valid": torch.zeros(flat, dtype=torch.bool, device=device),  # [T x R] bool
            "visible": torch.zeros(flat * n, dtype=torch.bool, device=device),  # [T x R x max_nodes] bool
            "gather": torch.zeros(flat, dtype=i64, device=device),  # [T x R] int64; flat index of each real row
            "prefix_lens": torch.zeros(tm, dtype=i64, device=device),  # [max_trees] int64
            "node_positions": torch.full((tm * n,), -1, dtype=i64, device=device),  # [max_trees x max_nodes] int64
            "node_slots": torch.zeros(g, tm * n, dtype=i64, device=device),  # [groups, max_trees x max_nodes] int64
            "block_tables": torch.full((g, tm * max_blocks), NULL_BLOCK, dtype=i64,
                                       device=device),  # [groups, max_trees x max_blocks] int64
        }
        pin = device.type == "cuda"
        self._host = {k: (torch.zeros_like(v, device="cpu").pin_memory() if pin else torch.zeros_like(v, device="cpu"))
                      for k, v in self._dev.items()}
        self._np = {k: v.numpy() for k, v in self._host.items()}
        self._np["block_tables"][:] = NULL_BLOCK
        # [num_groups][max_trees] -> the prefix blocks the staging row of that tree slot holds (NULL_BLOCK after
        # them), so a load writes only what changed (input_buffers.update_block_table_row): a prefix grows by a
        # block every block_size tokens while it holds thousands at long context
        self._rows: list[list[list[int]]] = [[[] for _ in range(tm)] for _ in groups]
        # Per staging set (the batch's nodes, a forward's rows): when its last copies have read the pinned memory.
        # Two events, not one: a forward's rows must not wait for the nodes' copies, queued behind the forward
        # before it (a tree's first branch forward would otherwise wait for the whole window forward).
        self._uploaded = {"nodes": torch.cuda.Event(), "rows": torch.cuda.Event()} if pin else None
        # name -> [(device row, host row)] of each buffer, per group for the grouped ones (contiguous rows)
        self._pairs = {k: list(zip(v.view(-1, v.shape[-1]).unbind(0), self._host[k].view(-1, v.shape[-1]).unbind(0)))
                       for k, v in self._dev.items()}
        self._steps: dict[tuple[int, int], StepInput] = {}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: GraphPool | None = None
        self._nodes: TreeNodes | None = None
        self._num_trees = 0
        self.num_replays = 0

    # ---- shapes ---------------------------------------------------------------------------------------
    def bucket(self, num_trees: int, max_rows: int, max_nodes: int) -> tuple[int, int] | None:
        """The smallest (T, R) bucket holding this forward, or None (run it eagerly)."""
        if max_nodes > self.max_nodes:
            return None
        ti = bisect.bisect_left(self.tree_counts, num_trees)
        ri = bisect.bisect_left(self.row_buckets, max_rows)
        for t in self.tree_counts[ti:]:
            for r in self.row_buckets[ri:]:
                if (t, r) in self._key_set:
                    return t, r
        return None

    def _step(self, key: tuple[int, int]) -> StepInput:
        """The StepInput of bucket `key`: views of the buffers (what its graph reads)."""
        step = self._steps.get(key)
        if step is not None:
            return step
        t, r = key
        d, n, dev, nb = self._dev, self.max_nodes, self.device, self.max_blocks
        rows = torch.arange(t * r, dtype=torch.int64, device=dev)
        tree = TreeAttentionMetadata(
            row_index=rows.view(t, r), row_valid=d["row_valid"][:t * r].view(t, r),
            row_positions=d["row_positions"][:t * r].view(t, r), row_flat=rows, positions=d["positions"][:t * r],
            prefix_lens=d["prefix_lens"][:t], node_positions=d["node_positions"][:t * n].view(t, n),
            node_slots=d["node_slots"][:, :t * n].view(len(self.groups), t, n),
            visible=d["visible"][:t * r * n].view(t, r, n))
        common = CommonAttentionMetadata(
            query_start_loc=torch.arange(0, t * r + 1, r, dtype=torch.int64, device=dev), seq_lens=tree.prefix_lens,
            positions=tree.positions, num_reqs=t, num_tokens=t * r, max_query_len=r, max_seq_len=nb)
        groups = [GroupAttentionMetadata(group_id=g.group_id,
                                         block_table=d["block_tables"][g.group_id, :t * nb].view(t, nb),
                                         slot_mapping=d["slot_mappings"][g.group_id, :t * r],
                                         sliding_window=g.spec.sliding_window, block_size=g.spec.block_size)
                  for g in self.groups]
        step = StepInput(input_ids=d["input_ids"][:t * r], positions=tree.positions,
                         attn=AttentionMetadata(common=common, groups=groups, backend=self.backend, tree=tree),
                         logits_indices=rows, num_logits_per_req=[r] * t)
        self._steps[key] = step
        return step

    # ---- capture --------------------------------------------------------------------------------------
    def capture(self) -> None:
        """A graph per bucket, on padding only (no row valid, nothing stored), the largest first."""
        t0 = time.perf_counter()
        self.pool = GraphPool()
        with no_gc_while_capturing():
            for key in sorted(self.keys, key=lambda k: k[0] * k[1], reverse=True):
                step = self._step(key)
                self.graphs[key] = self.pool.capture(lambda step=step: self.forward(step))
            torch.cuda.synchronize(self.device)  # SYNC: start-up only
        logger.info("captured %d tree forward graphs (trees %s, rows a tree %s, %d nodes a tree) in %.1f s",
                    len(self.graphs), self.tree_counts, self.row_buckets, self.max_nodes, time.perf_counter() - t0)

    # ---- a batch of trees -----------------------------------------------------------------------------
    def load_nodes(self, nodes: TreeNodes, block_tables: list[list[list[int]]]) -> None:
        """Every node of a batch of trees (block_tables: [num_trees][num_kv_groups][blocks], each tree's prefix);
        the next `run`s feed rows of these trees."""
        num_trees, n_used = nodes.node_positions.shape
        if num_trees > self.max_trees or n_used > self.max_nodes:
            raise ValueError(f"{num_trees} trees of {n_used} nodes exceed the tree graphs' buffers")
        self._wait_for_upload("nodes")
        h, n, nb = self._np, self.max_nodes, self.max_blocks
        h["prefix_lens"][:num_trees] = nodes.prefix_lens
        pos = h["node_positions"][:num_trees * n].reshape(num_trees, n)
        pos[:] = -1
        pos[:, :n_used] = nodes.node_positions
        for g in self.groups:
            gid = g.group_id
            slots = h["node_slots"][gid, :num_trees * n].reshape(num_trees, n)
            slots[:] = 0
            slots[:, :n_used] = nodes.node_slots[gid]
            table = h["block_tables"][gid, :num_trees * nb].reshape(num_trees, nb)
            for t in range(num_trees):
                # Only the blocks that hold the prefix are read (a table may run a block past max_model_len).
                own = block_tables[t][gid][:-(-int(nodes.prefix_lens[t]) // g.spec.block_size)]
                if len(own) > nb:
                    raise ValueError(f"a prefix of {len(own)} blocks exceeds the tree graphs' {nb}")
                update_block_table_row(table[t], self._rows[gid][t], own, nb)
        h["prefix_lens"][num_trees:] = 0  # padding trees of a bucket: nothing of an earlier batch
        h["node_positions"][num_trees * n:] = -1
        self._copy("nodes", ["prefix_lens", "node_positions", "node_slots", "block_tables"],
                   [self.max_trees, self.max_trees * n, num_trees * n, num_trees * nb])
        self._nodes, self._num_trees = nodes, num_trees

    def run(self, key: tuple[int, int], rows: list[list[int]], feed: torch.Tensor) -> torch.Tensor:
        """One forward of bucket `key` feeding rows[t] of each loaded tree, with input ids `feed` ([sum of rows]
        int64, tree 0's first, on the device): logits [sum of rows, V] float32, in that order (a tensor of its own,
        not the graph's output)."""
        nodes = self._nodes
        if nodes is None or len(rows) != self._num_trees:
            raise ValueError("load_nodes first, with the trees these rows belong to")
        t_b, r_b = key
        fed = nodes.fed(rows, width=r_b)
        num_trees, num_real = len(rows), int(fed.counts.sum())
        if feed.shape[0] != num_real:
            raise ValueError(f"{feed.shape[0]} input ids for {num_real} rows")
        self._wait_for_upload("rows")
        h, n, tr = self._np, self.max_nodes, t_b * r_b
        # The bucket's trees past the batch's are padding: no row valid, nothing stored.
        pos = h["row_positions"][:tr].reshape(t_b, r_b)
        pos[:] = -1
        pos[:num_trees] = fed.positions
        valid = h["row_valid"][:tr].reshape(t_b, r_b)
        valid[:] = False
        valid[:num_trees] = fed.valid
        h["positions"][:tr] = np.maximum(pos, 0).reshape(-1)
        vis = h["visible"][:tr * n].reshape(t_b, r_b, n)
        vis[:] = False
        vis[:num_trees, :, :fed.visible.shape[2]] = fed.visible
        for g in self.groups:
            slots = h["slot_mappings"][g.group_id, :tr].reshape(t_b, r_b)
            slots[:] = -1
            slots[:num_trees] = fed.slots[g.group_id]
        h["gather"][:num_real] = np.flatnonzero(valid)
        self._copy("rows", ["row_positions", "row_valid", "positions", "visible", "slot_mappings", "gather"],
                   [tr, tr, tr, tr * n, tr, num_real])
        idx = self._dev["gather"][:num_real]
        step = self._step(key)
        step.input_ids.index_copy_(0, idx, feed.to(torch.int64))
        for g in step.attn.groups:
            g.cache.clear()  # derived tensors (the torch backend's masks) belong to one forward
        if key in self.graphs:
            graph, out = self.graphs[key]
            graph.replay()
            self.num_replays += 1
        else:
            out = self.forward(step)
        return out.index_select(0, idx)

    def _copy(self, staging: str, names: list[str], lengths: list[int]) -> None:
        """Queue host -> device copies of each buffer's first `length` entries (per group for the grouped ones), and
        mark when the copies of this staging set ("nodes" or "rows") have read it."""
        for name, length in zip(names, lengths):
            for d, s in self._pairs[name]:
                d[:length].copy_(s[:length], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded[staging].record()

    def _wait_for_upload(self, staging: str) -> None:
        # SYNC: only until the last copies from this staging set have read its pinned memory. A forward's rows were
        # queued behind the forward before it, so the host waits at most for that one while the GPU still has the
        # previous forward to run: the host stays a forward ahead, and its share of a forward (well under the GPU's)
        # is hidden. The nodes are staged apart, so the first forward over a new batch of nodes does not wait.
        if self._uploaded is not None:
            self._uploaded[staging].synchronize()
