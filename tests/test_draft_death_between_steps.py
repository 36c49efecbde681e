"""A draft rank found dead between two steps while a step is still in flight (asynchronous scheduling), as a health
probe finds it: with `continue_without_draft` the router's recovery (serving/router/recovery.py) lets the step in
flight land, or drops it, before it rebuilds the step without the draft, and the requests go on to the target's
own greedy output. Collected after the rebuild, the step would fail with the old graph's error, which names no
group of the new step, and the whole engine would be rebuilt for it (every request in flight failed)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from conftest import TinyModel, local_ray, random_prompts, start_requests

from engine import LLM, SamplingParams
from serving.engine_builders import DEFAULT_ENGINE_BUILDER
from serving.engine_factory import build_ray_engine
from serving.router.recovery import EngineRecovery
from serving.workers.health import WorkerDiedError

PROMPTS = random_prompts([3, 9, 17], seed=5)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
ENGINE_KW = dict(block_size=4, max_model_len=64, max_num_batched_tokens=20, adaptive_draft_length=False)


@pytest.fixture(scope="module", autouse=True)
def ray_runtime() -> Iterator[None]:
    with local_ray(num_cpus=4):
        yield


class Host:
    """The router's side that recovery uses, around a bare engine: what it publishes is kept."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.published: list[Any] = []

    def _between_steps(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()  # type: ignore[return-value]

    def _publish_now(self, touched: list[Any]) -> None:
        self.published += touched

    def _update_queue_and_kv(self) -> None:
        pass

    def _use_engine(self, engine: Any) -> None:
        self.engine = engine


def _found_dead(engine: Any, timeout_s: float = 30.0) -> WorkerDiedError:
    """The health check's error once it names a dead worker (ray.kill takes a moment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            engine.check_health(10.0)
        except WorkerDiedError as e:
            return e
        assert time.monotonic() < deadline, f"the killed worker still answered after {timeout_s} s"
        time.sleep(0.1)


def test_draft_found_dead_with_a_step_in_flight_serves_on_without_it(tiny_models: dict[str, TinyModel],
                                                                     near_llama: str) -> None:
    target = tiny_models["llama"].path
    expected = [o.token_ids for o in LLM(target, **ENGINE_KW).generate(PROMPTS, GREEDY)]
    engine = build_ray_engine(target, near_llama, num_speculative_tokens=3, async_scheduling=True, **ENGINE_KW)
    host = Host(engine)
    try:
        reqs = start_requests(engine, PROMPTS, GREEDY, steps=4)
        assert engine.async_scheduling and engine.in_flight, "no step in flight"
        ray.kill(engine.executor.draft.workers[0], no_restart=True)
        died = _found_dead(engine)  # what a health probe between two steps finds
        assert died.role == "draft"

        async def serve_without_draft() -> None:
            recovery = EngineRecovery(host, DEFAULT_ENGINE_BUILDER, {}, continue_without_draft=True)
            assert recovery.serve_without_draft(died)
            assert recovery.degraded and recovery.unhealthy is None
            recovery.task.cancel()  # the new draft group it would start is not this test's
            with contextlib.suppress(asyncio.CancelledError):
                await recovery.task

        asyncio.run(serve_without_draft())
        assert engine.spec_config is None
        while engine.has_unfinished():
            engine.step()  # target-only steps: the step that was in flight raised nothing here
        # Speculation is lossless: stopping it mid-request changes no greedy token.
        assert [r.output_token_ids for r in reqs] == expected
    finally:
        engine.executor.shutdown()
