"""What a target worker pays between a remote draft's ids landing and the step's tokens: the ordinary path (copy the
ids in, then launch the verify graph on an idle GPU) against the forward launched ahead behind the ids gate
(engine/kernels/speculation/ids_gate.py), in one process on one GPU.

    python benchmarks/verify_launch.py                      # Qwen3-8B-shaped target, Qwen3-0.6B-shaped draft, k=4
    python benchmarks/verify_launch.py --batch 1 16 --wait-ms 2 --tokens 96

The in-process engine runs with synthetic acceptance, and each verify is run the way a target worker runs it:
the draft's ids are taken to the host (the draft's worker sends them so), the input is built, then the host
waits --wait-ms with the GPU idle (the draft's worker still proposing), and only then hands the verifier the ids.
Timed per decode step, host clock: from the ids' hand-over to the step's tokens on the host (the part of a
served step that the target's worker adds after the proposal's hop). Modes alternate request by request after
a warm-up, and medians are printed per batch size; JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment  # noqa: E402
from gpu_shapes import shape_dir  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.speculation.verifier import Verifier  # noqa: E402

MODES = ("ordinary", "launched")


def timed_verify(mode: dict[str, str], wait_s: float, samples: dict[str, list[float]],
                 verify_ms: dict[str, list[float]]):
    """A Verifier.verify that runs like a target worker's step and records ids-to-tokens per mode."""

    def verify(self: Verifier, plan, proposal):
        if proposal is None:
            return self.run(self.prepare(plan, False), None)
        counts = [r.num_draft_tokens for r in plan.requests]
        remote = proposal.to_host(counts)  # SYNC: the draft's worker sends host ids; its GPU work ends here
        inp = self.prepare(plan, True, gated_launch=mode["now"] == "launched")
        deadline = time.perf_counter() + wait_s
        while time.perf_counter() < deadline:  # the proposal is on its way; busy, as a channel read is
            pass
        t0 = time.perf_counter()
        result = self.run(inp, remote, prepared_during_draft=True)
        if inp.forward.graph_key is not None:  # decode steps (a mixed step with a prefill runs eagerly)
            samples[mode["now"]].append(time.perf_counter() - t0)
            verify_ms[mode["now"]].append(result.phase_seconds["verify"] * 1e3)
        return result

    return verify


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen3-8b")
    ap.add_argument("--draft", default="qwen3-0.6b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--wait-ms", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per request")
    ap.add_argument("--rounds", type=int, default=6, help="measured rounds per batch size (modes alternate)")
    ap.add_argument("--out")
    args = ap.parse_args()
    mode = {"now": "ordinary"}
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    verify_ms: dict[str, list[float]] = {m: [] for m in MODES}
    Verifier.verify = timed_verify(mode, args.wait_ms / 1e3, samples, verify_ms)  # type: ignore[method-assign]
    llm = LLM(shape_dir(args.target), draft_model=shape_dir(args.draft), num_speculative_tokens=args.k,
              rejection_sampling="synthetic", synthetic_acceptance_rate=0.8, load_format="dummy", device="cuda",
              max_model_len=1024, max_num_seqs=max(args.batch), kv_cache_memory_bytes=8 << 30,
              cuda_graph_batch_sizes=tuple(sorted(set(args.batch))))
    verifier = llm.executor.verifier
    if not verifier.enable_gated_launch():
        raise SystemExit("launching ahead needs CUDA graphs and Triton")
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    rows = []
    for b in args.batch:
        prompts = [torch.randint(0, 150_000, (128,)).tolist() for _ in range(b)]
        for m in MODES:  # warm-up: graphs, Triton specializations, the allocator
            mode["now"] = m
            llm.generate(prompts, params)
        for s in (*samples.values(), *verify_ms.values()):
            s.clear()
        for r in range(args.rounds):
            for m in (MODES if r % 2 == 0 else MODES[::-1]):
                mode["now"] = m
                llm.generate(prompts, params)
        row = {"batch": b, "steps": {m: len(samples[m]) for m in MODES},
               **{f"{m}_ms": statistics.median(samples[m]) * 1e3 for m in MODES},
               **{f"{m}_verify_ms": statistics.median(verify_ms[m]) for m in MODES}}
        row["saved_ms"] = row["ordinary_ms"] - row["launched_ms"]
        rows.append(row)
    env = environment()
    print(f"{env['device']}, torch {env['torch']}, {env['date']}; target {args.target}, draft {args.draft}, "
          f"k={args.k}, wait {args.wait_ms} ms")
    print("| batch | ids to tokens, ordinary (ms) | launched ahead (ms) | saved (ms) | verify GPU ms (ord. / ahead) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['ordinary_ms']:.3f} | {r['launched_ms']:.3f} | {r['saved_ms']:.3f} | "
              f"{r['ordinary_verify_ms']:.2f} / {r['launched_verify_ms']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"env": env, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
