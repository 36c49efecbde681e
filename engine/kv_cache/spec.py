"""Per-layer attention specs and their grouping into KV-cache groups."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's KV cache looks like. Layers with equal specs share a KV-cache group."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    sliding_window: int | None  # None = full attention

    @property
    def block_bytes_per_layer(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def max_blocks_per_request(self, max_model_len: int) -> int:
        """Blocks one request can hold at once. A sliding-window request holds the window, one block
        of slack on each side for the window's misalignment, and the blocks of one step's new tokens."""
        full = -(-max_model_len // self.block_size)
        if self.sliding_window is None:
            return full
        return min(full, -(-self.sliding_window // self.block_size) + 1)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    group_id: int
    spec: AttentionSpec
    layer_ids: tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        """Bytes one block id costs in this group: one block in every layer of the group."""
        return self.spec.block_bytes_per_layer * len(self.layer_ids)


def group_layers(layer_specs: list[AttentionSpec]) -> list[KVCacheGroupSpec]:
    """Layers with the same spec form one group; groups ordered by their first layer.

    Gemma 3 (5 sliding : 1 full) gives two groups; a dense Llama gives one.
    """
    order: list[AttentionSpec] = []
    members: dict[AttentionSpec, list[int]] = {}
    for i, s in enumerate(layer_specs):
        if s not in members:
            members[s] = []
            order.append(s)
        members[s].append(i)
    return [KVCacheGroupSpec(g, s, tuple(members[s])) for g, s in enumerate(order)]
