"""Argument checks shared by the attention kernels over the paged KV cache (paged.py, tree.py)
and their torch references: shapes and host values only, no device data is read."""

from __future__ import annotations

import torch

MAX_GRID_Y = 65535  # CUDA's limit on a grid's axis 1, which takes one request (or tree) per program row


def check_query_and_cache(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                          rows: str) -> tuple[int, int, int, int]:
    """query [rows, num_heads, head_dim], out the same, key and value caches [num_blocks, block_size, num_kv_heads,
    head_dim] with whole query heads per KV head; rows: what the query's rows are, for the message. Returns
    (num_heads, head_dim, num_kv_heads, block_size)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [{rows}, num_heads, head_dim], got {tuple(query.shape)}")
    _, num_heads, head_dim = query.shape
    if out.shape != query.shape:
        raise ValueError(f"out must have the query's shape {tuple(query.shape)}, got {tuple(out.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads, head_dim, num_kv_heads, block_size


def check_sliding_window(sliding_window: int | None) -> None:
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window <= 0):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")


def check_launch(kernel: str, count: int, what: str, num_kv_splits: int | None) -> None:
    """count: the launch's requests (or trees), one per grid row; num_kv_splits: None or a power of two."""
    if count > MAX_GRID_Y:
        raise ValueError(f"{kernel}: at most {MAX_GRID_Y} {what} per launch (grid axis 1), got {count}")
    if num_kv_splits is not None and (num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1)):
        raise ValueError(f"num_kv_splits must be a power of two >= 1, got {num_kv_splits}")


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    """Attention sinks (GPT-OSS): one learned logit per query head that joins each row's softmax denominator."""
    if sinks is not None and (tuple(sinks.shape) != (num_heads,) or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be [num_heads] = [{num_heads}] float, got {tuple(sinks.shape)} {sinks.dtype}")
