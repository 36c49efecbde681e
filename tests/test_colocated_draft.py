"""A draft colocated with the target (RayExecutor's draft_placement "colocated"): each target rank builds the draft
in its own process, on its tensor-parallel group, and runs the whole step there (one graph node per rank), as the
in-process engine does. On a real local Ray runtime, tensor parallel over gloo: greedy output equals the target
alone and the separate layout token for token, a seeded sampled run equals the in-process engine's, ends inside a
step in flight free both models' blocks, and a dead rank rebuilds the whole engine (the draft cannot go alone).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Iterator

import pytest
import ray
import torch
from conftest import TinyModel, local_ray, random_prompts, run_to_completion

from engine import LLM, SamplingParams
from engine.engine_core import EngineCore
from engine.request import Request
from engine.step.plan import StepPlan, StepResult
from serving.engine_factory import build_ray_engine
from serving.router.router import Router
from serving.workers.health import WorkerDiedError
from serving.workers.ray_executor import RayExecutor
from serving.workers.worker import ModelWorker

PROMPTS = random_prompts([3, 9, 17], seed=5)
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
ENGINE_KW = dict(block_size=4, max_model_len=64, max_num_batched_tokens=20)
SEEDED = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2)]


@pytest.fixture(scope="module", autouse=True)
def ray_runtime() -> Iterator[None]:
    # 4 CPUs of bookkeeping on a 2-core box: each worker runs one torch thread and the models are tiny.
    with local_ray(num_cpus=4):
        yield


_ALONE: dict[str, list[list[int]]] = {}
_SEPARATE: dict[tuple[str, int], list[tuple[list[int], int]]] = {}


def target_alone(path: str) -> list[list[int]]:
    if path not in _ALONE:
        _ALONE[path] = [o.token_ids for o in LLM(path, **ENGINE_KW).generate(PROMPTS, GREEDY)]
    return _ALONE[path]


def colocated(target: str, draft: str, tp: int = 1, **kw: object) -> EngineCore:
    return build_ray_engine(target, draft, num_speculative_tokens=3, rejection_sampling="probabilistic",
                            tensor_parallel_size=tp, draft_tensor_parallel_size=tp, draft_placement="colocated",
                            seed=5, **ENGINE_KW, **kw)


def test_worker_spec_step_replays_the_local_executor(tiny_models: dict[str, TinyModel],
                                                     near_drafts: dict[str, TinyModel]) -> None:
    """In process, no Ray: a target ModelWorker with the draft colocated, fed the plans LocalExecutor ran (seeded and
    unseeded sampling, async scheduling's open entries), returns its results exactly through `spec_step`."""
    target, draft = tiny_models["gemma3"].path, near_drafts["gemma3"].path
    llm = LLM(target, draft_model=draft, num_speculative_tokens=3, seed=3, async_scheduling=True, **ENGINE_KW)
    executor = llm.engine.executor
    steps: list[tuple[StepPlan, StepResult]] = []
    run_step = executor.step.run
    executor.step.run = lambda plan: steps.append((plan, run_step(plan))) or steps[-1][1]  # type: ignore[method-assign]
    llm.generate(PROMPTS, [GREEDY, SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True), SEEDED[0]])
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    try:
        worker = ModelWorker("target", target, dict(device="cpu", dtype="float32", seed=3, **ENGINE_KW),
                             rejection_sampling="probabilistic", cpu_threads=threads, draft_model_path=draft)
    finally:
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)
        gc.unfreeze()  # a worker freezes its process's heap once started: not the test process's
    info = worker.info()
    assert (info.draft_kv_groups, info.draft_num_blocks) == (executor.draft_kv_groups, executor.draft_num_blocks)
    assert len(info.draft_kv_groups) == 2  # the hybrid draft's sliding and full groups
    for plan, expected in steps:
        result = worker.spec_step(plan)
        assert (result.sampled, result.num_accepted) == (expected.sampled, expected.num_accepted)
    assert any(any(r.num_accepted) for _, r in steps)
    with pytest.raises(ValueError, match="only a target worker"):
        ModelWorker("draft", draft, dict(device="cpu", dtype="float32", **ENGINE_KW), draft_model_path=draft)


# Pairwise over (family, tp, async scheduling): each pair of values meets once, in four cases instead of eight (the
# suite's time budget); every case still checks against the target alone and the separate layout.
@pytest.mark.parametrize("family,tp,async_scheduling", [("llama", 1, False), ("llama", 2, True), ("gemma3", 1, True),
                                                        ("gemma3", 2, False)])
def test_colocated_greedy_equals_target_alone_and_separate_layout(
        tiny_models: dict[str, TinyModel], near_drafts: dict[str, TinyModel], family: str, tp: int,
        async_scheduling: bool) -> None:
    """A llama pair and a Gemma 3 target with a hybrid (sliding + full) draft, both models at TP 1 and TP 2, async
    scheduling on and off: one graph node per rank, the draft's KV caches reported from the target's ranks, greedy
    tokens equal the target alone and (tokens and accepted drafts) the separate layout's."""
    target, draft = tiny_models[family].path, near_drafts[family].path
    # Accepted drafts are compared across layouts, run for run: a fixed k (the draft length rule off).
    engine = colocated(target, draft, tp, async_scheduling=async_scheduling, adaptive_draft_length=False)
    executor = engine.executor
    try:
        assert isinstance(executor, RayExecutor) and executor.colocated and executor.draft is None
        assert executor.async_scheduling == engine.async_scheduling == async_scheduling
        assert not executor.pipelined and not executor.speculation_ahead
        assert len(executor.draft_kv_groups) == (2 if family == "gemma3" else 1) and executor.draft_num_blocks > 0
        assert [role for role, _, _ in executor.workers()] == ["target"] * tp
        reqs = run_to_completion(engine, PROMPTS, [GREEDY] * len(PROMPTS))
        phases = engine.last_step.phase_seconds
        assert "propose" in phases and "handoff" not in phases  # no proposal crossed processes
        # The worker's time between two steps is booked apart from the router's dispatch (one host here).
        assert phases["between"] >= 0.0 and phases["dispatch"] >= 0.0
    finally:
        executor.shutdown()
    got = [(r.output_token_ids, r.spec.num_accepted_tokens) for r in reqs]
    assert [tokens for tokens, _ in got] == target_alone(target)
    assert sum(accepted for _, accepted in got) > 0
    if (family, tp) not in _SEPARATE:
        separate = build_ray_engine(target, draft, num_speculative_tokens=3, rejection_sampling="probabilistic",
                                    tensor_parallel_size=tp, draft_tensor_parallel_size=tp, seed=5,
                                    adaptive_draft_length=False, **ENGINE_KW)
        try:
            assert separate.executor.draft is not None and not separate.executor.colocated
            _SEPARATE[family, tp] = [(r.output_token_ids, r.spec.num_accepted_tokens)
                                     for r in run_to_completion(separate, PROMPTS, [GREEDY] * len(PROMPTS))]
        finally:
            separate.executor.shutdown()
    assert got == _SEPARATE[family, tp]


@pytest.mark.parametrize("family,tp", [("gemma3", 1), ("llama", 2)])
def test_colocated_seeded_sampling_equals_the_in_process_engine(
        tiny_models: dict[str, TinyModel], near_drafts: dict[str, TinyModel], family: str, tp: int) -> None:
    target, draft = tiny_models[family].path, near_drafts[family].path
    local = LLM(target, draft_model=draft, num_speculative_tokens=3, seed=5, async_scheduling=True, **ENGINE_KW)
    expected = [o.token_ids for o in local.generate(PROMPTS[:2], SEEDED)]
    engine = colocated(target, draft, tp)
    try:
        reqs = run_to_completion(engine, PROMPTS[:2], SEEDED)
    finally:
        engine.executor.shutdown()
    assert [r.output_token_ids for r in reqs] == expected
    assert expected[0] != target_alone(target)[0]  # really sampled


def test_colocated_ends_inside_a_step_free_both_models_blocks(tiny_models: dict[str, TinyModel]) -> None:
    """A draft equal to the target accepts everything, so a request's last tokens land while its next step is in
    flight: a stop token, max_tokens and an abort there end it at the right token, and once everything has landed
    neither model holds a block and the rank's table forgets the requests."""
    path = tiny_models["llama"].path
    ref = target_alone(path)
    stop = next(j for j in range(2, len(ref[0])) if ref[0][j] not in ref[0][:j])
    params = [SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=[ref[0][stop]], ignore_eos=True),
              SamplingParams(max_tokens=7, ignore_eos=True), GREEDY]
    engine = build_ray_engine(path, path, num_speculative_tokens=4, draft_placement="colocated",
                              adaptive_draft_length=False, **ENGINE_KW)  # drafts every step: runs land mid-flight
    try:
        assert engine.async_scheduling
        reqs = [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))]
        for r in reqs:
            engine.add_request(r)
        while reqs[2].num_output_tokens < 2 and engine.has_unfinished():
            engine.step()
        assert reqs[2].inflight is not None  # a step of it is in flight now
        engine.abort_request("r2")  # a step of it is in flight: its tokens are dropped when it lands
        n_out = reqs[2].num_output_tokens
        while engine.has_unfinished():
            engine.step()
        assert reqs[0].output_token_ids == ref[0][:stop + 1] and reqs[0].finish_reason == "stop"
        assert reqs[1].output_token_ids == ref[1][:7] and reqs[1].finish_reason == "length"
        assert reqs[2].finish_reason == "abort" and reqs[2].num_output_tokens == n_out
        assert reqs[2].output_token_ids == ref[2][:n_out]
        assert not engine.in_flight.deferred_free
        used = {model: kv.num_used_blocks() for model, kv in engine.kv_managers()}
        assert set(used) == {"target", "draft"} and all(n == 0 for g in used.values() for n in g), used
        # The next plan tells the rank that they ended.
        last = run_to_completion(engine, [PROMPTS[0]], [SamplingParams(max_tokens=2, ignore_eos=True)])[0]
        known = ray.get(engine.executor.target.workers[0].__ray_call__.remote(lambda w: sorted(w.table.requests)))
        assert known == [last.request_id]
    finally:
        engine.executor.shutdown()


def test_colocated_placement_is_checked_before_any_worker_starts(tiny_models: dict[str, TinyModel]) -> None:
    path = tiny_models["llama"].path
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size=1, tensor_parallel_size=2"):
        build_ray_engine(path, path, tensor_parallel_size=2, draft_placement="colocated", **ENGINE_KW)
    with pytest.raises(ValueError, match="draft_placement must be one of"):
        build_ray_engine(path, path, draft_placement="shared", **ENGINE_KW)


def test_a_dead_colocated_worker_rebuilds_the_whole_engine(tiny_models: dict[str, TinyModel],
                                                           near_drafts: dict[str, TinyModel]) -> None:
    """A router with continue_without_draft: a colocated draft cannot be detached (the engine keeps speculating),
    and when its rank dies the requests in flight get a 503 and the router builds a new engine, both models
    colocated again, which serves the target's greedy tokens."""
    target = tiny_models["llama"].path
    args = dict(model=target, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
                draft_placement="colocated", **ENGINE_KW)
    greedy = dict(max_tokens=NEW_TOKENS, ignore_eos=True)

    async def scenario() -> None:
        router = Router(args, continue_without_draft=True)
        gc.unfreeze()  # a router freezes its process's heap once started: not the test process's
        old = router.engine
        try:
            with pytest.raises(RuntimeError, match="colocated"):
                old.detach_draft()
            assert old.spec_config is not None and old.draft_kv is not None
            assert not router.recovery.serve_without_draft(WorkerDiedError("a draft rank died", "draft"))
            ray.kill(old.executor.target.workers[0])
            deadline = time.monotonic() + 30
            with pytest.raises(WorkerDiedError, match="target worker rank 0"):
                while time.monotonic() < deadline:  # the kill is asynchronous
                    old.executor.check_health()
                    await asyncio.sleep(0.2)
            deltas = [d async for d in router.generate("dies", PROMPTS[0], greedy)]
            assert deltas[-1].get("status") == 503, deltas
            assert router.recovery.task is not None
            await router.recovery.task
            assert router.engine is not old and router.recovery.unhealthy is None and router.recovery.degraded is None
            assert router.engine.executor.colocated and router.engine.spec_config is not None
            tokens = [t async for d in router.generate("again", PROMPTS[0], greedy) for t in d["token_ids"]]
            assert tokens == target_alone(target)[0]
        finally:
            router.engine.shutdown()
            old.shutdown()

    asyncio.run(scenario())
