"""The attention layer models call: stores new K/V by slot mapping, then attends over its group's cache."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import torch_backend
from engine.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged attention of one layer. The runner binds `kv_cache` and `kv_group_id` after it has
    grouped the layers, so a model never needs to know how many KV-cache groups there are."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None, layer_id: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.layer_id = layer_id
        self.kv_group_id: int = -1
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, num_kv_heads, head_dim]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim], k/v: [num_tokens, num_kv_heads * head_dim]."""
        if self.kv_cache is None:
            raise RuntimeError(f"layer {self.layer_id} has no KV cache bound; the runner binds it at start")
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        group = md.groups[self.kv_group_id]
        if md.backend == "triton":
            # Imported here: the kernels need triton, which CPU-only installs may lack.
            from engine.kernels.kv_store import store_kv
            from engine.kernels.paged_attention import paged_attention

            store_kv(k, v, self.kv_cache[0], self.kv_cache[1], group.slot_mapping)
            out = torch.empty_like(q)
            c = md.common
            paged_attention(q, self.kv_cache[0], self.kv_cache[1], out, c.query_start_loc, c.seq_lens,
                            group.block_table, self.scale, group.sliding_window, c.max_query_len)
        else:
            torch_backend.store_kv(self.kv_cache, k, v, group.slot_mapping)
            out = torch_backend.paged_attention(q, self.kv_cache, md.common, group, self.scale)
        return out.reshape(n, self.num_heads * self.head_dim)
