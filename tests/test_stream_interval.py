"""The router's stream coalescing (`stream_interval_ms`): after a stream's first delta, the tokens of the steps
within the interval come as one delta; the first and the last are never held back, and the tokens are the
engine's own. A Router in this process over the local engine (tests/test_admission_queue.py's)."""

from __future__ import annotations

import asyncio
import time

from engine.llm import LLM
from engine.request import SamplingParams
from tests.test_admission_queue import ENGINE_KW, GREEDY, NEW_TOKENS, PROMPTS, _router

# The coalesced request's length: far more steps than a consumer on a loaded CPU falls behind by (3 seen).
LONG = dict(GREEDY, max_tokens=40)


async def _deltas(router, rid: str, prompt: list[int], params: dict = GREEDY) -> list[list[int]]:  # noqa: ANN001
    out = []
    async for delta in router.generate(rid, prompt, params):
        assert "error" not in delta, delta
        out.append(delta["token_ids"])
    return out


def test_coalesced_stream_holds_back_neither_first_nor_last(tiny_models) -> None:
    path = tiny_models["llama"].path
    llm = LLM(path, **ENGINE_KW)
    ref = llm.generate(PROMPTS[:1], SamplingParams(**GREEDY))
    ref_long = llm.generate(PROMPTS[1:2], SamplingParams(**LONG))

    async def scenario() -> None:
        every_step = _router(path)
        deltas = await _deltas(every_step, "a", PROMPTS[0])
        assert [t for d in deltas for t in d] == ref[0].token_ids
        # No draft: one token a step, one delta a step, unless this consumer fell behind the steps (a loaded CPU)
        # and took several steps' tokens at once; never held back to the end as the coalesced stream below is.
        assert 2 < len(deltas) <= NEW_TOKENS

        coalesced = _router(path, stream_interval_ms=60_000)
        t0 = time.perf_counter()
        deltas = await _deltas(coalesced, "b", PROMPTS[1], LONG)
        # The first token at once, the rest in the final delta as soon as the request finished: not a minute later.
        assert time.perf_counter() - t0 < 30
        # Two deltas: the first as soon as it is published (a consumer that fell behind on a loaded CPU may find a
        # few more steps' tokens with it: 3 of 12 seen), the rest held back until the request finished.
        assert len(deltas) == 2 and len(deltas[0]) <= LONG["max_tokens"] // 4, [len(d) for d in deltas]
        assert [t for d in deltas for t in d] == ref_long[0].token_ids

        # A consumer that leaves while its stream is held back aborts the request. Its first delta comes before the
        # request finishes (a consumer that fell behind on a loaded CPU may find several steps' tokens with it; 5 seen),
        # not held back with the rest: fewer than all 55 tokens, far more steps than a consumer's lag.
        stream = coalesced.generate("c", PROMPTS[0], dict(GREEDY, max_tokens=55))
        first = (await anext(stream))["token_ids"]
        assert 1 <= len(first) < 55, len(first)
        await stream.aclose()
        for _ in range(200):
            if not coalesced.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert not coalesced.engine.has_unfinished() and not coalesced._streams

    asyncio.run(scenario())
