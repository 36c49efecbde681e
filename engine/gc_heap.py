"""The startup heap of an engine or serving process, frozen out of Python's garbage collections.

A process that has loaded torch, transformers, Ray and a model holds hundreds of thousands of tracked objects that
live as long as it does. Python's full (generation 2) collection walks all of them, and it runs whenever the
objects that survived earlier collections have grown by a quarter: request objects, streams and plans do that
under load. In an engine process with the SmolLM2 pair on CPU (310k tracked objects) one full collection took
147-250 ms (benchmarks/gc_pause.py); a pause like that in the router or a worker stalls every request in flight
(the tail of TTFT and ITL). `gc.freeze()` moves everything alive into a permanent generation that collections
skip, so later ones walk only what serving allocated since (vLLM freezes its engine and API processes after
start-up the same way).
Collected first: freezing takes garbage as it finds it, and startup garbage would then never be reclaimed. The
offline engine (engine/llm.py) freezes too, once built: on an H200, a gemma-3-1b + 270m pair's timed run at batch 64
had one full collection of 224 ms, a step 100 times its median. A process that builds several engines (a script, the
test suite) thaws what earlier ones froze and collects it before freezing again, so a dropped engine's reference
cycles are reclaimed then instead of held for good.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap(process: str) -> int:
    """Thaw what an earlier call froze, collect, then freeze every object alive in this process; call once its
    start-up is done (models loaded, graphs captured, tokenizers built), before it serves. Returns the objects frozen
    in the process."""
    t0 = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d objects frozen out of garbage collection (%.0f ms)", process, frozen,
                (time.perf_counter() - t0) * 1e3)
    return frozen
