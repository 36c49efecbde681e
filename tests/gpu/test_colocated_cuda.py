"""A colocated draft on CUDA: one target worker process owns both models, both KV caches (the draft's sized from the
memory the target left) and both models' CUDA graphs, and runs whole steps through `spec_step`. In process, fed the
plans the local executor ran, it returns the local executor's results exactly; on a real local Ray runtime with one
GPU, greedy output equals the target alone token for token."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
from conftest import local_ray, random_prompts, run_to_completion

from engine import LLM, SamplingParams
from engine.step.plan import StepPlan, StepResult
from serving.engine_factory import build_ray_engine
from serving.workers.ray_executor import RayExecutor
from serving.workers.worker import ModelWorker

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=256, max_num_seqs=8, cuda_graph_batch_sizes=(1, 4, 8))
PROMPTS = random_prompts([3, 21, 9, 40], seed=4)
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def test_worker_spec_step_on_cuda_replays_the_local_executor(tiny_models, tiny_drafts) -> None:
    """A Gemma 3 target with its hybrid (sliding + full) draft, float32 on CUDA with graphs: a colocated target
    worker fed the local executor's plans (greedy, unseeded and seeded sampling, asynchronous scheduling's open
    entries) returns the same tokens and accepted counts, replaying both models' graphs."""
    target, draft = tiny_models["gemma3"].path, tiny_drafts["gemma3-2l"].path
    kw = dict(device="cuda", dtype="float32", seed=3, **KW)
    llm = LLM(target, draft_model=draft, num_speculative_tokens=3, async_scheduling=True, **kw)
    executor = llm.engine.executor
    steps: list[tuple[StepPlan, StepResult]] = []
    run_step = executor.step.run
    executor.step.run = lambda plan: steps.append((plan, run_step(plan))) or steps[-1][1]  # type: ignore[method-assign]
    params = [GREEDY, SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=32, temperature=0.7, seed=11, ignore_eos=True), GREEDY]
    llm.generate(PROMPTS, params)
    interval = sys.getswitchinterval()
    try:
        worker = ModelWorker("target", target, dict(kw, num_speculative_tokens=3), rejection_sampling="probabilistic",
                             draft_model_path=draft)
    finally:
        sys.setswitchinterval(interval)
    assert worker.runner.device.type == "cuda" and worker.draft_runner is not None
    assert len(worker.draft_runner.kv_groups) == 2
    for plan, expected in steps:
        result = worker.spec_step(plan)
        assert (result.sampled, result.num_accepted) == (expected.sampled, expected.num_accepted)
    assert any(any(r.num_accepted) for _, r in steps)
    loop = worker.spec.draft.proposer.loop
    assert loop is not None and loop.num_graph_replays > 0


@pytest.fixture(scope="module")
def one_gpu_ray() -> Iterator[None]:
    with local_ray(num_cpus=4, num_gpus=1):
        yield


@pytest.mark.parametrize("target,draft,placement", [("llama", "near", "colocated"), ("gemma3", "gemma3-2l", None)])
def test_colocated_greedy_equals_target_alone_on_cuda(one_gpu_ray, tiny_models, tiny_drafts, near_drafts,
                                                      target: str, draft: str, placement: str | None) -> None:
    """placement None: the default ("auto"), which colocates the draft on a cluster of one GPU."""
    t = tiny_models[target].path
    d = near_drafts[target].path if draft == "near" else tiny_drafts[draft].path
    base = [o.token_ids for o in LLM(model=t, device="cuda", dtype="float32", **KW).generate(PROMPTS, GREEDY)]
    torch.cuda.empty_cache()
    engine = build_ray_engine(t, d, num_speculative_tokens=3, device="cuda", dtype="float32",
                              adaptive_draft_length=False,  # a fixed k: the accepted drafts are counted
                              seed=5, **({"draft_placement": placement} if placement else {}), **KW)
    executor = engine.executor
    try:
        assert isinstance(executor, RayExecutor) and executor.colocated and executor.draft is None
        reqs = run_to_completion(engine, PROMPTS, [GREEDY] * len(PROMPTS))
        assert [r.output_token_ids for r in reqs] == base
        assert sum(r.spec.num_accepted_tokens for r in reqs) > 0
        assert "handoff" not in engine.last_step.phase_seconds  # no proposal crossed processes
    finally:
        executor.shutdown()
