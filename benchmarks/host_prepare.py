"""The host's per-step input work against context length: it must grow with what a step adds, not with the context.

Two measurements per (context, batch), decode steps of one token per request:

- load_ms: the kernel path's input build alone, as a decode step runs it: each request's block tables arrive as new
  lists every step (the request table splices the plan's tails onto what it kept), the verifier makes the chunks, and
  `InputBuffers.load` writes them into the staging buffers padded to a graph's shape (and, on CUDA, queues the
  upload). Host wall time per step, median over --steps steps; the tables grow a block every block_size steps.
- engine prepare_ms / schedule_ms (unless --no-engine): the median of engine.step()'s `prepare` and `schedule`
  phases once every request decodes at that context. On CPU this is a tiny random Llama on the torch reference path
  (its `prepare` builds fresh metadata tensors, not the kernel path's buffers); with --device cuda it is --shape
  with random weights, the Triton kernels and CUDA graphs (the same engine phases benchmarks/gpu_decode.py reports).
  The batch's requests share one prompt (prefix caching), so one prefill serves them all. With --sliding-window the
  CPU engine's model is a Mistral whose only KV-cache group slides (its scheduler releases blocks every step).

    python benchmarks/host_prepare.py                       # CPU, tiny model
    python benchmarks/host_prepare.py --device cuda --shape qwen3-8b
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, save_json  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.kv_cache.spec import AttentionSpec, group_layers  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.runner.input_buffers import InputBuffers  # noqa: E402
from engine.runner.step_input import Chunk  # noqa: E402

BLOCK = 16
WARM_TOKENS = 4


def load_ms(device: torch.device, context: int, batch: int, steps: int, sliding_window: int | None) -> float:
    """Host ms per decode step of the kernel path's input build (module docstring)."""
    windows = [None] if sliding_window is None else [None, sliding_window]
    groups = group_layers([AttentionSpec(8, 128, torch.bfloat16, BLOCK, w) for w in windows])
    max_len = context + steps + 1
    buffers = InputBuffers(groups, max(batch, 8), 8192, max_len, device)
    per_req = -(-max_len // BLOCK)
    # [request][group] -> blocks, disjoint per request; a sliding group nulls the blocks that left its window
    pools = [[list(range(1 + (i * len(groups) + g) * per_req, 1 + (i * len(groups) + g + 1) * per_req))
              for g in range(len(groups))] for i in range(batch)]
    times = []
    for step in range(steps + 5):
        pos = context + step
        nblocks = pos // BLOCK + 1
        t0 = time.perf_counter()
        chunks = []
        for i in range(batch):
            tables = []
            for g, group in enumerate(groups):
                table = pools[i][g][:nblocks]  # a new list every step, as the request table's splice makes
                w = group.spec.sliding_window
                if w is not None:
                    gone = max(0, (pos - w + 1) // BLOCK)
                    table[:gone] = [0] * gone
                tables.append(table)
            chunks.append(Chunk([7], pos, 1, tables))
        buffers.load(chunks, num_reqs=batch, num_tokens=batch, max_query_len=1)
        if step >= 5:
            times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def tiny_model_dir(max_len: int, sliding_window: int | None) -> str:
    """A 1-layer random Llama, or with a sliding window a 1-layer random Mistral (its one KV-cache group sliding)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    kw = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
    cfg = LlamaConfig(**kw) if sliding_window is None else MistralConfig(sliding_window=sliding_window, **kw)
    path = Path(tempfile.mkdtemp()) / "tiny-model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def engine_phases_ms(llm: LLM, context: int, batch: int, steps: int) -> dict[str, float]:
    """Median ms of each engine.step() phase over `steps` decode steps of `batch` requests at `context` tokens."""
    engine, vocab = llm.engine, llm.executor.target.vocab_size
    prompt = torch.randint(3, vocab, (context,)).tolist()
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))  # the prefill the others reuse
    params = SamplingParams(max_tokens=WARM_TOKENS + steps + 8, ignore_eos=True)
    reqs = [Request(f"host-prepare-{context}-{batch}-{i}", prompt, params) for i in range(batch)]
    for r in reqs:
        engine.add_request(r)
    while min(len(r.output_token_ids) for r in reqs) < WARM_TOKENS:
        engine.step()
    phases = []
    for _ in range(steps):
        engine.step()
        phases.append(dict(engine.last_step.phase_seconds))
    while engine.has_unfinished():
        engine.step()
    return {k: statistics.median(p.get(k, 0.0) for p in phases) * 1e3 for k in phases[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="qwen3-8b", help="with --device cuda: the engine's model shape")
    ap.add_argument("--contexts", default="512,8192,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per load_ms measurement")
    ap.add_argument("--engine-steps", type=int, default=16, help="timed engine steps per measurement")
    ap.add_argument("--sliding-window", type=int, default=None,
                    help="load_ms: add a sliding-window KV-cache group of this window; the CPU engine: a Mistral "
                    "whose one group slides with it")
    ap.add_argument("--no-engine", action="store_true", help="load_ms only")
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device(args.device)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    llm = None
    if not args.no_engine:
        max_len = max(contexts) + WARM_TOKENS + args.engine_steps + 64
        if device.type == "cuda":
            from gpu_shapes import kv_memory_bytes, shape_dir

            llm = LLM(shape_dir(args.shape), load_format="dummy", device="cuda", max_model_len=max_len,
                      max_num_seqs=max(batches), enable_prefix_caching=True,
                      kv_cache_memory_bytes=kv_memory_bytes(args.shape, max(batches), max_len, 8 << 30),
                      cuda_graph_batch_sizes=tuple(batches))
        else:
            llm = LLM(tiny_model_dir(max_len, args.sliding_window), max_model_len=max_len, max_num_seqs=max(batches),
                      enable_prefix_caching=True, max_num_batched_tokens=4096)
    rows = []
    for c in contexts:
        for b in batches:
            row = {"context": c, "batch": b, "load_ms": load_ms(device, c, b, args.steps, args.sliding_window)}
            if llm is not None:
                ph = engine_phases_ms(llm, c, b, args.engine_steps)
                row.update(prepare_ms=ph.get("prepare"), schedule_ms=ph.get("schedule"))
            rows.append(row)
            print(row, flush=True)
    env = environment()
    print(f"\n{args.device}, block size {BLOCK}, sliding window {args.sliding_window}, {env}")
    print(markdown_table(rows, ["context", "batch", "load_ms"] + ([] if llm is None else ["prepare_ms",
                                                                                          "schedule_ms"])))
    save_json(args.out, {"env": env, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
