"""Where a graph-replayed decode step spends its GPU time: torch.profiler over replays of one shape's decode
graph (random weights), kernels sorted by total CUDA time. With --draft, a whole speculative engine step instead
(synthetic acceptance, greedy; --k 0: the target alone): the median of each phase over the decode steps, then under
the profiler the kernels, the host's own time per operation, and how much of the wall time the GPU was busy.

    python benchmarks/profile_step.py --shape qwen3-0.6b --batch 1
    python benchmarks/profile_step.py --shape qwen3-8b --draft qwen3-0.6b --k 4
    python benchmarks/profile_step.py --shape qwen3-8b --draft eagle3 --k 4   # an EAGLE-3 head of the shape
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gpu_decode import cuda_median_ms
from gpu_shapes import eagle3_head_dir, shape_dir
from torch.profiler import ProfilerActivity, profile

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.runner.step_input import Chunk


def profile_spec(args: argparse.Namespace) -> None:
    """Median phases of a speculative engine's decode steps (no profiler), then one generate() under the profiler."""
    max_len = args.context + args.steps * (args.k + 1) + 64
    drafter = (dict(speculative_config={"method": "eagle3", "model": eagle3_head_dir(args.shape),
                                        "num_speculative_tokens": args.k}) if args.draft == "eagle3"
               else dict(draft_model=shape_dir(args.draft), num_speculative_tokens=args.k))
    spec = dict(**drafter, rejection_sampling="synthetic", synthetic_acceptance_rate=args.rate) if args.k else {}
    llm = LLM(shape_dir(args.shape), **spec, load_format="dummy", device="cuda", max_model_len=max_len,
              max_num_seqs=args.batch, kv_cache_memory_bytes=4 << 30, cuda_graph_batch_sizes=(args.batch,),
              enforce_eager=args.eager)
    prompts = [torch.randint(0, 150000, (args.context,)).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.steps * (args.k + 1), ignore_eos=True)
    llm.generate(prompts, params)  # warm-up
    # Phase means per engine step (no profiler: its overhead would swamp the host's share).
    engine, per_step, walls = llm.engine, [], []
    step = engine.step

    def timed_step():
        t = time.perf_counter()
        out = step()
        walls.append(time.perf_counter() - t)
        per_step.append(dict(engine.last_step.phase_seconds))
        return out

    engine.step = timed_step
    llm.generate(prompts, params)
    engine.step = step
    # Medians over the decode steps (the first step is the prefill).
    walls, per_step = walls[1:], per_step[1:]
    phases = {name: statistics.median(p.get(name, 0.0) for p in per_step) * 1e3 for name in per_step[0]}
    wall = statistics.median(walls) * 1e3
    print(f"{len(walls)} decode steps, median wall {wall:.2f} ms per step; median phases (ms): "
          + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steps = (llm.spec_stats(outs).num_drafts if args.k else sum(len(o.token_ids) for o in outs)) / args.batch
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
    print(f"wall {wall * 1e3:.1f} ms (profiled), GPU kernel time {gpu_us / 1e3:.1f} ms "
          f"({gpu_us / 1e6 / wall:.0%} busy); {steps:.0f} steps, {wall * 1e3 / steps:.2f} ms per step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--draft", help="profile a speculative engine step with this draft shape ('eagle3': an EAGLE-3 "
                    "head of the target's shape)")
    ap.add_argument("--k", type=int, default=4, help="with --draft; 0: the target alone")
    ap.add_argument("--rate", type=float, default=0.8)
    ap.add_argument("--small-m-rows", type=int, default=EngineConfig.small_m_rows,
                    help="EngineConfig.small_m_rows of the decode forward (5-64: the wide path at batch 5-64)")
    args = ap.parse_args()
    if args.draft:
        profile_spec(args)
        return
    max_len = args.context + 64
    llm = LLM(shape_dir(args.shape), load_format="dummy", device="cuda", max_model_len=max_len,
              max_num_seqs=args.batch, kv_cache_memory_bytes=4 << 30, cuda_graph_batch_sizes=(args.batch,),
              enforce_eager=args.eager, small_m_rows=args.small_m_rows)
    runner = llm.executor.target
    per_req = -(-max_len // llm.engine_config.block_size)
    tables = [[list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for _ in runner.kv_groups]
              for i in range(args.batch)]
    for i in range(args.batch):
        runner.forward_chunks([Chunk(list(range(args.context)), 0, 0, tables[i])])
    chunks = [Chunk([7], args.context, 1, tables[i]) for i in range(args.batch)]
    for _ in range(5):
        runner.forward_chunks(chunks)
    torch.cuda.synchronize()
    # Input build and replay, without the profiler (which roughly doubles each kernel's time).
    print(f"forward, no profiler: {cuda_median_ms(lambda: runner.forward_chunks(chunks), 50):.3f} ms (median)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            runner.forward_chunks(chunks)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
