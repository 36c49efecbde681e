"""Decode step time of a Qwen3-8B-shaped target (random weights, bf16) at batch 1, 8, 32 on one GPU: the
engine's CUDA-graph step and its eager step, against the memory-bandwidth floor (weight bytes over the copy
bandwidth measured in the same run) and HF transformers eager decoding in the same run.

    python benchmarks/gpu_decode.py --out results/gpu_decode.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import environment, markdown_table, save_json
from gpu_shapes import copy_bandwidth, hf_config, shape_dir, weight_bytes

from engine import LLM, SamplingParams
from engine.kernels.triton_compat import set_pdl
from engine.runner.step_input import Chunk


def cuda_median_ms(fn, steps: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def hf_decode_ms(name: str, batch: int, context: int, steps: int) -> float:
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
    times = []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for i in range(steps + 5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(tok, past_key_values=past, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            if i >= 5:
                times.append(time.perf_counter() - t0)
            past = out.past_key_values
    del model, past, out
    torch.cuda.empty_cache()
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--small-m-rows", type=int, default=None,
                    help="EngineConfig.small_m_rows (0: cuBLAS products and separate norm/activation kernels)")
    ap.add_argument("--no-pdl", action="store_true", help="launch every kernel the ordinary way (no programmatic "
                    "dependent launch), as before it existed")
    ap.add_argument("--out")
    args = ap.parse_args()
    set_pdl(not args.no_pdl)
    batches = [int(b) for b in args.batch.split(",")]
    bw = copy_bandwidth()
    rows = []
    hf = {} if args.skip_hf else {b: hf_decode_ms(args.shape, b, args.context, args.steps) for b in batches}
    max_len = args.context + args.steps + 64
    llm = LLM(shape_dir(args.shape), load_format="dummy", device="cuda", max_model_len=max_len,
              max_num_seqs=max(batches), kv_cache_memory_bytes=8 << 30, cuda_graph_batch_sizes=tuple(batches),
              **({} if args.small_m_rows is None else {"small_m_rows": args.small_m_rows}))
    runner = llm.executor.target
    floor_ms = weight_bytes(runner.model) / bw * 1e3
    per_req = -(-max_len // llm.engine_config.block_size)
    for b in batches:
        tables = [[list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for _ in runner.kv_groups] for i in range(b)]
        prompt = torch.randint(0, runner.vocab_size, (args.context,)).tolist()
        for i in range(b):  # one request per prefill step: the step's token budget holds one context
            runner.forward_chunks([Chunk(prompt, 0, 0, tables[i])])
        pos = [args.context]

        def step(graph: bool, b: int = b, tables: list = tables, pos: list = pos) -> None:
            chunks = [Chunk([7], pos[0], 1, tables[i]) for i in range(b)]
            if graph:
                runner.forward_chunks(chunks)
            else:
                runner.execute(runner.buffers.load(chunks))
            pos[0] = args.context + (pos[0] - args.context + 1) % args.steps

        graph_ms = cuda_median_ms(lambda: step(True), args.steps)
        # The graph alone on inputs already in place: the step's GPU time with its launch gaps, no host work.
        graph = runner.graphs.graphs[(b, 1)][0]
        replay_ms = cuda_median_ms(graph.replay, args.steps)
        # The host's input build and upload alone (what graph_ms adds to replay_ms).
        chunks = [Chunk([7], args.context, 1, tables[i]) for i in range(b)]
        load_ms = cuda_median_ms(lambda b=b, chunks=chunks: runner.buffers.load(chunks, num_reqs=b, num_tokens=b,
                                                                                max_query_len=1), args.steps)
        eager_ms = cuda_median_ms(lambda: step(False), args.steps)
        # The whole engine step (scheduler, sampling, detokenizer-free output) from generate().
        params = SamplingParams(max_tokens=args.steps + 1, ignore_eos=True)
        prompts = [torch.randint(0, runner.vocab_size, (args.context,)).tolist() for _ in range(b)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        engine_ms = (time.perf_counter() - t0 - t_prefill) / args.steps * 1e3
        rows.append({"batch": b, "graph_ms": graph_ms, "replay_ms": replay_ms, "load_ms": load_ms, "eager_ms": eager_ms,
                     "engine_step_ms": engine_ms,
                     "floor_ms": floor_ms, "graph_vs_floor": graph_ms / floor_ms, "hf_eager_ms": hf.get(b),
                     "speedup_vs_hf": hf[b] / graph_ms if b in hf else None})
    cols = ["batch", "graph_ms", "replay_ms", "load_ms", "eager_ms", "engine_step_ms", "floor_ms", "graph_vs_floor",
            "hf_eager_ms", "speedup_vs_hf"]
    table = markdown_table(rows, cols)
    print(f"small_m_rows {llm.engine_config.small_m_rows}")
    print(f"{args.shape}: weights {weight_bytes(runner.model) / 1e9:.2f} GB, copy bandwidth {bw / 1e12:.2f} TB/s, "
          f"context {args.context}")
    print(table)
    save_json(args.out, {"env": environment(), "args": vars(args), "bandwidth_Bps": bw, "rows": rows})


if __name__ == "__main__":
    main()
