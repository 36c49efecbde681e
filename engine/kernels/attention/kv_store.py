"""Store this step's keys and values into the paged KV cache by slot mapping (Triton kernel + reference).

A slot is block * block_size + offset. A negative slot marks a padding token of a CUDA graph's batch:
nothing is written for it, so padding never touches a block that belongs to a request.
"""

from __future__ import annotations

import torch

from engine.kernels.triton_compat import HAS_TRITON, require_triton, tl, triton

__all__ = ["HAS_TRITON", "store_kv", "store_kv_ref"]


@triton.jit
def _store_kv_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_kcb, stride_kcs, stride_kch, stride_kcd,
        stride_vcb, stride_vcs, stride_vch, stride_vcd,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        head = tl.arange(0, HEADS_P)  # [HEADS_P]
        dim = tl.arange(0, HEAD_DIM_P)  # [HEAD_DIM_P]
        mask = (head[:, None] < NUM_KV_HEADS) & (dim[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + token * stride_kt + head[:, None] * stride_kh + dim[None, :] * stride_kd, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + head[:, None] * stride_vh + dim[None, :] * stride_vd, mask=mask)
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs
        tl.store(k_dst + head[:, None] * stride_kch + dim[None, :] * stride_kcd, k.to(k_cache_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(v_dst + head[:, None] * stride_vch + dim[None, :] * stride_vcd, v.to(v_cache_ptr.dtype.element_ty),
                 mask=mask)


def store_kv(key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
             value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
             key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
             value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
             slot_mapping: torch.Tensor,  # [num_tokens] int64 or int32; < 0: padding token, skipped
             ) -> None:
    """Write key[t] / value[t] into the caches at slot slot_mapping[t] (cast to the cache's dtype)."""
    require_triton("store_kv", key, value, key_cache, value_cache, slot_mapping)
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P=triton.next_power_of_2(head_dim), BLOCK_SIZE=key_cache.shape[1],
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1)


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Plain-torch reference of `store_kv` (same arguments); syncs with the host to drop padding slots."""
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)


def _check_args(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError("key and value must both be [num_tokens, num_kv_heads, head_dim], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"key_cache and value_cache must both be [num_blocks, block_size, {key.shape[1]}, "
                         f"{key.shape[2]}], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if tuple(slot_mapping.shape) != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}] (one slot per token), got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
