"""Prefix caching's bookkeeping: block hashes, the pool's refcounts and LRU eviction, which prefixes a model's
KV-cache groups (full and sliding-window) can supply, and the scheduler's rule across target and draft.

Engine-level correctness (outputs with caching equal outputs without it and HF) is in test_prefix_cache_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.kv_cache.block_hash import hash_block, update_block_hashes
from engine.kv_cache.block_pool import NULL_BLOCK, BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.spec import AttentionSpec, group_layers
from engine.request import Request
from engine.scheduler import Scheduler

BS = 4


def _spec(window=None):
    return AttentionSpec(num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=BS, sliding_window=window)


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True))


# --- hashes ---------------------------------------------------------------------------------------------------
def test_block_hashes_chain_over_the_prefix():
    a = _req("a", [5, 6, 7, 8, 9, 10, 11, 12, 13])
    b = _req("b", [5, 6, 7, 9, 9, 10, 11, 12])  # differs inside the first block only
    ha, hb = list(update_block_hashes(a, BS)), list(update_block_hashes(b, BS))
    assert len(ha) == 2 and len(hb) == 2  # full blocks only: the 9th token of a is not hashed yet
    assert ha[0] != hb[0]
    # Same tokens in block 1, different parents: different addresses (a block stands for its whole prefix).
    assert a.prompt_token_ids[4:8] == b.prompt_token_ids[4:8] and ha[1] != hb[1]
    assert ha[0] == hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [5, 6, 7, 8], b"adapter-1") != ha[0]  # the extra-keys hook changes the address
    a.output_token_ids += [14, 15, 16]
    assert update_block_hashes(a, BS)[:2] == ha and len(a.block_hashes) == 3


# --- the pool -------------------------------------------------------------------------------------------------
def test_pool_refcounts_and_sharing():
    pool = BlockPool(6)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"h")
    assert pool.lookup(b"h") == b and pool.ref_cnt[b] == 1
    pool.touch([b])  # a second request takes the cached block
    assert pool.ref_cnt[b] == 2 and pool.num_used == 1
    pool.free([b])
    assert pool.ref_cnt[b] == 1 and pool.num_free == 4
    pool.free([b])
    # Unreferenced but still cached: free for allocation, still found by lookup, not counted as used.
    assert pool.ref_cnt[b] == 0 and pool.num_free == 5 and pool.num_used == 0 and pool.lookup(b"h") == b
    assert pool.num_reviving([b, NULL_BLOCK]) == 1
    pool.touch([b])
    assert pool.num_free == 4 and pool.ref_cnt[b] == 1
    with pytest.raises(RuntimeError, match="no reference"):
        pool.free([b, b])


def test_pool_evicts_cached_blocks_last_and_least_recently_used_first():
    pool = BlockPool(5)  # 4 usable
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks[:3]):
        pool.cache_block(b, bytes([i]))
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[3]])  # uncached: handed out before any cached block
    pool.free([blocks[2]])
    assert pool.allocate(1) == [blocks[3]] and pool.num_evictions == 0
    # Then cached blocks in the order their last reference went: 1, 0, 2.
    assert pool.allocate(1) == [blocks[1]] and pool.lookup(bytes([1])) is None and pool.num_evictions == 1
    pool.touch([blocks[0]])  # a hit revives block 0: it leaves the eviction queue
    assert pool.allocate(1) == [blocks[2]] and pool.lookup(bytes([2])) is None
    assert not pool.can_allocate(1)
    assert pool.lookup(bytes([0])) == blocks[0]


def test_duplicate_content_keeps_the_first_copy():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h")
    pool.cache_block(b, b"h")  # computed twice at once: b stays an ordinary block
    assert pool.lookup(b"h") == a and pool.block_hash[b] is None
    pool.free([a, b])
    assert pool.allocate(1) == [b]  # the uncached copy goes first


def _evict(pool: BlockPool, block: int) -> None:
    """Evict one particular cached, unreferenced block: put it at the head of the free queue and allocate it (the
    pool's own order is tested above; here a test needs a chosen block gone)."""
    pool._free.move_to_end(block, last=False)
    assert pool.allocate(1) == [block]


# --- one model's groups ---------------------------------------------------------------------------------------
def _run(kv: KVCacheManager, req: Request, n_computed: int) -> list[bytes]:
    """Allocate and 'compute' the request's first n_computed tokens, then cache its full blocks."""
    kv.allocate(req.request_id, 0, n_computed)
    hashes = update_block_hashes(req, BS)
    kv.cache_blocks(req.request_id, hashes, n_computed)
    return hashes


def test_full_group_hit_is_the_cached_run_from_the_start():
    kv = KVCacheManager(group_layers([_spec()]), 32, BS, enable_caching=True)
    toks = list(range(3, 23))  # 5 full blocks
    hashes = _run(kv, _req("a", toks), 20)
    other = _req("b", toks[:10] + [99] + toks[11:])  # diverges inside block 2
    hb = update_block_hashes(other, BS)
    assert kv.valid_prefix_lengths(hb, 4) == [True, True, True, False, False]
    assert kv.valid_prefix_lengths(hashes, 4) == [True] * 5
    assert kv.prefix_blocks(hashes, 3) == [kv.block_table("a", 0)[:3]]
    off = KVCacheManager(group_layers([_spec()]), 32, BS, enable_caching=False)
    _run(off, _req("a", toks), 20)
    assert off.valid_prefix_lengths(hashes, 4) == [True, False, False, False, False]


def test_sliding_group_needs_only_the_window():
    window = 6  # a query at position p sees p-5..p: from a start at 16, blocks 2 and 3 (positions 11..15)
    kv = KVCacheManager(group_layers([_spec(window)]), 32, BS, enable_caching=True)
    toks = list(range(3, 27))  # 6 full blocks
    hashes = _run(kv, _req("a", toks), 24)
    pool = kv.pools[0]
    kv.free("a")
    # Evict blocks 0 and 1 of the prefix: a sliding group still serves a start at 16 (and later), not before.
    for i in (0, 1):
        _evict(pool, pool.lookup(hashes[i]))
    assert pool.lookup(hashes[0]) is None and pool.lookup(hashes[1]) is None
    valid = kv.valid_prefix_lengths(hashes, 5)
    assert valid == [True, False, False, False, True, True]
    table = kv.prefix_blocks(hashes, 4)[0]
    assert table[:2] == [NULL_BLOCK, NULL_BLOCK] and NULL_BLOCK not in table[2:] and len(table) == 4
    # A full-attention group beside it cannot supply any of that: the model's hit is the intersection.
    hybrid = KVCacheManager(group_layers([_spec(window), _spec()]), 32, BS, enable_caching=True)
    _run(hybrid, _req("h", toks), 24)
    hybrid.free("h")
    assert hybrid.valid_prefix_lengths(hashes, 5) == [True] * 6
    _evict(hybrid.pools[1], hybrid.pools[1].lookup(hashes[3]))
    assert hybrid.valid_prefix_lengths(hashes, 5) == [True, True, True, True, False, False]


def test_a_hit_table_is_refcounted_and_never_written():
    kv = KVCacheManager(group_layers([_spec()]), 16, BS, enable_caching=True)
    toks = list(range(3, 15))  # 3 full blocks
    hashes = _run(kv, _req("a", toks), 12)
    prefix = kv.prefix_blocks(hashes, 2)
    assert kv.can_allocate("b", 8, 14, prefix)
    kv.allocate("b", 8, 14, prefix)
    ta, tb = kv.block_table("a", 0), kv.block_table("b", 0)
    assert tb[:2] == ta[:2] and tb[2] not in ta  # the block b writes (positions 8..11) is its own
    assert [kv.pools[0].ref_cnt[x] for x in ta] == [2, 2, 1]
    kv.free("a")
    kv.free("b")
    assert all(c == 0 for c in kv.pools[0].ref_cnt) and kv.num_used_blocks() == [0]
    assert kv.pools[0].num_cached == 3  # a's 3 blocks; b's block 2 held the same content as a's, so not cached


def test_can_allocate_counts_revived_cached_blocks():
    kv = KVCacheManager(group_layers([_spec()]), 5, BS, enable_caching=True)  # 4 usable
    toks = list(range(3, 15))
    hashes = _run(kv, _req("a", toks), 12)
    kv.free("a")  # 3 cached, unreferenced blocks: all 4 are free
    prefix = kv.prefix_blocks(hashes, 2)
    assert kv.can_allocate("b", 8, 16, prefix)  # 2 revived + 2 new = 4
    assert not kv.can_allocate("b", 8, 20, prefix)  # 2 revived + 3 new > 4
    kv.allocate("b", 8, 16, prefix)
    assert kv.pools[0].num_free == 0 and kv.pools[0].num_evictions == 1


# --- the scheduler: each model's own hit -------------------------------------------------------------------------
def _cached_pair(budget: int = 64, draft_length_fn=None) -> tuple[Scheduler, KVCacheManager, KVCacheManager, list]:
    """A target (one full group) and a hybrid draft (sliding + full) that both cached a 16-token prompt."""
    target = KVCacheManager(group_layers([_spec()]), 32, BS, enable_caching=True)
    draft = KVCacheManager(group_layers([_spec(5), _spec()]), 32, BS, enable_caching=True)
    sched = Scheduler([target, draft], max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64,
                      num_speculative_tokens=2, draft_length_fn=draft_length_fn, enable_prefix_caching=True)
    toks = list(range(3, 19))  # 16 tokens: 4 full blocks
    first = _req("a", toks)
    sched.add_request(first)
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == min(16, budget) and first.num_cached_tokens == 0
    first.num_computed_tokens = first.num_draft_computed_tokens = 16
    sched.cache_committed_blocks(first)
    sched.finish_request(first, first.status.FINISHED_LENGTH)
    return sched, target, draft, toks


def test_hit_is_what_every_model_can_supply_and_leaves_the_last_token():
    sched, target, draft, toks = _cached_pair()
    second = _req("b", toks)  # the whole prompt is cached, but its last token must run: 3 blocks, not 4
    hit = sched._prefix_hit(second)
    assert (hit.num_tokens, hit.draft_tokens) == (12, 12) and hit.model_hits == [12, 12]
    sched.add_request(second)
    out = sched.schedule()
    s = out.scheduled[0]
    assert second.num_cached_tokens == 12 and (s.start, s.draft_start, s.num_new_tokens) == (12, 12, 4)


def test_target_takes_its_own_hit_and_the_draft_catches_up_from_its_own():
    sched, target, draft, toks = _cached_pair()
    second = _req("b", toks)
    # The draft alone loses block 0: the target still skips its 12 cached tokens; the draft starts from 0 and
    # computes them in this step's forward, with the prompt's rest (it runs this step: k = 2).
    _evict(draft.pools[1], draft.pools[1].lookup(update_block_hashes(second, BS)[0]))  # the draft's full group
    hit = sched._prefix_hit(second)
    assert (hit.num_tokens, hit.draft_tokens) == (12, 0) and hit.model_hits == [12, 0]
    sched.add_request(second)
    out = sched.schedule()
    s = out.scheduled[0]
    assert second.num_cached_tokens == 12 and (s.start, s.num_new_tokens, s.num_draft_tokens) == (12, 4, 0)
    assert s.draft_runs and s.draft_start == 0 and second.num_draft_computed_tokens == 0
    assert not second.draft_gap_unsent  # this explicit entry carries the draft's tokens from 0
    assert len(draft.block_table("b", 1)) == 4  # the draft's own blocks for all 16 positions
    assert draft.block_table("b", 1)[:3] != target.block_table("b", 0)[:3]  # nothing of the target's
    assert (target.prefix_queries, target.prefix_hits) == (32, 12)
    assert (draft.prefix_queries, draft.prefix_hits) == (32, 0)
    # Its catch-up counts against the step's budget: the request takes 12 + 4 of the 64 tokens.
    assert out.num_batched_tokens == 4


def test_the_drafts_catch_up_in_the_admission_step_fits_the_budget():
    """With a budget of 10 the draft, which holds nothing, can catch up on at most 9 tokens before the target's
    start in the admission step: the target starts from 8 (2 blocks), not 12, and the step feeds the draft 10."""
    sched, target, draft, toks = _cached_pair(budget=10)
    second = _req("b", toks)
    for pool in draft.pools:  # the draft loses the prompt's every block (both groups)
        for h in update_block_hashes(second, BS)[:3]:
            if pool.lookup(h) is not None:
                _evict(pool, pool.lookup(h))
    sched.add_request(second)
    s = sched.schedule().scheduled[0]
    assert second.num_cached_tokens == 8 and (s.start, s.draft_start, s.num_new_tokens) == (8, 0, 2)
    assert target.prefix_hits == 12  # the counters say what the target could supply


def test_a_draft_sitting_out_keeps_the_targets_hit_and_catches_up_later():
    """At k = 0 the draft does not run: the target still takes its whole hit, and the draft keeps its own (shorter)
    hit's blocks for a later catch-up, which the scheduler sends as explicit input (never an open entry)."""
    ks = iter([2, 0, 2])
    sched, target, draft, toks = _cached_pair(draft_length_fn=lambda batch: next(ks))
    second = _req("b", toks)
    _evict(draft.pools[1], draft.pools[1].lookup(update_block_hashes(second, BS)[1]))  # the draft keeps block 0
    sched.add_request(second)
    s = sched.schedule().scheduled[0]
    assert sched.step_draft_length == 0 and not s.draft_runs
    assert second.num_cached_tokens == 12 and (s.start, s.num_new_tokens) == (12, 4)
    assert second.num_draft_computed_tokens == 4 and second.draft_gap_unsent
    assert len(draft.block_table("b", 1)) == 1  # only its hit's block, held for the catch-up
    # The step lands (the prompt's last token sampled one) and the draft runs next: from its hit, not the target's.
    second.num_computed_tokens = 16
    second.output_token_ids.append(40)
    s = sched.schedule().scheduled[0]
    assert s.draft_runs and (s.start, s.draft_start, s.num_draft_tokens) == (16, 4, 2)
    assert len(draft.block_table("b", 1)) == 5  # positions 4..16 and the drafts but the last


def test_a_draft_that_cannot_catch_up_starts_where_the_target_does():
    """A draft that cannot compute positions the target skipped (an EAGLE-3 head): both start from what both hold."""
    sched, target, draft, toks = _cached_pair()
    sched.draft_catches_up = False
    second = _req("b", toks)
    _evict(draft.pools[1], draft.pools[1].lookup(update_block_hashes(second, BS)[0]))
    hit = sched._prefix_hit(second)
    assert (hit.num_tokens, hit.draft_tokens) == (0, 0) and hit.model_hits == [12, 0]
    sched.add_request(second)
    out = sched.schedule()
    assert second.num_cached_tokens == 0 and out.scheduled[0].num_new_tokens == 16
