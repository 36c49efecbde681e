"""Two engines sharing one pooled draft group, on a real local Ray without Serve: a Llama target with a Gemma 3
hybrid draft (two KV-cache groups in each target's share) at tensor parallel 2, the two engines stepped in turn with
the same request ids.
Greedy output equals the target alone in process; seeded sampling equals an engine with a draft group of its own
(each target's proposals come from a DraftSide of its own, seeded alike); an engine that shuts down frees its share.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from conftest import TinyModel, local_ray, random_prompts
from spec_support import run_together

from engine import LLM, SamplingParams
from serving.draft_pool import DraftPoolReplica
from serving.engine_factory import build_ray_engine

PROMPTS = random_prompts([3, 9, 17], seed=5)
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
ENGINE_KW = dict(block_size=4, max_model_len=64, max_num_batched_tokens=20)


@pytest.fixture(scope="module", autouse=True)
def ray_runtime() -> Iterator[None]:
    with local_ray(num_cpus=6):
        yield


@pytest.fixture(scope="module")
def engine_args(tiny_models: dict[str, TinyModel], tiny_drafts: dict[str, TinyModel]) -> dict:
    # The draft split over two ranks: rank 0 forwards each target's calls to rank 1 in the order it runs them.
    return dict(model=tiny_models["llama"].path, draft_model=tiny_drafts["gemma3-2l"].path, device="cpu",
                num_speculative_tokens=3, rejection_sampling="probabilistic", draft_tensor_parallel_size=2,
                **ENGINE_KW)


def test_two_engines_share_one_hybrid_draft(engine_args: dict) -> None:
    pool = DraftPoolReplica.func_or_class(engine_args, "unit", 2, 60.0)
    rank0 = pool.rank0
    engines = [build_ray_engine(**engine_args, draft_pool="unit") for _ in range(2)]
    try:
        stats = ray.get(rank0.pool_stats.remote())
        assert stats["tenants"] == 2 and sorted(t["slot"] for t in stats["by_tenant"].values()) == [0, 1]
        assert [e.executor.draft_num_blocks for e in engines] == [stats["blocks_per_slot"] + 1] * 2
        assert all(len(e.draft_kv.pools) == 2 for e in engines)  # the hybrid draft's two KV-cache groups

        greedy = run_together(engines, PROMPTS, [GREEDY] * len(PROMPTS))
        expected = [o.token_ids for o in LLM(engine_args["model"], **ENGINE_KW).generate(PROMPTS, GREEDY)]
        assert greedy == [expected, expected]
        steps = [t["steps"] for t in ray.get(rank0.pool_stats.remote())["by_tenant"].values()]
        assert len(steps) == 2 and min(steps) > 0  # both speculated, through the one group

        sampled = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, seed=7 + i, ignore_eos=True)
                   for i in range(len(PROMPTS))]
        pooled = run_together(engines, PROMPTS, sampled)
        assert pooled[0] == pooled[1]

        engines.pop().shutdown()  # detaches: its share and its requests' draft state are freed
        stats = ray.get(rank0.pool_stats.remote())
        assert stats["tenants"] == 1 and "detached" in stats["evicted"][-1]
    finally:
        for e in engines:
            e.shutdown()
        pool.__del__()
    own = build_ray_engine(**engine_args)  # a draft group of its own
    try:
        assert run_together([own], PROMPTS, sampled) == [pooled[0]]
    finally:
        own.shutdown()
