"""A speculative step's latency with the draft's ranks on the target's node vs on a node of their own.

    python benchmarks/cross_node_step.py [--batch-sizes 1 8] [--k 4] [--steps 200] [--rounds 4]

Starts a local multi-node cluster (ray.cluster_utils.Cluster: a head for the router, node A and node B, each a
raylet with its own object store, so nothing crosses between them through shared memory) and runs the same
decode StepPlan (benchmarks/router_overhead.py's) through RayExecutor four ways: compiled graph or plain actor
calls, with the draft's group placed on the target's node (custom resource `bench_a`) or on node B (`bench_b`).
The difference is what a step pays for its proposal and its result crossing nodes. Medians after warm-up; rounds
interleave the variants so background load falls on all alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, save_json  # noqa: E402
from router_overhead import add_step_options, decode_plan, time_steps, tiny_pair, worker_pythonpath  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from serving.workers.node_placement import executor_nodes  # noqa: E402
from serving.workers.ray_executor import RayExecutor  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_options(ap, batch_sizes=[1, 8], steps=200, warmup=20, rounds=4, json_name="cross_node_step.json")
    args = ap.parse_args()

    torch.set_num_threads(1)
    target, draft, config = tiny_pair(args.vocab, torch.device("cpu"), max(args.batch_sizes))
    env_vars = {"PYTHONPATH": worker_pythonpath(), "OMP_NUM_THREADS": "1"}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=6, resources={"bench_a": 6})
    cluster.add_node(num_cpus=2, resources={"bench_b": 2})
    ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": env_vars})
    rows = []
    try:
        executors: dict[tuple[str, bool], RayExecutor] = {}
        for where, res in (("same_node", "bench_a"), ("cross_node", "bench_b")):
            for compiled in (True, False):
                executors[(where, compiled)] = RayExecutor(
                    target, config, draft, rejection_sampling="probabilistic", use_compiled_graph=compiled,
                    target_resources={"bench_a": 1}, draft_resources={res: 1}, draft_placement="separate")
        for key, ex in executors.items():
            where = executor_nodes(ex)
            same = where["target"] == where["draft"]
            assert same == (key[0] == "same_node"), (key, where)
        ex0 = next(iter(executors.values()))
        plans = {bs: decode_plan(bs, args.k, len(ex0.target_kv_groups), len(ex0.draft_kv_groups or []), 16,
                                 args.vocab) for bs in args.batch_sizes}
        samples = time_steps(executors, plans, args.warmup, args.rounds, args.steps)
        for ex in executors.values():
            ex.shutdown()
        for bs in args.batch_sizes:
            for compiled in (True, False):
                same = statistics.median(samples[(("same_node", compiled), bs)]) * 1e3
                cross = statistics.median(samples[(("cross_node", compiled), bs)]) * 1e3
                rows.append({"calls": "compiled" if compiled else "plain", "k": args.k, "batch": bs,
                             "same_node_ms": same, "cross_node_ms": cross, "added_ms": cross - same})
                print(rows[-1], flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    env = environment() | {"vocab": args.vocab, "steps": args.steps, "nodes": "3 local raylets"}
    save_json(args.save_json, {"environment": env, "rows": rows})
    print(f"\n{env}\n")
    print(markdown_table(rows, ["calls", "k", "batch", "same_node_ms", "cross_node_ms", "added_ms"]))


if __name__ == "__main__":
    main()
