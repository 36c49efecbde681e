"""Decode step time of a Qwen3-8B-shaped target (random weights, bf16) at batch 1, 8, 32 on one GPU: the
engine's CUDA-graph step and its eager step, against the memory-bandwidth floor (weight bytes over the copy
bandwidth measured in the same run) and HF transformers eager decoding in the same run.

Columns: graph_ms = input build + graph replay through the runner; replay_ms = the graph alone; load_ms = the input
build alone; eager_ms = the runner's eager forward; engine_step_ms = the whole engine step per decoded token
(schedule, input build, replay, sampling, commit), timed on engine.step() itself after a warm-up
(`engine_step_ms`); engine_phases_ms (JSON only) = the median of each phase the engine records; floor_kv_ms = the
weights and every request's KV of its context (`--context`; a window layer's within its window) over the copy
bandwidth: the floor at long context.

    python benchmarks/gpu_decode.py --out results/gpu_decode.json
    python benchmarks/gpu_decode.py --shape gpt-oss-20b --skip-hf   # also qwen3-8b-fp8 (any shape + "-fp8")
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from common import environment, markdown_table, save_json
from gpu_shapes import copy_bandwidth, hf_config, kv_bytes_read, kv_memory_bytes, prefill, shape_dir, step_bytes

from engine import LLM, SamplingParams
from engine.kernels.small_m import tiles as small_m_tiles
from engine.kernels.triton_compat import set_pdl
from engine.request import Request
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


ENGINE_WARM_TOKENS = 4  # decode steps every request takes before the engine step is timed
_REQUEST_IDS = itertools.count()


def prefill_margin(batch: int, context: int) -> int:
    """Tokens the first requests may decode while the last ones' prompts are still prefilled: a step prefills at
    least 1024 tokens (the engine's token budget is larger), so the wave's prefill takes at most this many steps."""
    return 64 + batch * context // 1024


def engine_tokens(steps: int, repeats: int, batch: int = 1, context: int = 0) -> int:
    """Output tokens per request of engine_step_ms's timed requests: warm-up, the timed runs, a margin for the
    step in flight and for the decode steps that early requests take while later prompts are still prefilled
    in chunks (none may finish before the last timed step)."""
    return ENGINE_WARM_TOKENS + steps * repeats + 8 + prefill_margin(batch, context)


def engine_step_ms(llm: LLM, batch: int, context: int, steps: int, repeats: int) -> tuple[float, dict[str, float]]:
    """The whole engine step per decoded token at `batch` running requests (schedule, input build, graph replay,
    sampling, commit), timed directly on engine.step() once every request is decoding.

    Warm-up first: two generate() calls of the same prompt length and batch (prefill, decode at this batch and
    sampling compile and settle there). Then `batch` requests long enough to stay running: steps until each has
    ENGINE_WARM_TOKENS tokens (the prefills are done), then `repeats` runs of `steps` step() calls, each run
    between two synchronizes; the median of the runs' means. With asynchronous scheduling a step() submits one
    step and collects the one before, so a run of n calls still covers n steps of GPU work. Also returns the
    median of each phase the engine records per step (engine.last_step.phase_seconds), in ms."""
    engine = llm.engine
    vocab = llm.executor.target.vocab_size
    for _ in range(2):
        prompts = [torch.randint(0, vocab, (context,)).tolist() for _ in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=ENGINE_WARM_TOKENS + 4, ignore_eos=True))
    params = SamplingParams(max_tokens=engine_tokens(steps, repeats, batch, context), ignore_eos=True)
    reqs = [Request(f"engine-step-{next(_REQUEST_IDS)}", torch.randint(0, vocab, (context,)).tolist(), params)
            for _ in range(batch)]
    for r in reqs:
        engine.add_request(r)
    while min(len(r.output_token_ids) for r in reqs) < ENGINE_WARM_TOKENS:
        engine.step()
    ahead = max(len(r.output_token_ids) for r in reqs) - ENGINE_WARM_TOKENS
    if ahead > prefill_margin(batch, context):
        raise RuntimeError(f"the first requests decoded {ahead} tokens while the last were prefilled: raise "
                           "prefill_margin")
    means, phases = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
            phases.append(dict(engine.last_step.phase_seconds))
        torch.cuda.synchronize()
        means.append((time.perf_counter() - t0) / steps)
    if any(r.finish_reason is not None for r in reqs):
        raise RuntimeError("a timed request finished before the last timed step: raise engine_tokens")
    while engine.has_unfinished():
        engine.step()
    names = sorted({k for p in phases for k in p})
    return statistics.median(means) * 1e3, {k: statistics.median(p.get(k, 0.0) for p in phases) * 1e3 for k in names}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per measurement (per engine-step run)")
    ap.add_argument("--repeats", type=int, default=5, help="engine_step_ms: runs of --steps engine steps; the median")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--small-m-rows", type=int, default=None,
                    help="EngineConfig.small_m_rows (0: cuBLAS products and separate norm/activation kernels)")
    ap.add_argument("--no-pdl", action="store_true", help="launch every kernel the ordinary way (no programmatic "
                    "dependent launch), as before it existed")
    ap.add_argument("--fp8-folded", action="store_true", help="an FP8 shape's layers through the folded few-row "
                    "products on this GPU (small_m_tiles.FP8_FOLDED_MEASURED), as where they measured faster")
    ap.add_argument("--out")
    args = ap.parse_args()
    set_pdl(not args.no_pdl)
    if args.fp8_folded:
        small_m_tiles.FP8_FOLDED_MEASURED.add(small_m_tiles.device_name(torch.device("cuda")))
    batches = [int(b) for b in args.batch.split(",")]
    bw = copy_bandwidth()
    rows = []
    hf = {} if args.skip_hf else {b: hf_decode_ms(args.shape, b, args.context, args.steps) for b in batches}
    max_len = args.context + engine_tokens(args.steps, args.repeats, max(batches), args.context) + 64
    llm = LLM(shape_dir(args.shape), load_format="dummy", device="cuda", max_model_len=max_len,
              max_num_seqs=max(batches),
              kv_cache_memory_bytes=kv_memory_bytes(args.shape, max(batches), max_len, 8 << 30),
              cuda_graph_batch_sizes=tuple(batches),
              **({} if args.small_m_rows is None else {"small_m_rows": args.small_m_rows}))
    runner = llm.executor.target
    kv_read = kv_bytes_read(args.shape, args.context)
    per_req = -(-max_len // llm.engine_config.block_size)
    for b in batches:
        # What a step of b rows must read (a model with routed experts: the experts b tokens route to).
        weights = step_bytes(runner.model, b)
        floor_ms = weights / bw * 1e3
        tables = [[list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for _ in runner.kv_groups] for i in range(b)]
        prompt = torch.randint(0, runner.vocab_size, (args.context,)).tolist()
        for i in range(b):  # one request at a time, in chunks: a long context does not fit one forward
            prefill(runner, prompt, tables[i])
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
        engine_ms, phases = engine_step_ms(llm, b, args.context, args.steps, args.repeats)
        rows.append({"batch": b, "graph_ms": graph_ms, "replay_ms": replay_ms, "load_ms": load_ms, "eager_ms": eager_ms,
                     "engine_step_ms": engine_ms, "engine_vs_floor": engine_ms / floor_ms, "engine_phases_ms": phases,
                     "floor_ms": floor_ms, "graph_vs_floor": graph_ms / floor_ms, "hf_eager_ms": hf.get(b),
                     "speedup_vs_hf": hf[b] / graph_ms if b in hf else None,
                     # What a step must read: the weights and, per request, every layer's KV of its context.
                     "floor_kv_ms": (weights + b * kv_read) / bw * 1e3})
        rows[-1]["engine_vs_floor_kv"] = engine_ms / rows[-1]["floor_kv_ms"]
    cols = ["batch", "graph_ms", "replay_ms", "load_ms", "eager_ms", "engine_step_ms", "floor_ms", "graph_vs_floor",
            "engine_vs_floor", "floor_kv_ms", "engine_vs_floor_kv", "hf_eager_ms", "speedup_vs_hf"]
    table = markdown_table(rows, cols)
    print(f"small_m_rows {llm.engine_config.small_m_rows}")
    print(f"{args.shape}: weights {step_bytes(runner.model, 1) / 1e9:.2f} GB read at batch 1, copy bandwidth "
          f"{bw / 1e12:.2f} TB/s, context {args.context}")
    print(table)
    for r in rows:
        print(f"batch {r['batch']}: engine step phases, median ms: "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["engine_phases_ms"].items()))
    save_json(args.out, {"env": environment(), "args": vars(args), "bandwidth_Bps": bw, "rows": rows})


if __name__ == "__main__":
    main()
