"""A request's first steps in process: when its first token comes, and what each step spent, phase by phase.

One request at a time on an idle engine (engine.LLM, no Ray, no HTTP), so a step's phases are that request's:
the first step prefills the target (and the draft, in the `propose` phase), the next ones speculate. The first
trial of a fresh process also shows what compiles lazily on the first request (a stall in some phase that later
trials do not have). Layouts and pairs are those of benchmarks/serve_layouts.py (offline ones only).

    python3 benchmarks/first_steps.py --pair qwen3-8b-0.6b --layouts offline offline+d --trials 3
    python3 benchmarks/first_steps.py --layouts offline+d --profile     # cProfile of the first two steps
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from engine_driver import offline_llm  # noqa: E402
from layouts import Layout, serve_config  # noqa: E402
from sweep_models import materialize, model_pairs  # noqa: E402

from engine.request import Request, SamplingParams  # noqa: E402


def first_steps(engine: Any, prompt: list[int], tag: str, shown: int, profile: bool) -> list[tuple[float, int, dict]]:
    """Run one request to its end; returns (ms since it was added, output tokens so far, phase ms) for each of
    its first `shown` steps, cProfile'd (printed) for the first two when `profile`."""
    req = Request(tag, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.add_request(req)
    t0 = time.perf_counter()
    rows: list[tuple[float, int, dict]] = []
    while not req.status.finished:
        prof = cProfile.Profile() if profile and len(rows) < 2 else None
        if prof is not None:
            prof.enable()
        engine.step()
        if prof is not None:
            prof.disable()
            print(f"--- {tag}, step {len(rows)}", flush=True)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(28)
        phases = {k: round(v * 1000, 2) for k, v in engine.last_step.phase_seconds.items()}
        rows.append((round((time.perf_counter() - t0) * 1000, 2), req.num_output_tokens, phases))
    while engine.has_unfinished():  # a step queued ahead may still hold it
        engine.step()
    return rows[:shown]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen3-8b-0.6b", choices=["smollm2", "qwen3-8b-0.6b"])
    ap.add_argument("--layouts", nargs="+", default=["offline", "offline+d"])
    ap.add_argument("--trials", type=int, default=3, help="requests, one after another, on the same engine")
    ap.add_argument("--steps", type=int, default=2, help="steps shown per request")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--acceptance", type=float, default=0.8, help="synthetic acceptance rate (qwen3 shapes)")
    ap.add_argument("--profile", action="store_true", help="cProfile the first two steps of the first and last trial")
    args = ap.parse_args()
    layouts = [Layout.parse(x) for x in args.layouts]
    served = [lay.name for lay in layouts if not lay.offline]
    if served:
        ap.error(f"only in-process layouts (offline, offline+d): got {served}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.gettempdir()) / "specserve-sweep"
    work.mkdir(parents=True, exist_ok=True)
    pair = model_pairs(work, False, dev, args.acceptance)[args.pair]
    materialize(args.pair, pair, work, False, dev)
    # The fields serve_config reads, as serve_layouts.py's defaults give them.
    ns = argparse.Namespace(concurrency=[1], max_num_seqs=None, smoke=False, device=dev, eager=False,
                            bonus_agreement=None, seed=0, max_model_len=1024, dtype=None, k=4)
    for lay in layouts:
        with offline_llm(serve_config(pair, lay, ns)) as llm:
            print(f"[{lay.name}] {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, "
                  f"async scheduling {llm.engine.async_scheduling}", flush=True)
            for trial in range(args.trials):
                prompt = [100 + (i * 7 + trial) % 5000 for i in range(args.input_len)]
                profile = args.profile and trial in (0, args.trials - 1)
                for ms, tokens, phases in first_steps(llm.engine, prompt, f"t{trial}", args.steps, profile):
                    print(f"  trial {trial}: {ms:8.2f} ms, {tokens:2d} tokens, phases {phases}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
