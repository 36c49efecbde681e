"""Scratch KV blocks of the draft: where speculation ahead's extra branches write
(engine/speculation/ahead/branches.py).

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

Speculation ahead's tree mode (engine/speculation/ahead/tree.py) reserves blocks the same way but addresses them as
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


class ScratchReserve:
    """Indices 0..capacity-1 of a reserve (scratch blocks, or a tree's scratch slots) handed out by `take` until
    `reset` takes them all back. Unscoped (one engine's draft) they are handed out in order: every window drafted
    ahead lives until the next proposal, which consumes or drops them all. Scoped (a pooled draft serving several
    targets, serving/draft_pool/worker.py), each take is held under its scope (a target) and `release` gives back
    one scope's alone: the other targets' windows, for steps of theirs still to come, keep theirs."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._next = 0  # indices below it have been handed out since the last reset ...
        self._freed: list[int] = []  # ... and of those, these came back (released scopes)
        self._held: dict[str, list[int]] = {}  # scope -> the indices it holds

    @property
    def num_used(self) -> int:
        return self._next - len(self._freed)

    def held(self, scope: str) -> int:
        return len(self._held.get(scope, ()))

    def reset(self) -> None:
        self._next, self._freed, self._held = 0, [], {}

    def take(self, n: int, scope: str | None = None) -> list[int] | None:
        """n free indices (held under `scope` where one is given), or None when fewer are left."""
        if len(self._freed) + self.capacity - self._next < n:
            return None
        reused = min(n, len(self._freed))  # released indices first, then fresh ones
        idx = self._freed[len(self._freed) - reused:]
        del self._freed[len(self._freed) - reused:]
        idx += range(self._next, self._next + n - reused)
        self._next += n - reused
        if scope is not None:
            self._held.setdefault(scope, []).extend(idx)
        return idx

    def release(self, scopes: set[str]) -> None:
        """Give back what these scopes hold; once no scope holds anything the reserve starts over in order."""
        for s in scopes:
            self._freed.extend(self._held.pop(s, ()))
        if not self._held:
            self.reset()


class ScratchBlocks:
    """The reserved ids, handed out by `fork` and taken back by `reset` (all) or `release` (a scope's: the windows of
    one target of a pooled draft, ScratchReserve)."""

    def __init__(self, ids: list[list[int]]) -> None:
        self.ids = ids  # [num_groups][capacity] scratch block ids (the same ids in every group)
        self.reserve = ScratchReserve(len(ids[0]) if ids else 0)

    @property
    def capacity(self) -> int:
        return self.reserve.capacity

    @property
    def num_used(self) -> int:
        return self.reserve.num_used

    def reset(self) -> None:
        self.reserve.reset()

    def release(self, scopes: set[str]) -> None:
        self.reserve.release(scopes)

    def fork(self, tables: list[list[int]], first_pos: int, last_pos: int, block_size: int,
             scope: str | None = None) -> tuple[ScratchFork, list[list[int]]] | None:
        """A branch of the request with these tables ([num_groups][num_blocks]) that writes positions
        [first_pos, last_pos]: its scratch blocks and its own tables. None when the reserve is used up or the
        request's tables do not cover the positions (its own blocks must be there for a hit's copy back). scope:
        what holds the blocks until it is released (None: until the next reset)."""
        first, last = first_pos // block_size, last_pos // block_size
        n = last - first + 1
        if any(len(t) <= last for t in tables):
            return None
        idx = self.reserve.take(n, scope)
        if idx is None:
            return None
        blocks = [[g_ids[i] for i in idx] for g_ids in self.ids]
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
