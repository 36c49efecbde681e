"""Prefix caching while the draft sits steps out (k = 0): each model starts from its own cached prefix.

A draft that does not run caches nothing new, so its cached prefix falls behind the target's. A new request still
starts the target from the target's whole hit (`Request.num_cached_tokens`, the engine's prefix-cache counters),
and the draft catches up on the positions between its own hit and the target's the next time it runs for that
request. Checked through the engine: greedy output equals the target alone and HF; once k turns back on the draft's
KV is complete and right, which equal outputs cannot show (the target corrects any draft), so a draft equal to the
target (self-speculation) must have its drafts accepted, and a near draft must propose and have accepted exactly
what it does when nothing is cached. Synchronous and asynchronous scheduling (an asynchronous step leaves a decode's
input to the sides, which never saw the draft's gap: the scheduler sends it explicitly). The same with the draft's
ranks in processes of their own: tests/test_ray_executor.py.
"""

from __future__ import annotations

import pytest
from conftest import hf_greedy, random_prompts

from engine import LLM, SamplingParams
from engine.engine_core import EngineCore
from engine.request import Request

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3
NEW = 12
# A fixed k that the test switches (the draft length rule off): k = 0 stands for a draft the rule turned off.
KW = dict(block_size=4, max_model_len=64, max_num_batched_tokens=20, adaptive_draft_length=False,
          num_speculative_tokens=K, rejection_sampling="strict")
SHARED = random_prompts([32], seed=31)[0]  # 8 full blocks
PROMPTS = [SHARED + tail for tail in random_prompts([7, 5], seed=32)]
WARM = SHARED[:12] + random_prompts([6], seed=33)[0]  # the draft caches only the shared 3 first blocks


def _engine(path: str, draft: str, caching: bool = True, async_scheduling: bool = False) -> tuple[LLM, list[int]]:
    """An engine whose every step's k is `k[0]` (the list returned)."""
    llm = LLM(path, draft_model=draft, enable_prefix_caching=caching, async_scheduling=async_scheduling, **KW)
    return llm, fix_k(llm.engine)


def fix_k(engine: EngineCore) -> list[int]:
    """Make every step's k `k[0]` (the list returned) from now on."""
    k = [K]
    engine.scheduler.draft_length_fn = lambda batch: k[0]
    return k


def run_one(engine: EngineCore, k: list[int], prompt: list[int], k_on_after: int | None) -> Request:
    """Run one request to the end at k = 0, with k back at K once it has `k_on_after` output tokens (None: never)."""
    r = Request(f"r{len(engine.scheduler.requests)}-{len(prompt)}-{k_on_after}", prompt,
                SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    k[0] = 0
    engine.add_request(r)
    while engine.has_unfinished():
        if k_on_after is not None and r.num_output_tokens >= k_on_after:
            k[0] = K
        engine.step()
    return r


def workload(engine: EngineCore, k: list[int]) -> list[Request]:
    """Both models cache WARM's blocks (k = K); then, with the draft off, the target caches SHARED's and the draft
    caches nothing more; then PROMPTS[0] with the draft off throughout, and PROMPTS[1] with it back on after 2
    tokens. Returns the last two requests."""
    run_one(engine, k, WARM, 0)
    run_one(engine, k, SHARED, None)
    return [run_one(engine, k, PROMPTS[0], None), run_one(engine, k, PROMPTS[1], 2)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_target_takes_its_whole_hit_while_the_draft_is_off(tiny_models, async_scheduling):
    m = tiny_models["llama"]
    llm, k = _engine(m.path, m.path, async_scheduling=async_scheduling)  # self-speculation: every draft is right
    engine = llm.engine

    def count(model: str) -> int:
        return engine.prefix_cache_stats()[model][1]

    run_one(engine, k, WARM, 0)
    run_one(engine, k, SHARED, None)
    hits_before = {model: count(model) for model in ("target", "draft")}
    off = run_one(engine, k, PROMPTS[0], None)
    # The target skips SHARED's 8 blocks, though the draft holds only WARM's first 3 of them.
    assert off.num_cached_tokens == len(SHARED)
    assert count("target") - hits_before["target"] == len(SHARED) and count("draft") - hits_before["draft"] == 12
    assert off.spec.num_drafts == 0 and off.num_draft_computed_tokens == 12  # the draft never ran for it
    on = run_one(engine, k, PROMPTS[1], 2)
    assert on.num_cached_tokens == len(SHARED)
    # Back at k = K the draft caught up from its own hit: a draft equal to the target then proposes the target's
    # own tokens, and (greedy, strict) they are accepted. Garbage KV between the two hits would cost acceptance.
    assert on.spec.num_drafts > 0 and on.spec.num_accepted_tokens == on.spec.num_draft_tokens, on.spec
    target_alone = LLM(m.path, **{n: v for n, v in KW.items() if n not in ("num_speculative_tokens",
                                                                           "rejection_sampling",
                                                                           "adaptive_draft_length")})
    expected = [o.token_ids for o in target_alone.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0,
                                                                                    ignore_eos=True))]
    assert [off.output_token_ids, on.output_token_ids] == expected == [hf_greedy(m.hf, p, NEW) for p in PROMPTS]
    for _, kv in engine.kv_managers():
        assert kv.num_used_blocks() == [0] * kv.num_groups


def test_drafts_after_the_catch_up_equal_those_without_caching(tiny_models, near_drafts):
    """The draft's KV after catching up from its hit is what computing everything gives: the near draft proposes,
    and has accepted, exactly what it does with caching off, step for step."""
    m, d = tiny_models["llama"], near_drafts["llama"]
    warm_llm, warm_k = _engine(m.path, d.path)
    cold_llm, cold_k = _engine(m.path, d.path, caching=False)
    warm, cold = workload(warm_llm.engine, warm_k), workload(cold_llm.engine, cold_k)
    assert [r.num_cached_tokens for r in warm] == [len(SHARED)] * 2 and [r.num_cached_tokens for r in cold] == [0, 0]
    spec = [[(r.spec.num_drafts, r.spec.num_accepted_tokens) for r in rs] for rs in (warm, cold)]
    assert spec[0] == spec[1] and spec[0][1][0] > 0, spec
    assert [r.output_token_ids for r in warm] == [r.output_token_ids for r in cold]
    assert [r.output_token_ids for r in warm] == [hf_greedy(m.hf, p, NEW) for p in PROMPTS]
