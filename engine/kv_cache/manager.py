"""KV-cache manager of one model: a block pool and per-request block tables for every KV-cache group, and the
model's side of prefix caching (which prefixes its groups can supply, caching blocks once they are full)."""

from __future__ import annotations

from engine.kv_cache.block_pool import NULL_BLOCK, BlockPool
from engine.kv_cache.spec import KVCacheGroupSpec


class KVCacheManager:
    """Owns the blocks of one model (target or draft), group by group.

    Every group gets the same number of blocks: a sliding-window group never needs more blocks per
    request than a full-attention group, so the full group is always the one that runs out first and
    one budget check covers all groups. Block ids index each group's own KV tensors.

    With prefix caching, a request's table may start with blocks other requests hold too (refcounted in the
    pool). Those are always full blocks below the request's first computed position, so the model never writes
    them: a step writes only from the request's frontier on, which lies in a block of its own.
    """

    def __init__(self, groups: list[KVCacheGroupSpec], num_blocks: int, block_size: int,
                 enable_caching: bool = False) -> None:
        if not groups:
            raise ValueError("a model needs at least one KV-cache group")
        self.groups = groups
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pools = [BlockPool(num_blocks) for _ in groups]
        # request id -> per group, block ids by logical block index (NULL_BLOCK once released)
        self._tables: dict[str, list[list[int]]] = {}
        # request id -> blocks of its table already offered to the cache (same count in every group)
        self._num_cached: dict[str, int] = {}
        # request id -> per group, how many leading entries of its table are released (NULL_BLOCK): a sliding
        # window releases from the front, so each step scans only the blocks that left the window since the last
        # one, not the whole table (2048 entries a group at 32k tokens and block size 16)
        self._released: dict[str, list[int]] = {}
        # Prefix-cache counters in tokens, as vLLM counts them: tokens looked up at admission, and how many of
        # them this model could supply.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def _first_visible(self, group: KVCacheGroupSpec, num_computed: int) -> int:
        """First position a query at `num_computed` or later can see in this group."""
        window = group.spec.sliding_window
        return 0 if window is None else max(0, num_computed - window + 1)

    def _num_released(self, group: KVCacheGroupSpec, table: list[int], num_computed: int, start: int = 0) -> int:
        """Blocks of a sliding-window group that no query from position `num_computed` on can see and that are not
        released yet; the table's first `start` entries are released already."""
        n = min(self._first_visible(group, num_computed) // self.block_size, len(table))
        return sum(1 for b in table[start:n] if b != NULL_BLOCK)

    def _num_new_blocks(self, table: list[int], num_total_tokens: int) -> int:
        return max(0, -(-num_total_tokens // self.block_size) - len(table))

    def can_allocate(self, request_id: str, num_computed: int, num_total_tokens: int,
                     prefix: list[list[int]] | None = None) -> bool:
        """Whether KV for positions [num_computed, num_total_tokens) fits in every group. `prefix`: per group, the
        cached blocks a request without a table starts from (a prefix hit); reviving an unreferenced one uses up
        a free block too."""
        tables = self._tables.get(request_id) or prefix or [[] for _ in self.groups]
        released = self._released.get(request_id) or [0] * len(self.groups)
        for g, pool, table, start in zip(self.groups, self.pools, tables, released):
            need = self._num_new_blocks(table, num_total_tokens)
            if request_id not in self._tables and prefix is not None:
                need += pool.num_reviving(table)
            # The window's releases are counted only where the free blocks fall short (a decode step needs none,
            # or one of many free: that count, a scan of the table, was a step's largest KV cost a request).
            if need > pool.num_free and need > pool.num_free + self._num_released(g, table, num_computed, start):
                return False
        return True

    def allocate(self, request_id: str, num_computed: int, num_total_tokens: int,
                 prefix: list[list[int]] | None = None) -> None:
        """Make room for positions [num_computed, num_total_tokens); sliding groups release first. A request
        without a table starts from `prefix` (a prefix hit, see `prefix_blocks`) when one is given."""
        if not self.can_allocate(request_id, num_computed, num_total_tokens, prefix):
            raise RuntimeError(f"KV cache cannot hold {num_total_tokens} tokens of {request_id}")
        if request_id not in self._tables:
            self._tables[request_id] = [list(p) for p in prefix] if prefix else [[] for _ in self.groups]
            for pool, table in zip(self.pools, self._tables[request_id]):
                pool.touch(table)
            self._num_cached[request_id] = len(self._tables[request_id][0])
            self._released[request_id] = [0] * len(self.groups)
        tables = self._tables[request_id]
        released = self._released[request_id]
        for g, (group, pool, table) in enumerate(zip(self.groups, self.pools, tables)):
            if group.spec.sliding_window is not None:
                end = min(self._first_visible(group, num_computed) // self.block_size, len(table))
                for i in range(released[g], end):
                    if table[i] != NULL_BLOCK:
                        pool.free([table[i]])
                        table[i] = NULL_BLOCK
                released[g] = max(released[g], end)
            table.extend(pool.allocate(self._num_new_blocks(table, num_total_tokens)))

    def free(self, request_id: str) -> None:
        """Drop the request's references; its cached blocks stay cached until the pool needs them."""
        tables = self._tables.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        self._released.pop(request_id, None)
        if tables is None:
            return
        for pool, table in zip(self.pools, tables):
            pool.free(reversed(table))

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str, group_id: int) -> list[int]:
        return self._tables[request_id][group_id]

    def num_blocks_held(self, request_id: str, group_id: int) -> int:
        tables = self._tables.get(request_id)
        if tables is None:
            return 0
        return sum(1 for b in tables[group_id] if b != NULL_BLOCK)

    def usage(self, group_id: int) -> float:
        return self.pools[group_id].usage()

    def num_used_blocks(self) -> list[int]:
        return [p.num_used for p in self.pools]

    # --- prefix caching ------------------------------------------------------------------------------
    def valid_prefix_lengths(self, block_hashes: list[bytes], max_blocks: int) -> list[bool]:
        """[max_blocks + 1]: entry h says whether every group can supply the KV a request needs to start
        computing at position h * block_size, from cached blocks.

        A full-attention group needs all h blocks. A sliding-window group needs only the blocks a query at that
        position can still see (earlier ones may have been evicted or never kept), so its answer is not monotone
        in h: a longer prefix can be servable while a shorter one is not. Hence the caller intersects these
        arrays (over groups and models) instead of taking a minimum of lengths."""
        bs = self.block_size
        valid = [True] * (max_blocks + 1)
        if not self.enable_caching:
            return [True] + [False] * max_blocks
        for g, pool in zip(self.groups, self.pools):
            if g.spec.sliding_window is None:
                run = 0
                while run < max_blocks and pool.lookup(block_hashes[run]) is not None:
                    run += 1
                for h in range(run + 1, max_blocks + 1):
                    valid[h] = False
                continue
            # missing[i]: blocks among the first i that this group does not hold
            missing = [0]
            for i in range(max_blocks):
                missing.append(missing[-1] + (pool.lookup(block_hashes[i]) is None))
            for h in range(1, max_blocks + 1):
                first = self._first_visible(g, h * bs) // bs
                if missing[h] - missing[first]:
                    valid[h] = False
        return valid

    def prefix_blocks(self, block_hashes: list[bytes], num_blocks: int) -> list[list[int]]:
        """Per group, the table of a request that starts at position num_blocks * block_size from cached
        blocks: the cached block for each needed entry, NULL_BLOCK where a sliding window no longer looks."""
        out = []
        for g, pool in zip(self.groups, self.pools):
            first = self._first_visible(g, num_blocks * self.block_size) // self.block_size
            table = [NULL_BLOCK] * first
            for i in range(first, num_blocks):
                b = pool.lookup(block_hashes[i])
                if b is None:
                    raise RuntimeError(f"block {i} of a prefix hit is not cached in group {g.group_id}")
                table.append(b)
            out.append(table)
        return out

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_computed: int) -> None:
        """Offer the request's blocks that are full and whose KV is computed (all positions < num_computed) to
        the cache, under the hash of their tokens. Blocks a sliding window already released are skipped."""
        if not self.enable_caching or request_id not in self._tables:
            return
        start = self._num_cached[request_id]
        end = min(num_computed // self.block_size, len(block_hashes))
        if end <= start:
            return
        for pool, table in zip(self.pools, self._tables[request_id]):
            for i in range(start, min(end, len(table))):
                if table[i] != NULL_BLOCK:
                    pool.cache_block(table[i], block_hashes[i])
        self._num_cached[request_id] = end
