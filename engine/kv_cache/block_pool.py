"""A pool of fixed-size KV blocks for one KV-cache group: reference counts and a content-addressed cache.

A block is either referenced (its refcount counts the requests whose block tables hold it) or free. A free
block may still be *cached*: a full block whose KV belongs to a known token prefix (its block hash), kept so a
later request with the same prefix can take it instead of recomputing it. Free blocks wait in one queue that
is also the eviction order: blocks that cache nothing sit at the front and are handed out first; cached blocks
join the back when their last reference goes, so the least recently used cached block is the first one
evicted, and only when no block without content is left. (vLLM v1's free queue also evicts on demand in LRU
order; putting blocks without content first is this pool's own choice: they cost nothing to hand out.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

NULL_BLOCK = 0  # never handed out; block tables point here for released or padded entries


class BlockPool:
    """Block ids 1..num_blocks-1 with refcounts; block 0 is reserved as the null block, so a block table can
    keep its logical positions after a sliding window releases early blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV-cache group needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks  # the content a cached block holds
        self._cached: dict[bytes, int] = {}  # block hash -> the block that holds it
        # Unreferenced blocks in eviction order (front first); a dict for O(1) removal of a block a hit revives.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: unreferenced ones, cached or not (a cached one is evicted)."""
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used(self) -> int:
        """Referenced blocks; cached blocks nobody references count as free."""
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return self.num_used / self.num_usable

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n blocks without content, each with one reference; evicts cached blocks (LRU first) if it must."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:  # evict: nothing may find this block by its old content again
                del self._cached[h]
                self.block_hash[b] = None
                self.num_evictions += 1
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block. Give a request's table tail first: its last blocks are the least
        likely to be shared, so among cached blocks freed together they are evicted first."""
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"KV block {b} freed with no reference held")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None
                if self.block_hash[b] is None:  # holds nothing reusable: hand it out before any cached block
                    self._free.move_to_end(b, last=False)

    # --- the prefix cache ----------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this content, referenced or not; None if it is not cached."""
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one reference to each (cached) block of a prefix hit; an unreferenced one leaves the free queue."""
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def num_reviving(self, blocks: Iterable[int]) -> int:
        """How many of these blocks a touch would take out of the free queue (they count as free until then)."""
        return sum(1 for b in set(blocks) if b != NULL_BLOCK and self.ref_cnt[b] == 0)

    def cache_block(self, block: int, block_hash: bytes) -> None:
        """Record that a full, referenced block holds the KV of `block_hash`'s prefix. If another block already
        holds that content (two requests computed the same prefix at once), the first one stays the cached copy
        and this one is freed as an ordinary block later."""
        if self.ref_cnt[block] <= 0:
            raise RuntimeError(f"KV block {block} cached without a reference held")
        if self.block_hash[block] is not None or block_hash in self._cached:
            return
        self.block_hash[block] = block_hash
        self._cached[block_hash] = block
