"""An EAGLE-3 head's graphed draft steps against the bytes they read (random weights at a target's shape, batch 1):
the replay time of the loop's later step and of its first step (the catch-up of k + 1 target states through fc),
the k-step loop against its floor (the weights each step reads over the copy bandwidth measured in the same run),
then the later step's kernels under torch.profiler.

    python benchmarks/gpu_eagle3_loop.py --target qwen3-8b
"""

from __future__ import annotations

import argparse

import torch
from common import replay_us
from gpu_shapes import copy_bandwidth, eagle3_head_dir, shape_dir
from torch.profiler import ProfilerActivity, profile

from engine import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen3-8b")
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    bw = copy_bandwidth()
    llm = LLM(shape_dir(args.target), speculative_config={"method": "eagle3", "model": eagle3_head_dir(args.target),
              "num_speculative_tokens": args.k}, rejection_sampling="synthetic", synthetic_acceptance_rate=0.8,
              load_format="dummy", device="cuda", max_model_len=1024, max_num_seqs=1,
              kv_cache_memory_bytes=4 << 30, cuda_graph_batch_sizes=(1,), adaptive_draft_length=False)
    # A real run first: the loop's buffers then hold a request's inputs and its KV what the replays read.
    llm.generate([torch.randint(0, 100000, (256,)).tolist()], SamplingParams(max_tokens=64, ignore_eos=True))
    proposer = llm.executor.proposer
    loop, head = proposer.loop, proposer.head

    def nbytes(m: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in m.parameters())

    step_bytes = nbytes(head.layer) + nbytes(head.lm_head) + nbytes(head.norm)
    first_bytes = step_bytes + nbytes(head.fc)
    print(f"{args.target}: {loop.num_first_graph_steps} whole proposals replayed in the run; "
          f"copy {bw / 1e12:.2f} TB/s")
    later, first = loop.next_graphs[(1, True)], loop.first_graphs[(1, True)]
    loop.step_idx.fill_(1)
    t_later = replay_us(later, 200, warmup=10)
    loop.step_idx.zero_()
    t_first = replay_us(first, 200, warmup=10)
    loop_us, floor_us = t_first + (args.k - 1) * t_later, (first_bytes + (args.k - 1) * step_bytes) / bw * 1e6
    print(f"later step {t_later:.1f} us against {step_bytes / bw * 1e6:.1f} us of {step_bytes / 1e6:.1f} MB "
          f"({t_later / (step_bytes / bw * 1e6):.2f}x); first step {t_first:.1f} us against "
          f"{first_bytes / bw * 1e6:.1f} us ({t_first / (first_bytes / bw * 1e6):.2f}x); the k = {args.k} loop "
          f"{loop_us:.0f} us against {floor_us:.0f} us ({loop_us / floor_us:.2f}x)")
    loop.step_idx.fill_(1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            later.replay()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
