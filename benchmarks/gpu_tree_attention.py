"""Tree forward of a draft on the kernel path (Triton tree attention, engine/kernels/attention/tree.py): one request's
tree of R rows over a committed prefix, against R = 1, on one GPU (random weights, bf16). Per prefix length and row
count: the whole draft forward (embedding to logits) eagerly (a small draft's eager forward is bound by the host's
launches), and its GPU time from a CUDA graph of it (what draft_tree's graphs of tree buckets cost, less their
padding: benchmarks/gpu_tree_draft.py times those); the tree-attention kernel alone (one layer's launch, GPU time from a
graph of 20 launches); the ordinary one-row decode forward (paged attention, eager) for scale. Medians after
warm-up; ratios to one tree row.

    python benchmarks/gpu_tree_attention.py --out results/gpu_tree_attention.json
    python benchmarks/gpu_tree_attention.py --prefixes 512 --rows 1,5,16,32,64 --small-m-rows 64  # split-K products
"""

from __future__ import annotations

import argparse
import time

import torch
from common import environment, graph_us, markdown_table, save_json
from gpu_decode import cuda_median_ms
from gpu_shapes import shape_dir

from engine.config import EngineConfig
from engine.kernels.attention import tree as tree_attention_kernels
from engine.kernels.attention.tree import tree_attention
from engine.model_config import ModelConfig
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk, StepInput
from engine.speculation.ahead import tree_draft


def tree_parents(rows: int, k: int) -> list[int]:
    """A tree of `rows` nodes as a first pre-drafting forward feeds it: a window of k drafts (a chain), then roots
    spread over the k + 1 outcomes (root j follows d_{j mod (k + 1)}, the prefix's end for outcome 0)."""
    k = min(k, rows - 1)
    return [i - 1 for i in range(k)] + [j % (k + 1) - 1 for j in range(rows - k)]


def tree_step(runner: ModelRunner, prefix_len: int, tables: list[list[int]], rows: int, k: int) -> StepInput:
    """The StepInput draft_tree builds for one forward over a tree of `rows` rows (captured, not run)."""
    parents = tree_parents(rows, k)
    bs = runner.config.block_size
    first = runner.num_blocks - (-(-rows // bs))  # scratch slots in blocks of their own, past the prefix's
    slots = list(range(first * bs, first * bs + rows))
    req = tree_draft.TreeDraftRequest(prefix_len, tables, [], [[]], [list(slots) for _ in runner.kv_groups])
    return tree_draft.TreeForwards(runner, [req], [parents]).eager_step([list(range(rows))],
                                                                       torch.arange(rows, device=runner.device))


def kernel_us(runner: ModelRunner, step: StepInput, calls: int = 20) -> float:
    """GPU time of one layer's tree-attention launch (layer 0's cache and group), from graph replays."""
    layer = runner.model.attention_layers()[0]
    kv, t, group = layer.kv_cache, step.attn.tree, step.attn.groups[layer.kv_group_id]
    n = t.positions.shape[0]
    q = torch.randn(n, layer.num_heads, layer.head_dim, dtype=kv.dtype, device=kv.device)
    out = torch.empty_like(q)

    def run(_: int) -> None:
        tree_attention(q, kv[0], kv[1], out, group.block_table, t.row_index, t.row_positions, t.prefix_lens,
                       t.node_positions, t.node_slots[group.group_id], t.visible, layer.scale, group.sliding_window)

    return graph_us(run, calls)


def graph_forward_ms(runner: ModelRunner, step: StepInput) -> float | None:
    """GPU time of the whole tree forward from a CUDA graph of it; None (and the reason printed) if capture fails."""
    try:
        return graph_us(lambda _: runner.execute(step), 1, replays=20) / 1e3
    except Exception as e:  # noqa: BLE001 - the eager timings still stand
        print(f"graph capture of the tree forward failed: {type(e).__name__}: {e}")
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--prefixes", default="512,2048")
    ap.add_argument("--rows", default="1,5,15,30,60")
    ap.add_argument("--k", type=int, default=4, help="window drafts in the tree (a chain), the rest are roots")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--small-m-rows", type=int, default=EngineConfig.small_m_rows,
                    help="EngineConfig.small_m_rows: forwards of up to this many rows (at most 64) take the few-row "
                         "products (split K from 5 rows); 0: cuBLAS and the separate norm/activation kernels")
    ap.add_argument("--max-block-m", default=str(tree_attention_kernels.MAX_BLOCK_M),
                    help="tree_attention.MAX_BLOCK_M values to compare, e.g. 64,128: (row, head) pairs a program "
                         "takes at most; a wider tree reads the prefix once per block of them")
    ap.add_argument("--no-eager", action="store_true", help="graph and kernel times only")
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.perf_counter()
    prefixes = [int(x) for x in args.prefixes.split(",")]
    row_counts = [int(x) for x in args.rows.split(",")]
    max_len = max(prefixes) + 128
    per_req = -(-max_len // EngineConfig.block_size)
    max_rows = max(row_counts)
    # The request's blocks 1..per_req, then the tree's scratch blocks.
    num_blocks = 1 + per_req + -(-max_rows // EngineConfig.block_size)
    cfg = EngineConfig(device=torch.device("cuda"), dtype=torch.bfloat16, max_model_len=max_len, max_num_seqs=1,
                       max_num_batched_tokens=max_len, num_kv_blocks=num_blocks, enforce_eager=True,
                       load_format="dummy", small_m_rows=args.small_m_rows)
    mc = ModelConfig.from_path(shape_dir(args.shape))
    mc.max_model_len = max_len
    runner = ModelRunner(mc, cfg, "draft")
    tables = [list(range(1, 1 + per_req)) for _ in runner.kv_groups]
    results = []
    for prefix_len in prefixes:
        runner.forward_chunks([Chunk(torch.randint(0, runner.vocab_size, (prefix_len,)).tolist(), 0, 0, tables)])
        decode = Chunk([11], prefix_len, 1, tables)  # the ordinary one-row forward at the same position
        decode_ms = cuda_median_ms(lambda d=decode: runner.forward_chunks([d]), args.steps)
        base: dict = {}
        for rows in row_counts:
            for block_m in (int(x) for x in args.max_block_m.split(",")):
                tree_attention_kernels.MAX_BLOCK_M = block_m
                step = tree_step(runner, prefix_len, tables, rows, args.k)
                fwd = None if args.no_eager else cuda_median_ms(lambda s=step: runner.execute(s), args.steps)
                gfwd = graph_forward_ms(runner, step)
                kern = kernel_us(runner, step)
                base = base or {"fwd": fwd, "gfwd": gfwd, "kern": kern}
                results.append({"prefix": prefix_len, "rows": rows, "max_block_m": block_m, "eager_fwd_ms": fwd,
                                "eager_ratio": fwd / base["fwd"] if fwd and base["fwd"] else None,
                                "graph_fwd_ms": gfwd,
                                "graph_ratio": gfwd / base["gfwd"] if gfwd and base["gfwd"] else None,
                                "kernel_us": kern, "kernel_ratio": kern / base["kern"],
                                "decode_eager_ms": decode_ms})
                torch.cuda.empty_cache()
    cols = ["prefix", "rows", "max_block_m", "eager_fwd_ms", "eager_ratio", "graph_fwd_ms", "graph_ratio", "kernel_us",
            "kernel_ratio", "decode_eager_ms"]
    env = environment()
    print(f"{args.shape} tree forward, kernel path, bf16, k={args.k}, small_m_rows {args.small_m_rows} "
          f"({env['device']}); "
          f"{time.perf_counter() - t0:.0f} s in all")
    print(markdown_table(results, cols))
    save_json(args.out, {"env": env, "args": vars(args), "rows": results})


if __name__ == "__main__":
    main()
