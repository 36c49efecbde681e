"""Where a graph-replayed decode step spends its GPU time: torch.profiler over replays of one shape's decode
graph (random weights), kernels sorted by total CUDA time.

    python benchmarks/profile_step.py --shape qwen3-0.6b --batch 1
"""

from __future__ import annotations

import argparse

import torch
from gpu_shapes import shape_dir
from torch.profiler import ProfilerActivity, profile

from engine import LLM
from engine.runner.step_input import Chunk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    max_len = args.context + 64
    llm = LLM(shape_dir(args.shape), load_format="dummy", device="cuda", max_model_len=max_len,
              max_num_seqs=args.batch, kv_cache_memory_bytes=4 << 30, cuda_graph_batch_sizes=(args.batch,),
              enforce_eager=args.eager)
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
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            runner.forward_chunks(chunks)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
