"""What an EAGLE-3 head on workers of its own costs against one inside the target's (Ray engine, draft_placement
separate against colocated): the same pair, random weights at a shape, synthetic acceptance, `batch` requests at
once; tok/s over the decode, and the bytes of target states each step sends with its result (every token of the
verify: batch x (k + 1) rows of len(aux) x hidden).

    python benchmarks/serve_head_apart.py --target smollm2-135m --device cpu --batch 1,8
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch
from gpu_shapes import eagle3_head_dir, hf_config, shape_dir

from engine.request import Request, SamplingParams
from serving.engine_factory import build_ray_engine


def tokens_per_s(engine: object, batch: int, context: int, new_tokens: int, repeats: int) -> float:
    """Median tok/s of `repeats` runs of `batch` requests (after one warm-up run), wall time over output tokens."""
    runs = []
    for rep in range(repeats + 1):
        reqs = [Request(f"r{rep}-{i}", torch.randint(3, 30000, (context,)).tolist(),
                        SamplingParams(max_tokens=new_tokens, ignore_eos=True)) for i in range(batch)]
        t0 = time.perf_counter()
        for r in reqs:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()
        if rep:
            runs.append(sum(len(r.output_token_ids) for r in reqs) / (time.perf_counter() - t0))
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True)
    cfg = hf_config(args.target)
    itemsize = 4 if args.device == "cpu" else 2
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    for placement in ("colocated", "separate"):
        engine = build_ray_engine(shape_dir(args.target), eagle3_head_dir(args.target), speculative_method="eagle3",
                                  num_speculative_tokens=args.k, draft_placement=placement, load_format="dummy",
                                  device=args.device, rejection_sampling="synthetic", synthetic_acceptance_rate=0.8,
                                  adaptive_draft_length=False, max_model_len=args.context + args.new_tokens + 16,
                                  max_num_seqs=max(batches), seed=0)
        try:
            for b in batches:
                tps = tokens_per_s(engine, b, args.context, args.new_tokens, args.repeats)
                state_bytes = b * (args.k + 1) * 3 * cfg.hidden_size * itemsize
                rows.append((placement, b, tps, state_bytes))
                print(f"{placement}, batch {b}: {tps:.1f} tok/s; target states {state_bytes / 1e3:.1f} kB a step",
                      flush=True)
        finally:
            engine.executor.shutdown()
    print("| placement | batch | tok/s | vs colocated | states a step |\n|---|---|---|---|---|")
    base = {b: t for p, b, t, _ in rows if p == "colocated"}
    for p, b, t, n in rows:
        print(f"| {p} | {b} | {t:.1f} | {t / base[b]:.2f}x | {n / 1e3:.1f} kB |")


if __name__ == "__main__":
    main()
