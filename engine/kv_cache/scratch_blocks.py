"""Scratch KV blocks of the draft: where speculation ahead's extra branches write
(engine/speculation/ahead_branches.py).

Branches of one request write the same draft positions with different tokens, and a rejection branch overwrites
positions (the drafts after its rejection point) that the all-accepted window and the verify's other outcomes still
need. So only the request's all-accepted window writes its own blocks (it writes only positions after the last
draft, which no outcome reads before rewriting); every other branch runs in blocks the draft reserved for itself at
start-up (ModelRunner.reserve_kv_blocks: taken out of the blocks it reports to the scheduler, the same ids in every
KV-cache group).

A branch forks copy-on-write: its table is the request's own blocks before the block holding its first write, then
scratch blocks, the first a copy of the own block it replaces (that block's earlier positions hold valid KV: the
prefix and the accepted drafts). Earlier entries are shared read-only, NULL_BLOCK ones of a sliding-window group
included. On a hit the scratch blocks are copied back over the request's own (every layer of every KV-cache group),
so the draft's KV then holds exactly what drafting the window afresh would have written there.

Speculation ahead's tree mode (engine/speculation/tree_ahead.py) reserves blocks the same way but addresses them as
flat slots, one per tree node; `copy_slots` moves a hit branch's slots into the request's own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.host_copy import to_device
from engine.kv_cache.block_pool import NULL_BLOCK


def scratch_blocks_wanted(branches: int, max_num_seqs: int, max_k: int, block_size: int) -> int:
    """Scratch blocks (per group) for every branch beyond the first of a full batch: a branch writes at most
    max_k + 1 consecutive positions (a catch-up token, a guessed bonus token, max_k - 1 drafts), which span at most
    ceil(max_k / block_size) + 1 blocks."""
    return max(0, branches - 1) * max_num_seqs * (-(-max_k // block_size) + 1)


@dataclass
class ScratchFork:
    """One branch's scratch blocks and where they stand in its request's tables."""

    first_block: int  # logical index, in the request's tables, of the first block the scratch blocks replace
    blocks: list[list[int]]  # [num_groups][n] scratch ids standing for tables[g][first_block:first_block + n]


class ScratchBlocks:
    """The reserved ids, handed out in order by `fork` and all taken back by `reset` (every window drafted ahead
    lives until the next proposal, which consumes or drops them all)."""

    def __init__(self, ids: list[list[int]]) -> None:
        self.ids = ids  # [num_groups][capacity] scratch block ids (the same ids in every group)
        self._used = 0

    @property
    def capacity(self) -> int:
        return len(self.ids[0]) if self.ids else 0

    @property
    def num_used(self) -> int:
        return self._used

    def reset(self) -> None:
        self._used = 0

    def fork(self, tables: list[list[int]], first_pos: int, last_pos: int,
             block_size: int) -> tuple[ScratchFork, list[list[int]]] | None:
        """A branch of the request with these tables ([num_groups][num_blocks]) that writes positions
        [first_pos, last_pos]: its scratch blocks and its own tables. None when the reserve is used up or the
        request's tables do not cover the positions (its own blocks must be there for a hit's copy back)."""
        first, last = first_pos // block_size, last_pos // block_size
        n = last - first + 1
        if self._used + n > self.capacity or any(len(t) <= last for t in tables):
            return None
        blocks = [g_ids[self._used:self._used + n] for g_ids in self.ids]
        self._used += n
        return ScratchFork(first, blocks), [t[:first] + b for t, b in zip(tables, blocks)]


def copy_blocks(kv_caches: list[list[torch.Tensor]], src: list[list[int]], dst: list[list[int]]) -> None:
    """For every KV-cache group g, block dst[g][i] := block src[g][i] in every layer of the group. kv_caches:
    [num_groups][layers in group] tensors [2, num_blocks, block_size, num_kv_heads, head_dim]. Pairs with a
    NULL_BLOCK on either side are skipped (nothing is kept there). No destination may be a source."""
    for tensors, s, d in zip(kv_caches, src, dst):
        pairs = [(a, b) for a, b in zip(s, d) if a != NULL_BLOCK and b != NULL_BLOCK]
        if not pairs or not tensors:
            continue
        dev = tensors[0].device
        s_idx = to_device([a for a, _ in pairs], torch.int64, dev)
        d_idx = to_device([b for _, b in pairs], torch.int64, dev)
        for t in tensors:
            t.index_copy_(1, d_idx, t.index_select(1, s_idx))


def copy_slots(kv_caches: list[list[torch.Tensor]], src: list[list[int]], dst: list[list[int]]) -> None:
    """For every KV-cache group g, flat slot dst[g][i] := flat slot src[g][i] (block * block_size + offset) in every
    layer of the group: a tree branch's scratch slots into a request's own blocks (speculation ahead's tree mode).
    No destination may be a source."""
    for tensors, s, d in zip(kv_caches, src, dst):
        if not s or not tensors:
            continue
        dev = tensors[0].device
        s_idx = to_device(s, torch.int64, dev)
        d_idx = to_device(d, torch.int64, dev)
        for t in tensors:
            flat = t.view(2, t.shape[1] * t.shape[2], *t.shape[3:])
            flat.index_copy_(1, d_idx, flat.index_select(1, s_idx))
