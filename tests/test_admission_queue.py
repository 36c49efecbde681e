"""The router's admission queue (serving/router/admission_queue.py): arrivals while the engine steps never stop the step
thread; every arrival of a step is admitted before the next one; queued requests can be aborted and refused, and
count against the waiting bound. A Router in this process over the local engine (no Ray actors: what is tested is
the router's own event loop and step thread)."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from engine.llm import LLM
from engine.request import SamplingParams
from serving.router.admission_queue import AdmissionQueue
from serving.router.request_stream import Rejected
from serving.router.router import Router
from tests.conftest import random_prompts

PROMPTS = random_prompts([5, 7, 9, 11, 6, 8, 10], seed=11)
NEW_TOKENS = 12
GREEDY = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
ENGINE_KW = dict(block_size=4, max_model_len=64, device="cpu", dtype="float32")
LOCAL = "serving.engine_builders:build_local_engine"


def _router(path: str, **kw) -> Router:
    router = Router(dict(model=path, **ENGINE_KW), engine_builder=LOCAL, **kw)
    gc.unfreeze()  # a router freezes its process's heap once started: not the test process's
    return router


async def _collect(router: Router, rid: str, prompt: list[int], params: dict) -> tuple[list[int], dict | None]:
    tokens: list[int] = []
    async for delta in router.generate(rid, prompt, params):
        if "error" in delta:
            return tokens, delta
        tokens += delta["token_ids"]
    return tokens, None


def test_queue_order_remove_and_take_all() -> None:
    class R:
        def __init__(self, rid: str) -> None:
            self.request_id = rid

    q = AdmissionQueue()
    for rid in "abc":
        q.put(R(rid), rid.upper())
    assert len(q) == 3 and q.holds("b")
    assert q.remove("b")[1] == "B" and not q.holds("b") and q.remove("b") is None
    assert [s for _, s in q.take_all()] == ["A", "C"]
    assert len(q) == 0 and not q.holds("a")


def test_arrivals_during_steps_never_stop_the_step_thread(tiny_models) -> None:
    """Requests that arrive while steps run are admitted by the running step thread, all of one step's arrivals
    at the next boundary, and come out exactly as the engine alone gives them."""
    path = tiny_models["llama"].path
    ref = [o.token_ids for o in LLM(path, **ENGINE_KW).generate(PROMPTS, SamplingParams(**GREEDY))]

    async def scenario() -> None:
        router = _router(path)
        runs = 0
        admitted_at: dict[str, int] = {}
        steps = 0
        run_steps, step, add = router._run_steps, router.engine.step, router.engine.add_request

        def counting_run_steps(loop):  # noqa: ANN001, ANN202
            nonlocal runs
            runs += 1
            return run_steps(loop)

        def slow_step(*a, **kw):  # noqa: ANN002, ANN003, ANN202 - a step long enough for a wave to land inside it
            nonlocal steps
            steps += 1
            time.sleep(0.03)
            return step(*a, **kw)

        def recording_add(req):  # noqa: ANN001, ANN202
            admitted_at[req.request_id] = steps
            return add(req)

        router._run_steps, router.engine.step, router.engine.add_request = counting_run_steps, slow_step, recording_add
        first = asyncio.ensure_future(_collect(router, "r0", PROMPTS[0], GREEDY))
        while steps < 2:  # the step thread is running
            await asyncio.sleep(0.005)
        wave = []
        for i in range(1, len(PROMPTS)):  # a wave spread over ~12 ms, inside one 30 ms step
            wave.append(asyncio.ensure_future(_collect(router, f"r{i}", PROMPTS[i], GREEDY)))
            await asyncio.sleep(0.002)
        outs = await asyncio.gather(first, *wave)
        assert [err for _, err in outs] == [None] * len(PROMPTS)
        assert [toks for toks, _ in outs] == ref
        assert runs == 1, f"the step thread was restarted {runs - 1} time(s) for arrivals"
        wave_steps = {admitted_at[f"r{i}"] for i in range(1, len(PROMPTS))}
        assert len(wave_steps) == 1, f"one wave admitted over several steps: {sorted(admitted_at.items())}"

    asyncio.run(scenario())


def test_queued_requests_abort_refuse_and_count_as_waiting(tiny_models) -> None:
    path = tiny_models["llama"].path

    async def scenario() -> None:
        router = _router(path, max_queued_requests=2)
        router._loop_task = asyncio.get_running_loop().create_future()  # hold the step loop: arrivals stay queued
        s0 = await router._add("a", PROMPTS[0], GREEDY)
        await router._add("b", PROMPTS[1], GREEDY)
        assert (await router.health())["num_waiting"] == 2
        with pytest.raises(Rejected, match="max_queued_requests=2") as overload:
            await router._add("c", PROMPTS[2], GREEDY)
        assert overload.value.status == 429
        with pytest.raises(ValueError, match="already in use"):
            await router._add("a", PROMPTS[2], GREEDY)
        with pytest.raises(ValueError, match="outside the vocabulary"):  # validated on arrival, not on admission
            await router._add("d", [10**9], GREEDY)
        assert await router.abort("a") and s0.finish_reason == "abort" and s0.event.is_set()
        assert not router.engine.has_request("a") and len(router._admission) == 1
        router._streams.pop("a")
        router._loop_task = None
        tokens, err = await _collect(router, "e", PROMPTS[3], GREEDY)  # the loop starts and admits b and e
        assert err is None and len(tokens) == NEW_TOKENS
        while router.engine.has_unfinished():
            await asyncio.sleep(0.01)
        assert len(router._admission) == 0 and (await router.health())["num_waiting"] == 0

    asyncio.run(scenario())


def test_a_request_the_engine_fails_to_admit_is_answered_and_the_rest_run(tiny_models) -> None:
    """An admission that raises (not a validation error: the engine's fault) answers that request with a 500 and
    admits the others of its batch; nothing is left waiting for a stream that never ends."""
    path = tiny_models["llama"].path

    async def scenario() -> None:
        router = _router(path)
        add = router.engine.add_request

        def failing_add(req):  # noqa: ANN001, ANN202
            if req.request_id == "x":
                raise RuntimeError("boom in add_request")
            return add(req)

        router.engine.add_request = failing_add
        router._loop_task = asyncio.get_running_loop().create_future()  # both queued before the loop admits them
        bad = asyncio.ensure_future(_collect(router, "x", PROMPTS[0], GREEDY))
        good = asyncio.ensure_future(_collect(router, "y", PROMPTS[1], GREEDY))
        await asyncio.sleep(0.05)
        assert len(router._admission) == 2
        router._loop_task = None
        router._loop_task = asyncio.get_running_loop().create_task(router._run_loop())
        (_, err), (tokens, err_y) = await asyncio.wait_for(asyncio.gather(bad, good), 60)
        assert err is not None and err["status"] == 500 and "boom in add_request" in err["error"]
        assert err_y is None and len(tokens) == NEW_TOKENS

    asyncio.run(scenario())


def test_a_failed_step_spares_the_requests_still_queued(tiny_models) -> None:
    """A step error pinned on the requests it ended fails those alone: an arrival still queued for admission never
    ran, so it stays queued and runs to the end once the loop goes on."""
    path = tiny_models["llama"].path

    async def scenario() -> None:
        router = _router(path)
        loop = asyncio.get_running_loop()
        router._loop_task = loop.create_future()  # hold the step loop
        s_a = await router._add("a", PROMPTS[0], GREEDY)
        router._admit(loop)
        router.engine.abort_request("a")  # the failed step ended it: the engine's culprit
        s_b = await router._add("b", PROMPTS[1], GREEDY)
        router._on_step_error(RuntimeError("a stop string check failed"))
        assert s_a.error is not None and s_a.error[1] == 500
        assert s_b.error is None and s_b.finish_reason is None and router._admission.holds("b")
        router._loop_task = loop.create_task(router._run_loop())
        await asyncio.wait_for(router._loop_task, 60)
        assert s_b.request.output_token_ids and len(s_b.request.output_token_ids) == NEW_TOKENS

    asyncio.run(scenario())
