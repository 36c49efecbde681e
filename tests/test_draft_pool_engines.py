"""Two engines sharing one pooled draft group, on a real local Ray without Serve: a Llama target with a Gemma 3
hybrid draft (two KV-cache groups in each target's share) at tensor parallel 2 drafting ahead, the two engines run
with the same request ids. Greedy output equals the target alone in process, with the engines stepped at once
beside a third target that keeps the draft busy, so that their draft steps meet in batches; seeded sampling equals
an engine with a draft group of its own (each target's proposals drawn from its requests' own generators, seeded
alike); an engine that shuts down frees its share. Then speculation ahead's tree mode through a pool: windows hit
per target, and a target's draft blocks and scratch are freed.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import pytest
import ray
from conftest import TinyModel, local_ray, random_prompts
from spec_support import run_together
from test_ray_executor import ENGINE_KW, GREEDY, NEW_TOKENS, PROMPTS  # the Ray executor tests' requests

from engine import LLM, SamplingParams
from engine.step.plan import PlannedRequest, StepPlan
from serving.draft_pool.pool import DraftPoolReplica
from serving.engine_factory import build_ray_engine


@pytest.fixture(scope="module", autouse=True)
def ray_runtime() -> Iterator[None]:
    with local_ray(num_cpus=6):
        yield


@pytest.fixture(scope="module")
def engine_args(tiny_models: dict[str, TinyModel], tiny_drafts: dict[str, TinyModel]) -> dict:
    # The draft split over two ranks: rank 0 forwards each target's calls to rank 1 in the order it runs them. It
    # drafts ahead, two windows a request (serving/draft_pool/ahead.py): both ranks draft the same windows ahead.
    return dict(model=tiny_models["llama"].path, draft_model=tiny_drafts["gemma3-2l"].path, device="cpu",
                num_speculative_tokens=3, rejection_sampling="probabilistic", draft_tensor_parallel_size=2,
                speculation_ahead=True, speculation_ahead_branches=2, **ENGINE_KW)


def test_two_engines_share_one_hybrid_draft(engine_args: dict) -> None:
    pool = DraftPoolReplica.func_or_class(engine_args, "unit", 3, 60.0)  # two engines and a busy third target
    rank0 = pool.rank0
    engines = [build_ray_engine(**engine_args, draft_pool="unit") for _ in range(2)]
    try:
        stats = ray.get(rank0.pool_stats.remote())
        assert stats["tenants"] == 2 and sorted(t["slot"] for t in stats["by_tenant"].values()) == [0, 1]
        assert [e.executor.draft_num_blocks for e in engines] == [stats["blocks_per_slot"] + 1] * 2
        assert all(len(e.draft_kv.pools) == 2 for e in engines)  # the hybrid draft's two KV-cache groups

        # Greedy, the engines running at once while a third target keeps the draft busy, so that their draft steps
        # queue up and meet in batches: each engine's output is still the target's alone.
        with BusyTenant(rank0, stats["blocks_per_slot"]) as busy:
            greedy = _at_once(engines, PROMPTS, [GREEDY] * len(PROMPTS))
        expected = [o.token_ids for o in LLM(engine_args["model"], **ENGINE_KW).generate(PROMPTS, GREEDY)]
        assert greedy == [expected, expected]
        stats = ray.get(rank0.pool_stats.remote())
        steps = [t["steps"] for t in stats["by_tenant"].values()]
        assert len(steps) == 2 and min(steps) > 0  # both speculated, through the one group
        assert busy.steps > 0 and not busy.errors, busy.errors
        assert any(size > 1 for size in stats["batch_tenants"]), stats["batch_tenants"]
        assert stats["speculation_ahead"]["passes"] > 0 and stats["speculation_ahead"]["lookups"] > 0, stats
        # Batched draft steps draft ahead for all of their targets in one pass.
        assert any(n > 1 for n in stats["speculation_ahead"]["pass_tenants"]), stats["speculation_ahead"]

        sampled = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, seed=7 + i, ignore_eos=True)
                   for i in range(len(PROMPTS))]
        pooled = run_together(engines, PROMPTS, sampled)
        assert pooled[0] == pooled[1]

        engines.pop().shutdown()  # detaches (its call may run after the next: rank 0 runs calls in threads)
        deadline = time.monotonic() + 30
        while (stats := ray.get(rank0.pool_stats.remote()))["tenants"] != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stats["tenants"] == 1 and "detached" in stats["evicted"][-1]  # its share and draft state are freed
    finally:
        for e in engines:
            e.shutdown()
        pool.__del__()
    own = build_ray_engine(**engine_args)  # a draft group of its own
    try:
        assert run_together([own], PROMPTS, sampled) == [pooled[0]]
    finally:
        own.shutdown()


def test_two_engines_draft_ahead_through_one_pooled_draft(tiny_models: dict[str, TinyModel], near_llama: str) -> None:
    """Speculation ahead on a pooled draft (serving/draft_pool/ahead.py): two engines with the same request ids,
    stepped at once, one draft group drafting ahead for both in tree mode (the window mode, two windows a request,
    drafts ahead in the test above, at tensor parallel 2 beside a busy third target). Greedy equals
    the target alone; each engine's windows hit (its own counters, as its proposals report them, and the pool's);
    each engine learns the pool's runs ahead for its fan-out budget (held at the configured fan-out here: on CPU
    the adaptive budget would find no room for a tree beside a tiny verify); once the requests finish each engine's
    share of the draft's KV blocks is free again, and a target that leaves frees the scratch its windows held.
    Seeded sampling equals an engine with a draft group of its own drafting ahead alike."""
    target = tiny_models["llama"].path
    args = dict(model=target, draft_model=near_llama, device="cpu", num_speculative_tokens=3, seed=5,
                speculation_ahead=True, speculation_ahead_tree_fanout=2, speculation_ahead_adaptive=False, **ENGINE_KW)
    pool_name = "ahead-tree"
    pool = DraftPoolReplica.func_or_class(args, pool_name, 2, 60.0)
    rank0 = pool.rank0
    engines = [build_ray_engine(**args, draft_pool=pool_name) for _ in range(2)]
    try:
        assert all(e.executor.speculation_ahead and e.scheduler.speculation_ahead and e.executor.ahead_overlaps_verify
                   for e in engines)
        free = [[kv.num_free for kv in e.draft_kv.pools] for e in engines]
        greedy = _at_once(engines, PROMPTS, [GREEDY] * len(PROMPTS))
        expected = [o.token_ids for o in LLM(target, **ENGINE_KW).generate(PROMPTS, GREEDY)]
        assert greedy == [expected, expected]
        stats = ray.get(rank0.pool_stats.remote())
        assert stats["speculation_ahead"]["hits"] > 0 and stats["speculation_ahead"]["passes"] > 0, stats
        by_tenant = stats["by_tenant"]
        assert len(by_tenant) == 2 and all(t["ahead_hits"] > 0 for t in by_tenant.values()), by_tenant
        # Each engine reports its own target's counters (its metrics), and together they are the pool's.
        totals = [e.speculation_ahead_stats() for e in engines]
        assert all(t[1] > 0 for t in totals), totals
        assert sum(t[1] for t in totals) <= stats["speculation_ahead"]["hits"]
        assert stats["speculation_ahead"]["trees"] > 0
        assert all(e.speculation_ahead.budget.node_seconds is not None for e in engines)
        assert [[kv.num_free for kv in e.draft_kv.pools] for e in engines] == free
        sampled = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, seed=7 + i, ignore_eos=True)
                   for i in range(len(PROMPTS))]
        pooled = run_together(engines, PROMPTS, sampled)
        # A target that leaves frees its windows' scratch (held until its next step otherwise).
        gone = engines.pop()
        gone_id = gone.executor.draft.workers[0].share.tenant_id
        gone.shutdown()
        deadline = time.monotonic() + 30
        while gone_id in (stats := ray.get(rank0.pool_stats.remote()))["by_tenant"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone_id not in stats["by_tenant"]
        held = ray.get(rank0.__ray_call__.remote(lambda self: self.pool_ahead.ahead.scratch_held(gone_id)))
        assert held == 0
    finally:
        for e in engines:
            e.shutdown()
        pool.__del__()
    assert pooled[0] == pooled[1]
    own = build_ray_engine(**args)  # a draft group of its own
    try:
        assert run_together([own], PROMPTS, sampled) == [pooled[0]]
    finally:
        own.shutdown()


def _at_once(engines: list, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    """As run_together (the same request ids, each engine in another order, so that the same ids and local block ids
    hold different tokens in each), but each engine stepped in a thread of its own, all at once."""
    n = len(prompts)
    outs: list = [None] * len(engines)

    def run(i: int) -> None:
        order = [(j + i) % n for j in range(n)]
        got = run_together([engines[i]], [prompts[j] for j in order], [params[j] for j in order])[0]
        outs[i] = [got[order.index(j)] for j in range(n)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


class BusyTenant:
    """A third target attached by hand that keeps the draft group busy: prefill plans of long prompts, one after
    another (each a new request, the last one finished), while the block holds."""

    def __init__(self, rank0, blocks: int) -> None:
        self.rank0, self.steps, self.errors = rank0, 0, []
        share = ray.get(rank0.attach_tenant.remote("busy"))
        assert blocks >= 6 * 16, blocks
        self.tables = [list(range(1, 1 + blocks))[:16] for _ in share.kv_groups]  # 64 tokens of block size 4
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _plan(self, n: int) -> StepPlan:
        prompts = random_prompts([60] * 6, seed=n)
        # Six requests in blocks of their own within the share (the same blocks every step: each prefills anew).
        reqs = [PlannedRequest(f"b{n}-{i}", p, 0, 3, True, [], draft_token_ids=p, draft_start_pos=0,
                               draft_block_tables=[[b + 16 * i for b in t] for t in self.tables], draft_runs=True)
                for i, p in enumerate(prompts)]
        return StepPlan(n, reqs, "probabilistic", finished_ids=[f"b{n - 1}-{i}" for i in range(6)] if n else [])

    def _run(self) -> None:
        seq = itertools.count()
        while not self._stop.is_set():
            try:
                ray.get(self.rank0.tenant_draft_step.remote("busy", next(seq), self._plan(self.steps)))
                self.steps += 1
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.errors.append(e)
                return

    def __enter__(self) -> BusyTenant:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        ray.get(self.rank0.detach_tenant.remote("busy"))
