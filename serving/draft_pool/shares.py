"""How a pooled draft group's KV blocks are split between the target engines it serves (serving/draft_pool/pool.py).

A draft group shared by several targets has one block pool per KV-cache group on each rank, but every target's
router schedules the draft's blocks itself, with its own KV manager, as it does for a draft of its own. So that no
router needs to know of the others, the pool is cut into `slots` disjoint ranges of equal size, one per attached
target: a router's manager hands out the local ids 1..blocks_per_slot (0 stays the null block), and the draft's
ranks add the slot's offset to every id of that target's plans before anything reads them. Two targets can then
never write each other's blocks, and a target's prefix cache only ever finds its own blocks.

    global ids:   0 | slot 0: 1 .. B | slot 1: B+1 .. 2B | ... | slot S-1: (S-1)B+1 .. SB | (left over, unused)
    local ids:    0 | 1 .. B (every slot)

The same ids in every KV-cache group: each group of a draft has the same number of blocks (engine/kv_cache).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.block_pool import NULL_BLOCK


@dataclass(frozen=True)
class BlockShare:
    """One target's range of a pooled draft's blocks."""

    slot: int
    blocks_per_slot: int  # usable blocks of the share (its local ids are 1..blocks_per_slot)

    @property
    def offset(self) -> int:
        """What is added to a local id to make the global one."""
        return self.slot * self.blocks_per_slot

    @property
    def num_blocks(self) -> int:
        """What the target's KV manager is built with: its usable blocks plus the null block."""
        return self.blocks_per_slot + 1

    def to_global(self, block_ids: list[int]) -> list[int]:
        """A block table (or a table's tail) in local ids, as the pool's ranks address the blocks."""
        off = self.offset
        return [b if b == NULL_BLOCK else b + off for b in block_ids]


def blocks_per_slot(num_blocks: int, slots: int) -> int:
    """Usable blocks of each of `slots` equal shares of a pool of `num_blocks` ids (the null block included)."""
    if slots < 1:
        raise ValueError(f"a draft pool needs at least one target slot, got {slots}")
    return (num_blocks - 1) // slots


def check_share_fits(num_blocks: int, slots: int, block_size: int, max_model_len: int) -> int:
    """The blocks of one share; ValueError, with every number, where a share cannot hold one request of
    max_model_len (such a request could never be drafted for)."""
    per = blocks_per_slot(num_blocks, slots)
    need = -(-max_model_len // block_size)
    if per < need:
        raise ValueError(
            f"the draft pool's KV cache ({num_blocks - 1} usable blocks of {block_size} tokens) split between "
            f"{slots} target engines leaves {per} blocks each, but one request of max_model_len={max_model_len} "
            f"needs {need}; attach fewer targets to each draft replica (raise draft_replicas), lower "
            f"max_model_len, or give the draft more KV memory")
    return per
