"""Draft step time on one GPU, CUDA graphs against eager, for a Qwen3-0.6B shape and SmolLM2-135M (random
weights, bf16): one draft loop of k steps from a 512-token context, timed whole and divided by k, plus HF
transformers eager decoding of the same shape for scale.

    python benchmarks/gpu_draft.py --out results/gpu_draft.json
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from common import environment, markdown_table, prefix_token_map, save_json
from gpu_decode import cuda_median_ms, hf_decode_ms
from gpu_shapes import copy_bandwidth, kv_bytes_read, kv_memory_bytes, prefill, shape_dir, weight_bytes

from engine.config import EngineConfig
from engine.kernels.triton_compat import set_pdl
from engine.model_config import ModelConfig
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk
from engine.sample.metadata import SamplingMetadata
from engine.speculation.draft_loop import DraftLoop


def loop_ms(name: str, batch: int, k: int, context: int, graphs: bool, greedy: bool, steps: int,
            small_m_rows: int = EngineConfig.small_m_rows, token_map: str | None = None,
            phases: dict | None = None, catch_up: int = 2, bandwidth: float | None = None,
            persistent_rows: int = 0, host_profile: int = 0, max_model_len: int = 0) -> float:
    """ms per draft token; with phases (a dict, graphs only) also the first step's graph replay alone (catch-up of
    two tokens a request: 2 x batch rows) and a later step's (batch rows), as `first_step_ms` and `next_step_ms`,
    the host's time to queue a loop, `loop_host_ms`, and with `bandwidth` (bytes/s) the floor of a draft token,
    `floor_kv_ms`: the weights and every request's KV of its context (a window layer's within its window) read once.
    max_model_len: the model's longest context if above the run's own (graphs size the attention's splits from it)."""
    max_len = context + 64 + ((2 + k) * (steps + 5) if phases is not None else 0)  # room for the replays alone
    max_len = max(max_len, max_model_len)
    cfg = EngineConfig(device=torch.device("cuda"), dtype=torch.bfloat16, max_model_len=max_len, max_num_seqs=batch,
                       kv_cache_memory_bytes=kv_memory_bytes(name, batch, max_len, 2 << 30), enforce_eager=not graphs,
                       num_speculative_tokens=k,
                       load_format="dummy", cuda_graph_batch_sizes=(batch,), small_m_rows=small_m_rows,
                       persistent_decode_rows=persistent_rows)
    mc = ModelConfig.from_path(shape_dir(name))
    mc.max_model_len = max_len
    runner = ModelRunner(mc, cfg, "draft", draft_token_map=token_map)
    loop = DraftLoop(runner, k, keep_probs=not greedy)
    loop.capture()
    per_req = -(-max_len // cfg.block_size)
    tables = [[list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for _ in runner.kv_groups] for i in range(batch)]
    prompt = torch.randint(0, runner.vocab_size, (context,)).tolist()
    for i in range(batch):
        prefill(runner, prompt, tables[i])
    temp = 0.0 if greedy else 0.8
    md = SamplingMetadata.from_lists([temp] * batch, [1.0] * batch, [0] * batch, device="cuda")
    gen = torch.Generator(device="cuda")
    # The first step catches up the last accepted token and the bonus token (2: a fully accepted window) or the
    # target's correction alone (1: after a rejection).
    chunks = [Chunk([11, 12][-catch_up:], context, 1, tables[i]) for i in range(batch)]
    per_token = cuda_median_ms(lambda: loop.run(chunks, [k] * batch, md, {}, gen), steps) / k
    if phases is not None and graphs:
        # One graph replayed over and over: the step index is reset before each replay, or it would run past the
        # rows' draft counts, where a row writes nowhere and attends to position 0 only (a shorter attention).
        # Positions still move on by one a replay (max_len leaves room for them).
        def replay(graph: torch.cuda.CUDAGraph) -> None:
            loop.step_idx.zero_()
            graph.replay()
        phases["first_step_ms"] = cuda_median_ms(lambda: replay(loop.first_graphs[(batch, greedy)]), steps)
        phases["next_step_ms"] = cuda_median_ms(lambda: replay(loop.next_graphs[(batch, greedy)]), steps)
        # k replays back to back with no input build between them: the loop's GPU time without its host share.
        phases["k_replays_ms"] = cuda_median_ms(
            lambda: [replay(loop.next_graphs[(batch, greedy)]) for _ in range(k)], steps) / k
        phases["loop_host_ms"] = host_ms(lambda: loop.run(chunks, [k] * batch, md, {}, gen), steps)
        if host_profile:
            phases.update(host_sections(loop, lambda: loop.run(chunks, [k] * batch, md, {}, gen), steps))
            print_host_profile(lambda: loop.run(chunks, [k] * batch, md, {}, gen), steps, host_profile)
            phases.update(loop_timeline(lambda: loop.run(chunks, [k] * batch, md, {}, gen), steps))
        if bandwidth:
            read = weight_bytes(runner.model) + batch * kv_bytes_read(name, context)
            phases["floor_kv_ms"] = read / bandwidth * 1e3
            phases["vs_floor_kv"] = per_token / phases["floor_kv_ms"]
    return per_token


def host_ms(run, steps: int) -> float:
    """The host's time to queue one whole loop (k steps; from a synchronized start, no sync at its end): far below
    the loop's wall time when the GPU, not the host, bounds it."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def print_host_profile(run, steps: int, top: int) -> None:
    """cProfile of the host's side of `steps` loops (synchronized between them, as host_ms): the functions with the
    most time of their own, to find what the host does before the GPU has work."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(steps):
        torch.cuda.synchronize()
        prof.enable()
        run()
        prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


class _Timed:
    """Wraps a callable attribute and adds its wall time (host) to a running total."""

    def __init__(self, fn, total: list[float]) -> None:  # noqa: ANN001
        self.fn, self.total = fn, total

    def __call__(self, *a, **kw):  # noqa: ANN002, ANN003, ANN204
        t0 = time.perf_counter()
        out = self.fn(*a, **kw)
        self.total[0] += time.perf_counter() - t0
        return out


class _TimedGraph:
    """A graph whose replays add their host time to `total` and note when the first one was called."""

    def __init__(self, graph: torch.cuda.CUDAGraph, total: list[float], first: list[float]) -> None:
        self.graph, self.total, self.first = graph, total, first

    def replay(self) -> None:
        t0 = time.perf_counter()
        if not self.first[0]:
            self.first[0] = t0
        self.graph.replay()
        self.total[0] += time.perf_counter() - t0


def host_sections(loop: DraftLoop, run, steps: int) -> dict:  # noqa: ANN001
    """The host's time in a loop (no profiler), split: the input build and upload (`buffers.load`), the graph
    launches, and the rest of `DraftLoop.run` (per-row settings, the output's clone and mask); and the wall time
    from the call to its first graph launch and from there to the GPU's end. Medians of `steps` loops, each from a
    synchronized start."""
    load_t, replay_t, first_t = [0.0], [0.0], [0.0]
    orig_load, graphs = loop.buffers.load, (loop.first_graphs, loop.next_graphs)
    saved = [dict(g) for g in graphs]
    loop.buffers.load = _Timed(orig_load, load_t)  # type: ignore[method-assign]
    for g in graphs:
        for key, graph in list(g.items()):
            g[key] = _TimedGraph(graph, replay_t, first_t)  # type: ignore[assignment]
    rows: dict[str, list[float]] = {"host_load_ms": [], "host_replays_ms": [], "host_rest_ms": [],
                                    "host_to_first_replay_ms": [], "first_replay_to_done_ms": []}
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            load_t[0] = replay_t[0] = first_t[0] = 0.0
            t0 = time.perf_counter()
            run()
            total = time.perf_counter() - t0
            torch.cuda.synchronize()
            done = time.perf_counter()
            rows["host_to_first_replay_ms"].append((first_t[0] - t0) * 1e3)
            rows["first_replay_to_done_ms"].append((done - first_t[0]) * 1e3)
            rows["host_load_ms"].append(load_t[0] * 1e3)
            rows["host_replays_ms"].append(replay_t[0] * 1e3)
            rows["host_rest_ms"].append((total - load_t[0] - replay_t[0]) * 1e3)
        torch.cuda.synchronize()
    finally:
        del loop.buffers.load
        for g, orig in zip(graphs, saved):
            g.update(orig)
    out = {k: statistics.median(v) for k, v in rows.items()}
    print("host sections (medians):", {k: round(v, 4) for k, v in out.items()})
    return out


def loop_timeline(run, steps: int) -> dict:
    """Where a loop's wall time goes on the GPU's clock (torch.profiler, medians over `steps` loops, each from a
    synchronized start): `to_first_kernel_ms` from the call to its first kernel, `kernel_busy_ms` the union of its
    kernels, `gaps_ms` the idle time between its first and last kernel, `after_last_kernel_ms` from there to the
    end of the synchronize."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            with record_function("draft_loop_timed"):
                run()
                torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    loops = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "draft_loop_timed"
                   and e.get("cat") == "user_annotation")
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"][:60]) for e in events if e.get("cat") == "kernel")
    gap_by_pair: collections.Counter[str] = collections.Counter()
    time_by_kernel: collections.Counter[str] = collections.Counter()
    parts: dict[str, list[float]] = {"to_first_kernel_ms": [], "kernel_busy_ms": [], "gaps_ms": [],
                                     "after_last_kernel_ms": [], "kernels_per_loop": []}
    for start, end in loops:
        ks = [(a, b, name) for a, b, name in kernels if start <= a < end]
        if not ks:
            continue
        busy, cur_a, cur_b, prev = 0.0, ks[0][0], ks[0][1], ks[0][2]
        time_by_kernel[prev] += ks[0][1] - ks[0][0]
        for a, b, name in ks[1:]:
            time_by_kernel[name] += b - a
            if a > cur_b:
                busy += cur_b - cur_a
                gap_by_pair[f"{prev} -> {name}"] += a - cur_b
                cur_a = a
            cur_b = max(cur_b, b)
            prev = name
        busy += cur_b - cur_a
        last = max(b for _, b, _ in ks)
        parts["to_first_kernel_ms"].append((ks[0][0] - start) / 1e3)
        parts["kernel_busy_ms"].append(busy / 1e3)
        parts["gaps_ms"].append((last - ks[0][0] - busy) / 1e3)
        parts["after_last_kernel_ms"].append((end - last) / 1e3)
        parts["kernels_per_loop"].append(len(ks))
    out = {k: statistics.median(v) for k, v in parts.items() if v}
    print("loop timeline (medians):", {k: round(v, 4) for k, v in out.items()})
    n = max(len(parts["kernels_per_loop"]), 1)
    print("idle before a kernel, by (kernel before -> kernel), us a loop:")
    for pair, us in gap_by_pair.most_common(8):
        print(f"  {us / n:8.1f}  {pair}")
    print("kernel time (with dependent launch: includes its wait), by kernel, us a loop:")
    for name, us in time_by_kernel.most_common(12):
        print(f"  {us / n:8.1f}  {name}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-0.6b,smollm2-135m")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--small-m-rows", type=int, default=EngineConfig.small_m_rows,
                    help="EngineConfig.small_m_rows (0: cuBLAS products and separate norm/activation kernels)")
    ap.add_argument("--persistent-rows", default="0",
                    help="EngineConfig.persistent_decode_rows, comma-separated to time each (0: the layers' own "
                         "kernels; N: decode steps of up to N rows in one persistent launch)")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True, help="also time eager loops")
    ap.add_argument("--sampled", action=argparse.BooleanOptionalAction, default=True, help="also time sampling")
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="also time HF eager")
    ap.add_argument("--no-pdl", action="store_true", help="launch every kernel the ordinary way (no programmatic "
                    "dependent launch), as before it existed")
    ap.add_argument("--catch-up", type=int, choices=(1, 2), default=2,
                    help="tokens a request catches up in the first step: 2 after a fully accepted window, 1 after "
                         "a rejection")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="restrict the draft's LM head to this many token ids (EngineConfig.draft_token_map)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="print the N host functions with the most time of their own in a loop (cProfile), and "
                         "where the loop's wall time goes on the GPU's clock (torch.profiler)")
    ap.add_argument("--rounds", type=int, default=1, help="time every setting this many times, alternated")
    ap.add_argument("--out")
    args = ap.parse_args()
    set_pdl(not args.no_pdl)
    token_map = prefix_token_map(args.draft_vocab)
    rows = []
    bandwidth = copy_bandwidth()
    t0 = time.perf_counter()
    settings = [(name, b, p) for _ in range(args.rounds) for name in args.shapes.split(",")
                for b in (int(x) for x in args.batch.split(",")) for p in (int(x) for x in
                                                                          args.persistent_rows.split(","))]
    for name, b, persistent in settings:
        row = {"shape": name, "batch": b, "k": args.k, "catch_up": args.catch_up, "small_m_rows": args.small_m_rows,
               "persistent_rows": persistent, "draft_vocab": args.draft_vocab or "all"}
        for greedy in (True, False) if args.sampled else (True,):
            tag = "greedy" if greedy else "sampled"
            phases: dict = {}
            row[f"graph_{tag}_ms"] = loop_ms(name, b, args.k, args.context, True, greedy, args.steps,
                                             args.small_m_rows, token_map, phases, args.catch_up,
                                             bandwidth, persistent, args.host_profile)
            if greedy:
                row.update(phases)
            if args.eager:
                row[f"eager_{tag}_ms"] = loop_ms(name, b, args.k, args.context, False, greedy, args.steps,
                                                 args.small_m_rows, token_map, None, args.catch_up,
                                                 persistent_rows=persistent)
            torch.cuda.empty_cache()
        if args.eager:
            row["graph_speedup"] = row["eager_greedy_ms"] / row["graph_greedy_ms"]
        if args.hf:
            row["hf_eager_ms"] = hf_decode_ms(name, b, args.context, args.steps)
        rows.append(row)
    cols = ["shape", "batch", "k", "catch_up", "small_m_rows", "persistent_rows", "draft_vocab", "graph_greedy_ms",
            "first_step_ms",
            "next_step_ms", "k_replays_ms", "loop_host_ms", "floor_kv_ms", "vs_floor_kv", "eager_greedy_ms",
            "graph_speedup", "graph_sampled_ms", "eager_sampled_ms", "hf_eager_ms"]
    print(f"draft step time (ms per draft token, loop of k={args.k} from a {args.context}-token context); "
          f"{time.perf_counter() - t0:.0f} s")
    print(markdown_table(rows, [c for c in cols if c in rows[0]]))
    save_json(args.out, {"env": environment(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
