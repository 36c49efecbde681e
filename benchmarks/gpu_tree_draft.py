"""A whole tree pre-draft on one GPU, eager against CUDA graphs of tree forwards (engine/runner/tree_graphs.py).

What speculation ahead's tree mode runs after each proposal (engine/speculation/ahead/tree.py): for T requests, a
forward over each request's window [c, d_1..d_k], the roots chosen from its logits (top-F_a a outcome), then k
forwards over every branch, greedy. Timed from the call to the drafts on the host (what the next proposal waits
for), medians after warm-up, for T trees of B branches each, on a draft with random weights in bf16. `--roots`:
`device` picks the roots on the GPU (draft_tree's root_fanouts, what tree mode does for requests without logits
processing or seeds: no host round trip inside a tree), `host` through the host
(choose_roots, the path of requests with logits processing or seeds). `--no-pdl` turns programmatic dependent
launch off, so that a profile's kernel times are each kernel's own (with it, a kernel's time includes its wait for
the one before).

    python benchmarks/gpu_tree_draft.py --out results/gpu_tree_draft.json
"""

from __future__ import annotations

import argparse
import time

import torch
from common import environment, markdown_table, save_json
from gpu_decode import cuda_median_ms
from gpu_shapes import shape_dir

from engine.config import EngineConfig
from engine.kernels.triton_compat import set_pdl
from engine.model_config import ModelConfig
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk
from engine.runner.tree_graphs import tree_row_buckets
from engine.speculation.ahead.tree_draft import TreeDraftRequest, draft_tree, num_tree_nodes
from engine.speculation.ahead.tree_roots import top_f_roots_many
from engine.speculation.ahead.tree_schedule import TreeSchedule


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--trees", default="1,4,16")
    ap.add_argument("--fanouts", default="1,2,4", help="F: a tree has up to F x (k + 1) branches (the schedule's)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=0.7, help="acceptance the schedule's F_a follow")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--roots", default="device,host", help="where the roots are picked: device, host, or both")
    ap.add_argument("--no-pdl", action="store_true", help="no programmatic dependent launch (profiles)")
    ap.add_argument("--no-eager", action="store_true", help="graphs only (an eager tree takes ~0.1 s)")
    ap.add_argument("--profile", action="store_true", help="also profile one graph-mode configuration (the last): the "
                    "host's functions by own time, and the GPU's busy time against the wall")
    ap.add_argument("--host-breakdown", action="store_true", help="the last configuration's host time: in each "
                    "forward's buffer updates, in graph replays, and in all, against the draft's wall time")
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.no_pdl:
        set_pdl(False)
    trees = [int(x) for x in args.trees.split(",")]
    fanouts = [int(x) for x in args.fanouts.split(",")]
    k, max_t, max_f = args.k, max(trees), max(fanouts)
    widest = max_f * (k + 1)
    nodes = num_tree_nodes(k + 1, widest, k)
    max_len = args.prefix + 64
    bs = EngineConfig.block_size
    per_req = -(-max_len // bs)
    scratch_blocks = -(-max_t * nodes // bs)
    cfg = EngineConfig(device=torch.device("cuda"), dtype=torch.bfloat16, max_model_len=max_len, max_num_seqs=max_t,
                       max_num_batched_tokens=max(max_len, 2048), num_kv_blocks=1 + max_t * per_req + scratch_blocks,
                       num_speculative_tokens=k, load_format="dummy")
    mc = ModelConfig.from_path(shape_dir(args.shape))
    mc.max_model_len = max_len
    runner = ModelRunner(mc, cfg, "draft")
    graphs = runner.build_tree_graphs(tree_row_buckets(k + 1, widest), nodes, 512)
    runner.tree_graphs = None
    g = torch.Generator().manual_seed(0)
    tables = [[list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for _ in runner.kv_groups] for i in range(max_t)]
    for i in range(max_t):
        runner.forward_chunks([Chunk(torch.randint(0, runner.vocab_size, (args.prefix,), generator=g).tolist(), 0, 0,
                                     tables[i])])
    first_scratch = (1 + max_t * per_req) * bs
    results = []
    for f in fanouts:
        fan = TreeSchedule(f, runner.vocab_size).fanout(k, args.alpha, widest)
        for t in trees:
            window = [torch.randint(0, runner.vocab_size, (k + 1,), generator=g).tolist() for _ in range(t)]
            reqs = [TreeDraftRequest(args.prefix - 1, tables[i], window[i], [],
                                     [list(range(first_scratch + i * nodes, first_scratch + (i + 1) * nodes))]
                                     * len(runner.kv_groups)) for i in range(t)]

            def choose(logits: list[torch.Tensor], window: list[list[int]] = window,
                       fan: list[int] = fan) -> list[list[list[int]]]:
                # SYNC: the roots on the host, as tree mode takes them
                return [[[], *r] for r in top_f_roots_many(logits, [w[1:] for w in window], [fan] * len(logits))]

            for where in args.roots.split(","):
                picks = dict(root_fanouts=[fan] * t) if where == "device" else dict(choose_roots=choose)

                def run(reqs: list[TreeDraftRequest] = reqs, picks: dict = picks) -> None:
                    out = draft_tree(runner, reqs, k, keep_logits=False, keep_probs=False, **picks)
                    out[-1].tokens.cpu()  # the drafts on the host: what the next proposal's lookup waits for

                row = {"F": f, "branches": sum(fan), "trees": t, "roots": where}
                if not args.no_eager:
                    runner.tree_graphs = None
                    row["eager_ms"] = cuda_median_ms(run, args.steps)
                runner.tree_graphs = graphs
                before = graphs.num_replays
                row["graph_ms"] = cuda_median_ms(run, args.steps)
                row["replays_per_draft"] = (graphs.num_replays - before) / (args.steps + 5)
                if "eager_ms" in row:
                    row["speedup"] = row["eager_ms"] / row["graph_ms"]
                results.append(row)
    if args.host_breakdown:
        host_breakdown(run, graphs)
    if args.profile:
        profile(run)
    cols = ["F", "branches", "trees", "roots", "eager_ms", "graph_ms", "speedup", "replays_per_draft"]
    env = environment()
    print(f"{args.shape} tree pre-draft, k={k}, prefix {args.prefix}, bf16 ({env['device']}); {len(graphs.graphs)} "
          f"tree graphs; {time.perf_counter() - t0:.0f} s in all")
    print(markdown_table(results, cols))
    save_json(args.out, {"env": env, "args": vars(args), "rows": results})


def host_breakdown(run, graphs) -> None:  # noqa: ANN001 - the last configuration's draft and its TreeGraphs
    """Where the host's time of a draft goes: if the host's own work a forward outlasts the GPU's, the host bounds
    the tree (the GPU waits between forwards)."""
    spent = {"run": 0.0, "replay": 0.0}
    inner_run, inner_replay = graphs.run, torch.cuda.CUDAGraph.replay

    def timed_run(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        try:
            return inner_run(*a, **kw)
        finally:
            spent["run"] += time.perf_counter() - t

    def timed_replay(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        t = time.perf_counter()
        try:
            return inner_replay(self, *a, **kw)
        finally:
            spent["replay"] += time.perf_counter() - t

    n = 10
    graphs.run, torch.cuda.CUDAGraph.replay = timed_run, timed_replay
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            run()
        wall = (time.perf_counter() - t0) / n
    finally:
        graphs.run, torch.cuda.CUDAGraph.replay = inner_run, inner_replay
    print(f"per draft: wall {wall * 1e3:.2f} ms; host in TreeGraphs.run {spent['run'] / n * 1e3:.2f} ms, of which "
          f"graph replays {spent['replay'] / n * 1e3:.2f} ms")


def profile(run) -> None:  # noqa: ANN001 - the last configuration's draft
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    n = 10
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        run()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n
    gpu = sum(e.self_device_time_total for e in p.key_averages()) / n / 1e3
    print(f"per draft: wall {wall * 1e3:.2f} ms, GPU busy {gpu:.2f} ms")
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
