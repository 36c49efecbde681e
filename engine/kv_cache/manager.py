"""KV-cache manager of one model: a block pool and per-request block tables for every KV-cache group."""

from __future__ import annotations

from engine.kv_cache.block_pool import NULL_BLOCK, BlockPool
from engine.kv_cache.spec import KVCacheGroupSpec


class KVCacheManager:
    """Owns the blocks of one model (target or draft), group by group.

    Every group gets the same number of blocks: a sliding-window group never needs more blocks per
    request than a full-attention group, so the full group is always the one that runs out first and
    one budget check covers all groups. Block ids index each group's own KV tensors.
    """

    def __init__(self, groups: list[KVCacheGroupSpec], num_blocks: int, block_size: int) -> None:
        if not groups:
            raise ValueError("a model needs at least one KV-cache group")
        self.groups = groups
        self.block_size = block_size
        self.pools = [BlockPool(num_blocks) for _ in groups]
        # request id -> per group, block ids by logical block index (NULL_BLOCK once released)
        self._tables: dict[str, list[list[int]]] = {}

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def _num_released(self, group: KVCacheGroupSpec, table: list[int], num_computed: int) -> int:
        """Blocks of a sliding-window group that no query from position `num_computed` on can see."""
        window = group.spec.sliding_window
        if window is None:
            return 0
        first_visible = max(0, num_computed - window + 1)
        n = min(first_visible // self.block_size, len(table))
        return sum(1 for b in table[:n] if b != NULL_BLOCK)

    def _num_new_blocks(self, table: list[int], num_total_tokens: int) -> int:
        return max(0, -(-num_total_tokens // self.block_size) - len(table))

    def can_allocate(self, request_id: str, num_computed: int, num_total_tokens: int) -> bool:
        """Whether KV for positions [num_computed, num_total_tokens) fits in every group."""
        tables = self._tables.get(request_id) or [[] for _ in self.groups]
        for g, pool, table in zip(self.groups, self.pools, tables):
            need = self._num_new_blocks(table, num_total_tokens)
            if need > pool.num_free + self._num_released(g, table, num_computed):
                return False
        return True

    def allocate(self, request_id: str, num_computed: int, num_total_tokens: int) -> None:
        """Make room for positions [num_computed, num_total_tokens); sliding groups release first."""
        if not self.can_allocate(request_id, num_computed, num_total_tokens):
            raise RuntimeError(f"KV cache cannot hold {num_total_tokens} tokens of {request_id}")
        tables = self._tables.setdefault(request_id, [[] for _ in self.groups])
        for g, pool, table in zip(self.groups, self.pools, tables):
            if g.spec.sliding_window is not None:
                first_visible = max(0, num_computed - g.spec.sliding_window + 1)
                for i in range(min(first_visible // self.block_size, len(table))):
                    if table[i] != NULL_BLOCK:
                        pool.free([table[i]])
                        table[i] = NULL_BLOCK
            table.extend(pool.allocate(self._num_new_blocks(table, num_total_tokens)))

    def free(self, request_id: str) -> None:
        tables = self._tables.pop(request_id, None)
        if tables is None:
            return
        for pool, table in zip(self.pools, tables):
            pool.free(table)

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
