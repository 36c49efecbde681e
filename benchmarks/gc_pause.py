"""How long one full garbage collection takes in a process that holds an engine, before and after its startup heap
is frozen (engine/gc_heap.py, which every serving process calls once started).

Python runs a full collection whenever the objects that survived earlier ones have grown by a quarter; in a serving
process that pause stalls every request in flight. This builds the in-process engine (engine.LLM) as a worker or
router process would hold it, runs one request, then times full collections.

    python benchmarks/gc_pause.py                        # SmolLM2-135M-Instruct with the bundled draft, CPU
    python benchmarks/gc_pause.py --no-draft --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams  # noqa: E402
from engine.gc_heap import freeze_startup_heap  # noqa: E402


def full_collections_ms(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--no-draft", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(model=args.model, draft_model=None if args.no_draft else args.draft, device=args.device)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4))
    tracked = len(gc.get_objects())
    before = full_collections_ms(args.repeats)
    frozen = freeze_startup_heap("benchmark")
    after = full_collections_ms(args.repeats)
    print(f"{args.model}{'' if args.no_draft else ' + ' + args.draft}, {llm.engine_config.device}: "
          f"{tracked} tracked objects, {frozen} frozen")
    print(f"full collection, ms (median of {args.repeats}): before the freeze {statistics.median(before):.1f} "
          f"({', '.join(f'{t:.1f}' for t in before)}), after {statistics.median(after):.2f} "
          f"({', '.join(f'{t:.2f}' for t in after)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
