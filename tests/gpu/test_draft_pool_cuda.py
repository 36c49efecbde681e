"""A draft pool on CUDA: two engines (Gemma 3 targets) share one pooled Gemma 3 hybrid draft group, on one GPU split
into fractional bundles, with CUDA graphs. Greedy output equals the target alone token for token, and seeded sampling
equals an engine whose draft group is its own (separate, not colocated, so that both run the draft's side the same
way). Then both again with the pool drafting ahead, in the window and the tree mode."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from conftest import local_ray, random_prompts
from spec_support import run_together

from engine import LLM, SamplingParams
from serving.draft_pool.pool import DraftPoolReplica
from serving.engine_factory import build_ray_engine

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=128, max_num_seqs=8, cuda_graph_batch_sizes=(1, 4, 8))
PROMPTS = random_prompts([3, 21, 9, 40], seed=4)
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SAMPLED = [SamplingParams(max_tokens=32, temperature=0.8, seed=5 + i, ignore_eos=True) for i in range(len(PROMPTS))]
# Three processes on one GPU: each takes a fraction of it.
SHARE = {"GPU": 0.3}


@pytest.fixture(scope="module", autouse=True)
def one_gpu_ray() -> Iterator[None]:
    with local_ray(num_cpus=6, num_gpus=1):
        yield


def _target_alone(args: dict) -> list[list[int]]:
    """Greedy output of the target alone, in process."""
    llm = LLM(args["model"], device="cuda", dtype="float32", seed=3, **KW)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _samples_as_a_group_of_its_own(args: dict, pooled: list[list[int]]) -> None:
    """Seeded sampling through the pool equals an engine whose draft group is its own (same settings)."""
    own = build_ray_engine(**args, draft_placement="separate")
    try:
        assert run_together([own], PROMPTS, SAMPLED) == [pooled]
    finally:
        own.shutdown()


def test_two_engines_share_one_draft_on_cuda(tiny_models, tiny_drafts) -> None:
    args = dict(model=tiny_models["gemma3"].path, draft_model=tiny_drafts["gemma3-2l"].path, device="cuda",
                dtype="float32", seed=3, num_speculative_tokens=3, rejection_sampling="probabilistic",
                target_resources=SHARE, draft_resources=SHARE, adaptive_draft_length=False, **KW)
    pool = DraftPoolReplica.func_or_class(args, "cuda", 2, 60.0)
    engines = [build_ray_engine(**args, draft_pool="cuda") for _ in range(2)]
    try:
        greedy = run_together(engines, PROMPTS, [GREEDY] * len(PROMPTS))
        assert greedy == [_target_alone(args)] * 2
        steps = [t["steps"] for t in ray.get(pool.rank0.pool_stats.remote())["by_tenant"].values()]
        assert len(steps) == 2 and min(steps) > 0
        pooled = run_together(engines, PROMPTS, SAMPLED)
        assert pooled[0] == pooled[1]
    finally:
        for e in engines:
            e.shutdown()
        pool.__del__()
    _samples_as_a_group_of_its_own(args, pooled[0])


@pytest.mark.parametrize("ahead", [dict(speculation_ahead_branches=2), dict(speculation_ahead_tree_fanout=3)],
                         ids=["branches", "tree"])
def test_two_engines_draft_ahead_through_one_pool_on_cuda(tiny_models, near_drafts, ahead) -> None:
    """Speculation ahead on a pooled draft with CUDA graphs (serving/draft_pool/ahead.py): a Llama target and a draft
    near it (windows hit), two engines on one pool drafting ahead (asked for: the fractional bundles would leave it
    off). Greedy equals the target alone, each target's windows hit, every draft block is free again at the end, and
    seeded sampling equals an engine whose own draft group drafts ahead alike."""
    args = dict(model=tiny_models["llama"].path, draft_model=near_drafts["llama"].path, device="cuda",
                dtype="float32", seed=3, num_speculative_tokens=3, rejection_sampling="probabilistic",
                speculation_ahead=True, speculation_ahead_adaptive=False, target_resources=SHARE,
                draft_resources=SHARE, adaptive_draft_length=False, **ahead, **KW)  # a fixed k: windows hit
    name = "cuda-ahead-" + "-".join(ahead)
    pool = DraftPoolReplica.func_or_class(args, name, 2, 60.0)
    engines = [build_ray_engine(**args, draft_pool=name) for _ in range(2)]
    try:
        assert all(e.executor.speculation_ahead for e in engines)
        free = [[kv.num_free for kv in e.draft_kv.pools] for e in engines]
        greedy = run_together(engines, PROMPTS, [GREEDY] * len(PROMPTS))
        assert greedy == [_target_alone(args)] * 2
        stats = ray.get(pool.rank0.pool_stats.remote())
        assert all(t["ahead_hits"] > 0 for t in stats["by_tenant"].values()), stats["by_tenant"]
        assert all(e.speculation_ahead_stats()[1] > 0 for e in engines)
        assert [[kv.num_free for kv in e.draft_kv.pools] for e in engines] == free
        pooled = run_together(engines, PROMPTS, SAMPLED)
        assert pooled[0] == pooled[1]
    finally:
        for e in engines:
            e.shutdown()
        pool.__del__()
    _samples_as_a_group_of_its_own(args, pooled[0])
