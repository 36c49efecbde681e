"""KV-cache groups, block pools and the manager's accounting."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from engine import LLM, SamplingParams
from engine.kv_cache.block_pool import NULL_BLOCK, BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.spec import AttentionSpec, group_layers


def _spec(window=None, heads=2):
    return AttentionSpec(num_kv_heads=heads, head_dim=16, dtype=torch.float32, block_size=4, sliding_window=window)


def test_layers_group_by_spec():
    specs = [_spec(6), _spec(6), _spec(None), _spec(6), _spec(None), _spec(6, heads=1)]
    groups = group_layers(specs)
    assert [g.layer_ids for g in groups] == [(0, 1, 3), (2, 4), (5,)]
    assert [g.spec.sliding_window for g in groups] == [6, None, 6]


def test_block_pool_reserves_null_block():
    pool = BlockPool(5)
    got = pool.allocate(4)
    assert NULL_BLOCK not in got and sorted(got) == [1, 2, 3, 4]
    assert not pool.can_allocate(1)
    pool.free(got + [NULL_BLOCK])
    assert pool.num_free == 4 and pool.usage() == 0.0


def test_sliding_group_holds_only_the_window_while_full_group_grows():
    window, bs = 8, 4
    groups = group_layers([_spec(window), _spec(None)])
    kv = KVCacheManager(groups, num_blocks=64, block_size=bs)
    held_sliding, held_full = [], []
    for n in range(1, 121):  # one token at a time, like decode
        kv.allocate("r", n - 1, n)
        held_sliding.append(kv.num_blocks_held("r", 0))
        held_full.append(kv.num_blocks_held("r", 1))
    bound = -(-window // bs) + 1
    assert max(held_sliding) <= bound, held_sliding
    assert held_full[-1] == 120 // bs and held_full == sorted(held_full)
    # Released entries stay in the table as the null block, so logical positions are unchanged.
    table = kv.block_table("r", 0)
    assert len(table) == 120 // bs and table[0] == NULL_BLOCK
    kv.free("r")
    assert kv.num_used_blocks() == [0, 0]


def test_can_allocate_counts_blocks_a_window_releases():
    groups = group_layers([_spec(4)])
    kv = KVCacheManager(groups, num_blocks=4, block_size=4)  # 3 usable blocks
    kv.allocate("r", 0, 12)
    assert kv.pools[0].num_free == 0
    # Positions 12..15 need a 4th block; the window (4) has left block 0 behind by then.
    assert kv.can_allocate("r", 12, 16)
    kv.allocate("r", 12, 16)
    # Queries from position 12 see keys 9.. (window 4): blocks 0 and 1 are released, 2 and 3 held.
    assert kv.num_blocks_held("r", 0) == 2
    assert kv.block_table("r", 0)[:2] == [NULL_BLOCK, NULL_BLOCK]


def test_long_generation_keeps_sliding_usage_bounded(tiny_models):
    """Through the engine: Gemma 3's sliding group stays at the window while its full group grows."""
    m = tiny_models["gemma3"]
    llm = LLM(model=m.path, max_model_len=256, block_size=4, num_kv_blocks=128)
    target = llm.executor.target
    kv = llm.engine.target_kv
    sliding = [g.group_id for g in target.kv_groups if g.spec.sliding_window is not None]
    full = [g.group_id for g in target.kv_groups if g.spec.sliding_window is None]
    assert len(sliding) == 1 and len(full) == 1
    from engine.request import Request
    req = Request("long", random_prompts([10])[0], SamplingParams(max_tokens=90, ignore_eos=True))
    llm.engine.add_request(req)
    peak_sliding = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        if kv.has("long"):
            peak_sliding = max(peak_sliding, kv.num_blocks_held("long", sliding[0]))
            full_held = kv.num_blocks_held("long", full[0])
    window = m.config.sliding_window
    assert peak_sliding <= -(-window // 4) + 1
    assert full_held >= (10 + 89) // 4
    assert kv.num_used_blocks() == [0, 0]


def test_group_pools_are_sized_equally_from_a_memory_budget(tiny_models):
    m = tiny_models["gemma3"]
    llm = LLM(model=m.path, max_model_len=128, block_size=4, kv_cache_memory_bytes=2 * 1024 * 1024)
    t = llm.executor.target
    per_block = sum(g.block_bytes for g in t.kv_groups)
    assert t.num_blocks == min(2 * 1024 * 1024 // per_block, 64 * (128 // 4) + 1)
    assert {p.num_blocks for p in llm.engine.target_kv.pools} == {t.num_blocks}
    with pytest.raises(ValueError, match="KV budget"):
        LLM(model=m.path, max_model_len=128, block_size=4, kv_cache_memory_bytes=1000)
