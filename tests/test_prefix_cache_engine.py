"""Prefix caching through the engine: greedy outputs with caching equal outputs without it and HF transformers.

The workload is a small multi-turn chat: a shared 14-token "system prompt" (3.5 blocks of 4, so later prompts
diverge inside a block), several user turns after it, and a second turn that resends the first turn's prompt and
answer plus new tokens. Prompts run one generate() after another, so each finds the earlier ones' blocks cached,
and then all at once. The tiny models' sliding windows (5-7 tokens) are shorter than every prompt, so a hit on a
sliding-window group relies on the window rule. Reference counts must be back at zero when everything is done.

A poisoned run fills every block the pools hand out (and the null block) with garbage before the model may write
it: a read of a stale (evicted, reused) or foreign block then changes the output, which must not happen; the
negative control corrupts one cached block and shows the same check catches it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_prompts

from engine import LLM, SamplingParams
from engine.kv_cache.block_pool import NULL_BLOCK
from engine.request import Request

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 11  # the first turn then ends on a block boundary (17 + 11 tokens): its last block is full, not computed
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
# A fixed k (the draft length rule off): runs with and without caching are compared verify for verify, and the
# rule's choices follow measured time, which differs run to run.
KW = dict(block_size=4, max_model_len=64, max_num_batched_tokens=20, adaptive_draft_length=False)
SYSTEM = random_prompts([14], seed=21)[0]
TURNS = [SYSTEM + s for s in random_prompts([3, 6, 1, 9], seed=22)]
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]

_hf_cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def _hf(model, prompt: list[int]) -> list[int]:
    key = (model.name, tuple(prompt))
    if key not in _hf_cache:
        _hf_cache[key] = hf_greedy(model.hf, prompt, NEW)
    return _hf_cache[key]


def _chat(llm: LLM, spec: list | None = None) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(prompts, outputs, cached tokens per request) of the workload; `spec` gets each request's (verify steps,
    accepted tokens)."""
    prompts, outs = [], []
    for p in TURNS:  # one after another: each may reuse what the earlier ones left cached
        outs += llm.generate([p], GREEDY)
        prompts.append(p)
    second_turn = TURNS[0] + outs[0].token_ids + [7, 8, 9, 10, 11]
    outs += llm.generate([second_turn], GREEDY)
    prompts.append(second_turn)
    outs += llm.generate(TURNS, GREEDY)  # a batch: hits on earlier requests' blocks, shared by several at once
    prompts += TURNS
    if spec is not None:
        spec += [(o.spec.num_drafts, o.spec.num_accepted_tokens) for o in outs]
    return prompts, [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _assert_released(llm: LLM) -> None:
    """Every reference returned: no request holds a block in any group of any model (no leaks)."""
    for model, kv in llm.engine.kv_managers():
        for g, pool in enumerate(kv.pools):
            held = [b for b, n in enumerate(pool.ref_cnt) if n]
            assert not held, f"{model} group {g}: blocks {held} still referenced"
        assert kv.num_used_blocks() == [0] * kv.num_groups


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_greedy_equals_uncached_and_hf(tiny_models, family):
    m = tiny_models[family]
    on = LLM(m.path, **KW)
    prompts, got, cached = _chat(on)
    assert got == [_hf(m, p) for p in prompts]
    off = LLM(m.path, enable_prefix_caching=False, **KW)
    _, got_off, cached_off = _chat(off)
    assert got_off == got and cached_off == [0] * len(prompts)
    # The first request finds nothing; every later one shares at least the system prompt's 3 full blocks
    # (sliding-window families too).
    assert cached[0] == 0 and all(c >= 12 for c in cached[1:]), cached
    # The second turn reuses the whole first turn whose KV was computed (all but its last sampled token), in full
    # blocks.
    assert cached[4] == (len(TURNS[0]) + NEW - 1) // 4 * 4
    assert all(c % 4 == 0 and c < len(p) for c, p in zip(cached, prompts))
    (queries, hits), = on.engine.prefix_cache_stats().values()
    assert queries == sum(len(p) for p in prompts) and hits == sum(cached)
    assert off.engine.prefix_cache_stats() == {"target": (0, 0)}  # no lookups when caching is off
    _assert_released(on)
    _assert_released(off)


# Hybrid Gemma 3 targets (sliding + full groups) with hybrid drafts (the near copy adds a sliding layer; the 2-layer
# Gemma 3), a single-group target with a hybrid draft, and a sliding-window-only target with a single-group draft.
@pytest.mark.parametrize("target,draft,k", [("gemma3", "near", 3), ("gemma3", "gemma3-2l", 3),
                                            ("llama", "gemma3-2l", 2), ("mistral", "llama-1l", 4)])
def test_speculation_with_caching_is_lossless(tiny_models, tiny_drafts, near_drafts, target, draft, k):
    m = tiny_models[target]
    d = near_drafts[target] if draft == "near" else tiny_drafts[draft]
    llm = LLM(m.path, draft_model=d.path, num_speculative_tokens=k, **KW)
    spec_on: list = []
    prompts, got, cached = _chat(llm, spec_on)
    assert got == [_hf(m, p) for p in prompts]
    # The draft's cached KV must be right too, which equal outputs cannot show (the target corrects any draft):
    # requests run one at a time verify the same drafts with and without caching, so the draft proposes the same
    # tokens and the same ones are accepted. (The final batch is admitted differently, so it is left out.)
    spec_off: list = []
    _chat(LLM(m.path, draft_model=d.path, num_speculative_tokens=k, enable_prefix_caching=False, **KW), spec_off)
    assert spec_on[:5] == spec_off[:5]
    if draft == "near":
        assert sum(a for _, a in spec_on) > 0
    assert all(c >= 12 for c in cached[1:]), cached
    stats = llm.engine.prefix_cache_stats()
    # Both models cache. A request's hit is the target's; the draft runs at every step here (a fixed k), so it
    # caches what the target does and its own hits cover the requests' too.
    assert stats["target"][1] >= sum(cached) and stats["draft"][1] >= sum(cached) > 0
    assert sum(o.spec.num_drafts for o in llm.generate(TURNS[:1], GREEDY)) > 0  # speculation really runs
    _assert_released(llm)


def _poison_allocations(llm: LLM) -> None:
    """Fill every block a pool hands out, and the null block, with garbage in that model's KV tensors before the
    model can write it: correct code overwrites before it reads (or masks the read)."""
    runners = [("target", llm.executor.target), ("draft", llm.executor.draft)]
    managers = dict(llm.engine.kv_managers())
    gen = torch.Generator().manual_seed(0)
    for model, runner in runners:
        if model not in managers:
            continue
        for g, pool in enumerate(managers[model].pools):
            tensors = runner.kv_caches[g]

            def poison(blocks: list[int], tensors=tensors) -> None:
                for t in tensors:
                    t[:, blocks] = torch.randn(t[:, blocks].shape, generator=gen) * 50

            poison([NULL_BLOCK])
            allocate = pool.allocate

            def poisoned(n: int, allocate=allocate, poison=poison) -> list[int]:
                out = allocate(n)
                poison(out)
                return out

            pool.allocate = poisoned


# num_kv_blocks 17: one 64-token request fits (16 blocks), two long ones do not, so cached blocks are evicted and
# running requests preempted while other requests share their blocks.
# The draft's reads are checked too, which equal outputs cannot show (the target corrects any draft): the poisoned
# run must propose and accept exactly what the same run without poison does (everything else is deterministic).
@pytest.mark.parametrize("draft", [None, "gemma3-2l", "near"])
def test_no_stale_or_foreign_block_is_read_under_eviction_and_preemption(tiny_models, tiny_drafts, near_drafts,
                                                                         draft):
    m = tiny_models["gemma3"]
    kw = dict(KW, num_kv_blocks=17)
    if draft:
        d = near_drafts["gemma3"] if draft == "near" else tiny_drafts[draft]
        kw.update(draft_model=d.path, num_speculative_tokens=3)
    llm = LLM(m.path, **kw)
    _poison_allocations(llm)
    spec_on: list = []
    prompts, got, cached = _chat(llm, spec_on)
    if draft:
        spec_clean: list = []
        _chat(LLM(m.path, **kw), spec_clean)
        assert spec_on == spec_clean
        assert llm.engine.prefix_cache_stats()["draft"][1] > 0  # the draft did read cached blocks
    long_prompts = [SYSTEM + s for s in random_prompts([20, 22, 17], seed=23)]
    outs = llm.generate(long_prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert got == [_hf(m, p) for p in prompts]
    assert [o.token_ids for o in outs] == [hf_greedy(m.hf, p, 24) for p in long_prompts]
    assert sum(o.num_preemptions for o in outs) > 0  # preempted while sharing the system prompt's blocks
    assert sum(pool.num_evictions for _, kv in llm.engine.kv_managers() for pool in kv.pools) > 0
    assert any(c >= 12 for c in cached[1:])
    _assert_released(llm)


def test_poisoning_a_cached_block_is_detected(tiny_models):
    """Negative control of the test above: garbage in a block that a hit does read changes the output."""
    m = tiny_models["llama"]
    llm = LLM(m.path, **KW)
    first = llm.generate([TURNS[0]], GREEDY)[0]
    assert first.token_ids == _hf(m, TURNS[0])
    pool, tensors = llm.engine.target_kv.pools[0], llm.executor.target.kv_caches[0]
    from engine.kv_cache.block_hash import update_block_hashes

    probe = Request("probe", TURNS[1], GREEDY)
    block = pool.lookup(update_block_hashes(probe, 4)[1])
    assert block is not None
    for t in tensors:
        t[:, block] = 50.0
    out = llm.generate([TURNS[1]], GREEDY)[0]
    assert out.num_cached_tokens >= 8 and out.token_ids != _hf(m, TURNS[1])


def test_abort_never_frees_blocks_another_request_uses(tiny_models, tiny_drafts):
    m = tiny_models["gemma3"]
    llm = LLM(m.path, draft_model=tiny_drafts["gemma3-2l"].path, num_speculative_tokens=2, **KW)
    engine = llm.engine
    a = Request("a", TURNS[0], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request(a)
    while a.num_output_tokens < 2:  # a's prompt blocks are computed and cached
        engine.step()
    b = Request("b", TURNS[1], SamplingParams(max_tokens=NEW, ignore_eos=True))
    c = Request("c", TURNS[2], SamplingParams(max_tokens=NEW, ignore_eos=True))
    engine.add_request(b)
    engine.add_request(c)
    engine.step()
    assert b.num_cached_tokens >= 12 and c.num_cached_tokens >= 12
    shared = engine.target_kv.block_table("b", 1)[:3]
    assert shared == engine.target_kv.block_table("a", 1)[:3]  # the full-attention group's blocks are shared
    assert all(engine.target_kv.pools[1].ref_cnt[x] == 3 for x in shared)
    engine.abort_request("a")  # a's references go; b's and c's blocks stay
    assert all(engine.target_kv.pools[1].ref_cnt[x] == 2 for x in shared)
    engine.step()
    engine.abort_request("c")
    while engine.has_unfinished():
        engine.step()
    assert b.output_token_ids == _hf(m, TURNS[1])
    _assert_released(llm)
    # Aborted or not, the blocks stay cached: the next request with the same prefix reuses them.
    assert llm.generate([TURNS[3]], GREEDY)[0].num_cached_tokens >= 12


def test_draft_sitting_out_catches_up_from_the_hit(tiny_models, near_drafts):
    """Load-adaptive speculation: admitted with a hit while the batch is too large to speculate, the draft takes the
    hit's blocks without running; once two requests are gone it catches up from the hit, not from 0."""
    m = tiny_models["gemma3"]
    llm = LLM(m.path, draft_model=near_drafts["gemma3"].path, num_speculative_tokens=3,
              spec_disable_above_batch_size=2, **KW)
    llm.generate([TURNS[0]], GREEDY)  # caches the system prompt in both models (batch 1: the draft runs)
    engine = llm.engine
    reqs = [Request(f"q{i}", p, SamplingParams(max_tokens=16, ignore_eos=True)) for i, p in enumerate(TURNS)]
    for r in reqs:
        engine.add_request(r)
    engine.step()
    assert engine.last_step.draft_length == 0 and all(r.num_cached_tokens >= 12 for r in reqs)
    assert all(engine.draft_kv.has(r.request_id) for r in reqs)  # the hit's blocks, held for the catch-up
    engine.step()
    engine.abort_request("q2")
    engine.abort_request("q3")
    drafted = 0
    while engine.has_unfinished():
        engine.step()
        drafted += engine.last_step.draft_length
    assert drafted > 0
    assert [r.output_token_ids for r in reqs[:2]] == [hf_greedy(m.hf, p, 16) for p in TURNS[:2]]
    _assert_released(llm)


@pytest.mark.parametrize("mode", ["strict", "probabilistic"])
def test_seeded_sampling_does_not_depend_on_the_cache(tiny_models, tiny_drafts, mode):
    """A seed fixes a request's samples whatever else ran before it: a request starting from a hit (one that leaves
    a single prompt token, too) samples what it samples when it computes its whole prompt."""
    m, d = tiny_models["llama"], tiny_drafts["llama-1l"]
    # 17, 21, 25 tokens and so on: every prompt but its last token fills whole blocks, all of them cached
    prompts = [SYSTEM + s for s in random_prompts([3, 7, 11, 15, 3, 7], seed=24)]
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=s, ignore_eos=True) for s in range(len(prompts))]
    # A seeded request draws each step's samples from a generator keyed by its output position at the step's start,
    # so its samples follow its step boundaries; a token budget too small for every decode's drafts moves those
    # (a decode without drafts), cache or no cache. The default budget keeps them to what the request itself sets.
    kw = dict(KW, max_num_batched_tokens=2048)
    cold = LLM(m.path, draft_model=d.path, num_speculative_tokens=4, rejection_sampling=mode,
               enable_prefix_caching=False, **kw)
    warm = LLM(m.path, draft_model=d.path, num_speculative_tokens=4, rejection_sampling=mode, **kw)
    warm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))  # caches every prompt's full blocks
    got = warm.generate(prompts, params)
    assert [o.num_cached_tokens for o in got] == [len(p) - 1 for p in prompts]
    assert [o.token_ids for o in got] == [o.token_ids for o in cold.generate(prompts, params)]
    _assert_released(warm)
