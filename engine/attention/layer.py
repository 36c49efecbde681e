"""The attention layer models call: stores new K/V by slot mapping, then attends over its group's cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention import torch_backend
from engine.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from engine.models.layers import RMSNorm, RotaryEmbedding


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

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, rotary: RotaryEmbedding,
                    q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The whole layer after the fused projection. qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim];
        q_norm / k_norm: per-head RMSNorms (Qwen3, Gemma 3) or None; rotary: the model's RotaryEmbedding.
        sinks: [num_heads] float, one learned logit per query head that joins the softmax's denominator and
        attends to nothing (GPT-OSS), or None.
        Returns [num_tokens, num_heads * head_dim]. On the kernel path norms, rotation and the KV store are one
        kernel (engine/kernels/attention/qk_norm_rope_store.py); in a tree forward the group's slot mapping is the
        rows' scratch slots, so the same kernel stores the nodes' KV."""
        n = qkv.shape[0]
        if md.backend == "triton":
            from engine.kernels.attention.qk_norm_rope_store import qk_norm_rope_store

            kv = self._bound_cache()
            eps, offset = (q_norm.eps, q_norm.offset) if q_norm is not None else (0.0, 0.0)
            q = qk_norm_rope_store(qkv, self.num_heads, self.num_kv_heads, positions, rotary.cos, rotary.sin, kv[0],
                                   kv[1], md.groups[self.kv_group_id].slot_mapping,
                                   q_norm.weight if q_norm is not None else None,
                                   k_norm.weight if k_norm is not None else None, eps, offset)
            return self._attend_triton(q, md, sinks).reshape(n, self.num_heads * self.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = rotary(positions, q, k)
        return self(q.reshape(n, -1), k.reshape(n, -1), v, md, sinks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim], k/v: [num_tokens, num_kv_heads * head_dim]: store k/v, attend.
        sinks: as forward_qkv."""
        kv_cache = self._bound_cache()
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        group = md.groups[self.kv_group_id]
        if md.backend == "triton":
            # Imported here: the kernels need triton, which CPU-only installs may lack.
            from engine.kernels.attention.kv_store import store_kv

            store_kv(k, v, kv_cache[0], kv_cache[1], group.slot_mapping)
            out = self._attend_triton(q, md, sinks)
        else:
            torch_backend.store_kv(kv_cache, k, v, group.slot_mapping)
            if md.tree is not None:
                out = torch_backend.tree_attention(q, kv_cache, md.tree, group, self.scale, sinks)
            else:
                out = torch_backend.paged_attention(q, kv_cache, md.common, group, self.scale, sinks)
        return out.reshape(n, self.num_heads * self.head_dim)

    def _bound_cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError(f"layer {self.layer_id} has no KV cache bound; the runner binds it at start")
        return self.kv_cache

    def _attend_triton(self, q: torch.Tensor, md: AttentionMetadata, sinks: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> the same shape, over this layer's group of the cache."""
        from engine.kernels.attention.paged import paged_attention

        kv, group, c = self._bound_cache(), md.groups[self.kv_group_id], md.common
        out = torch.empty_like(q)
        if md.tree is not None:
            from engine.kernels.attention.tree import tree_attention

            t = md.tree
            tree_attention(q, kv[0], kv[1], out, group.block_table, t.row_index, t.row_positions, t.prefix_lens,
                           t.node_positions, t.node_slots[group.group_id], t.visible, self.scale,
                           group.sliding_window, sinks=sinks)
            return out
        paged_attention(q, kv[0], kv[1], out, c.query_start_loc, c.seq_lens, group.block_table, self.scale,
                        group.sliding_window, c.max_query_len, sinks=sinks)
        return out
