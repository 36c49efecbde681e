"""Attention's prologue in one kernel: per-head q/k RMSNorm, rotary embedding of q and k, and the store of the
new keys and values into the paged KV cache (Triton kernel + typed wrapper + torch reference).

Between the fused qkv projection and paged attention a layer otherwise runs a q norm, a k norm (Qwen3, Gemma 3),
the rotary kernel and the KV store: four launches of about two microseconds each at batch 1, which is 10% of an
8B model's step at the weight-bandwidth floor (36 layers x 4), and more of a launch-bound draft's. Here one
program takes one head of one token straight from the projection's output.

The arithmetic is that of the unfused layers, rounding included: the norm's statistics in float32, its output
rounded to the activation dtype (Llama form: the normalised row is rounded before the weight multiplies it;
Gemma's offset form multiplies by (offset + w) in float32), then the rotation in float32 of the rounded values
(rotate-half layout, as HF), rounded again; keys and values are cast to the cache's dtype. A negative slot marks
a padding token of a CUDA graph's batch: its keys and values are not stored (its q is still computed).
"""

from __future__ import annotations

import torch

from engine.kernels.attention.kv_store import store_kv_ref
from engine.kernels.attention.rotary import rotary_embedding_ref
from engine.kernels.rms_norm import rms_norm_ref
from engine.kernels.triton_compat import launch, require_triton, tl, triton, wait_for_previous_kernel

__all__ = ["qk_norm_rope_store", "qk_norm_rope_store_ref"]


@triton.jit
def _norm_half(x1, x2, w_ptr, d, mask, eps, offset, HALF: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """RMSNorm of one head given as its two halves; returns both halves rounded to the input dtype."""
    dt = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d, mask=mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        y1, y2 = f1 * rstd * (offset + w1), f2 * rstd * (offset + w2)
    else:
        y1 = (f1 * rstd).to(dt).to(tl.float32) * w1
        y2 = (f2 * rstd).to(dt).to(tl.float32) * w2
    return y1.to(dt), y2.to(dt)


@triton.jit
def _qk_norm_rope_store_kernel(
        qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
        stride_t, stride_qot, stride_qoh, stride_cos,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        eps, offset,
        NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_OFFSET: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)  # first: see triton_compat (programmatic dependent launch)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads, then k heads, then v heads: the projection's column order
    d = tl.arange(0, HALF_P)
    mask = d < HALF
    src = qkv_ptr + tok * stride_t + head * (2 * HALF)
    x1 = tl.load(src + d, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + d, mask=mask, other=0.0)
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        if HAS_NORM:
            if head < NUM_Q_HEADS:
                x1, x2 = _norm_half(x1, x2, q_w_ptr, d, mask, eps, offset, HALF, HAS_OFFSET)
            else:
                x1, x2 = _norm_half(x1, x2, k_w_ptr, d, mask, eps, offset, HALF, HAS_OFFSET)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + d, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + pos * stride_cos + d, mask=mask, other=0.0)
        dt = x1.dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        x1, x2 = (f1 * cos - f2 * sin).to(dt), (f2 * cos + f1 * sin).to(dt)
    if head < NUM_Q_HEADS:
        dst = q_out_ptr + tok * stride_qot + head * stride_qoh
        tl.store(dst + d, x1, mask=mask)
        tl.store(dst + HALF + d, x2, mask=mask)
    else:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            block, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            if head < NUM_Q_HEADS + NUM_KV_HEADS:
                dst = k_cache_ptr + block * stride_kcb + off * stride_kcs + (head - NUM_Q_HEADS) * stride_kch
            else:
                dst = (v_cache_ptr + block * stride_vcb + off * stride_vcs
                       + (head - NUM_Q_HEADS - NUM_KV_HEADS) * stride_vch)
            ty = k_cache_ptr.dtype.element_ty  # the wrapper checks that both caches share it
            tl.store(dst + d, x1.to(ty), mask=mask)
            tl.store(dst + HALF + d, x2.to(ty), mask=mask)


def qk_norm_rope_store(qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
                       num_heads: int, num_kv_heads: int,
                       positions: torch.Tensor,  # [num_tokens] int64
                       cos: torch.Tensor,  # [max_positions, head_dim / 2] float32
                       sin: torch.Tensor,  # [max_positions, head_dim / 2] float32
                       key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
                       value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
                       slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; < 0: padding, not stored
                       q_norm_weight: torch.Tensor | None = None,  # [head_dim]; with k_norm_weight or neither
                       k_norm_weight: torch.Tensor | None = None,  # [head_dim]
                       eps: float = 1e-6, norm_offset: float = 0.0) -> torch.Tensor:
    """Normalise (if weights are given) and rotate q and k, store k and v by slot; returns q
    [num_tokens, num_heads, head_dim] (a new contiguous tensor)."""
    require_triton("qk_norm_rope_store", qkv, positions, cos, sin, key_cache, value_cache, slot_mapping)
    n, head_dim = _check_args(qkv, num_heads, num_kv_heads, positions, cos, sin, key_cache, value_cache,
                              slot_mapping, q_norm_weight, k_norm_weight)
    q_out = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if n:
        has_norm = q_norm_weight is not None
        half = head_dim // 2
        launch(
            _qk_norm_rope_store_kernel, (n, num_heads + 2 * num_kv_heads), qkv.device,
            qkv, positions, cos, sin, q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,
            slot_mapping, q_out, key_cache, value_cache,
            qkv.stride(0), q_out.stride(0), q_out.stride(1), cos.stride(0),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            eps, norm_offset,
            NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, HALF_P=triton.next_power_of_2(half),
            BLOCK_SIZE=key_cache.shape[1], HAS_NORM=has_norm, HAS_OFFSET=bool(norm_offset),
            num_warps=1 if head_dim <= 128 else 2)
    return q_out


def qk_norm_rope_store_ref(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                           k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                           norm_offset: float = 0.0) -> torch.Tensor:
    """Plain-torch reference of `qk_norm_rope_store` (same arguments): the unfused layers' own references."""
    n, head_dim = _check_args(qkv, num_heads, num_kv_heads, positions, cos, sin, key_cache, value_cache,
                              slot_mapping, q_norm_weight, k_norm_weight)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = (t.reshape(n, -1, head_dim) for t in (q, k, v))
    if q_norm_weight is not None and k_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps, norm_offset)
        k = rms_norm_ref(k, k_norm_weight, eps, norm_offset)
    q, k = rotary_embedding_ref(positions, q, k, cos, sin)
    store_kv_ref(k, v, key_cache, value_cache, slot_mapping)
    return q.contiguous()


def _check_args(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None) -> tuple[int, int]:
    if qkv.dim() != 2 or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be [num_tokens, width] with a contiguous last dimension, got {tuple(qkv.shape)}")
    n = qkv.shape[0]
    head_dim = cos.shape[-1] * 2
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv width {qkv.shape[1]} is not (num_heads + 2 * num_kv_heads) * head_dim = "
                         f"({num_heads} + 2 * {num_kv_heads}) * {head_dim}")
    if sin.shape != cos.shape or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"cos and sin must be contiguous [max_positions, head_dim / 2], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if tuple(positions.shape) != (n,) or tuple(slot_mapping.shape) != (n,):
        raise ValueError(f"positions and slot_mapping must be [{n}], got {tuple(positions.shape)} and "
                         f"{tuple(slot_mapping.shape)}")
    expected = (num_kv_heads, head_dim)
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or tuple(key_cache.shape[2:]) != expected:
        raise ValueError(f"key_cache and value_cache must both be [num_blocks, block_size, {num_kv_heads}, "
                         f"{head_dim}], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache and value_cache dtypes differ: {key_cache.dtype} and {value_cache.dtype}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the KV caches must be contiguous in head_dim")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q and k norm weights or neither")
    for w in (q_norm_weight, k_norm_weight):
        if w is not None and tuple(w.shape) != (head_dim,):
            raise ValueError(f"norm weights must be [{head_dim}], got {tuple(w.shape)}")
    return n, head_dim
