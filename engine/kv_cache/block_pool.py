"""A pool of fixed-size KV blocks for one KV-cache group."""

from __future__ import annotations

from collections import deque

NULL_BLOCK = 0  # never handed out; block tables point here for released or padded entries


class BlockPool:
    """Free list of block ids. Block 0 is reserved as the null block, so a block table can keep
    its logical positions after a sliding window releases early blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV-cache group needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def usage(self) -> float:
        return self.num_used / self.num_usable

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b != NULL_BLOCK:
                self._free.append(b)
