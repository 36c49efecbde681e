"""A model worker's step methods in process, without Ray: the draft's and the target's ModelWorker, fed the plans the
in-process engine ran, return its results. tests/test_ray_executor.py runs the same workers as Ray actors."""

from __future__ import annotations

import gc
import sys

import torch
from conftest import TinyModel
from test_ray_executor import ENGINE_KW, GREEDY, NEW_TOKENS, PROMPTS

from engine import LLM, SamplingParams
from engine.step.plan import StepPlan, StepResult
from serving.workers.worker import ModelWorker


def test_worker_methods_replay_the_local_executor(tiny_models: dict[str, TinyModel], near_llama: str) -> None:
    """In process, no Ray: a draft and a target ModelWorker (engine config as a plain dict) fed the plans that
    LocalExecutor ran, through the methods the compiled graph binds (the verify input prepared from the plan alone,
    the proposal handed over as host lists), return its results exactly, step by step, sampled tokens included."""
    llm = LLM(tiny_models["llama"].path, draft_model=near_llama, num_speculative_tokens=3, seed=3, **ENGINE_KW)
    executor = llm.engine.executor
    steps: list[tuple[StepPlan, StepResult]] = []
    run_local = executor.execute

    def recording(plan: StepPlan) -> StepResult:
        steps.append((plan, run_local(plan)))
        return steps[-1][1]

    executor.execute = recording  # type: ignore[method-assign]
    llm.generate(PROMPTS, [GREEDY, SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True),
                           SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, seed=9, ignore_eos=True)])
    config = dict(device="cpu", dtype="float32", seed=3, **ENGINE_KW)
    threads = torch.get_num_threads()  # a CPU worker pins its process to cpu_threads
    interval = sys.getswitchinterval()  # and sets the process's thread switch interval
    try:
        draft = ModelWorker("draft", near_llama, config, rejection_sampling="probabilistic", cpu_threads=threads)
        target = ModelWorker("target", tiny_models["llama"].path, config, cpu_threads=threads)
    finally:
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)
        gc.unfreeze()  # a worker freezes its process's heap once started: not the test process's
    assert target.info().num_blocks == executor.target_num_blocks
    assert draft.info().kv_groups == executor.draft_kv_groups
    for plan, expected in steps:
        result = target.target_step(target.target_prepare(plan), draft.draft_step(plan))
        assert (result.sampled, result.num_accepted) == (expected.sampled, expected.num_accepted)
    assert any(any(r.num_accepted) for _, r in steps)  # accepted drafts were replayed too
