"""Per-step dispatch overhead of the Ray executor: Ray Compiled Graph vs plain actor calls vs in process.

    python benchmarks/router_overhead.py [--device cpu|cuda] [--batch-sizes 1 16] [--k 4] [--vocab 128]
                                         [--target-tp 1] [--draft-tp 1] [--steps 300] [--save-json out.json]

The same decode StepPlan (every request at the same position, so the KV writes overwrite themselves) runs
many times through LocalExecutor (target and draft in this process), RayExecutor with a compiled graph, and
RayExecutor with plain `.remote()` calls; a tiny random model keeps the models' own work small, so the
differences are the dispatch: plan serialization, channels or RPCs, the proposal's trip from the draft to the
target, the result's trip back. Two raw Ray figures (one actor call; a two-hop compiled graph of no-op
methods) anchor the table to the figures in benchmarks/RESULTS.md. Medians after warm-up; the table prints last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import TypeVar

import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, save_json, save_random_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import ray  # noqa: E402

from engine.config import EngineConfig, resolve_dtype  # noqa: E402
from engine.local_executor import LocalExecutor  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.runner.model_runner import ModelRunner  # noqa: E402
from engine.step.plan import PlannedRequest, StepPlan, StepResult  # noqa: E402
from serving.workers.ray_executor import RayExecutor  # noqa: E402

K = TypeVar("K", bound=Hashable)  # what names an executor in a comparison
MAX_MODEL_LEN = 256
POSITION = 40  # each request's decode position: a few blocks of (zero) KV behind it


def tiny_model(path: Path, vocab: int, layers: int, seed: int) -> str:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_MODEL_LEN,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return save_random_model(cfg, path, seed)


def tiny_pair(vocab: int, device: torch.device, max_num_seqs: int) -> tuple[str, str, EngineConfig]:
    """A 2-layer target and a 1-layer draft (tiny_model's, in a temporary folder) and the engine config they run
    with."""
    tmp = Path(tempfile.mkdtemp())
    target = tiny_model(tmp / "target", vocab, layers=2, seed=0)
    draft = tiny_model(tmp / "draft", vocab, layers=1, seed=1)
    config = EngineConfig(device=device, dtype=resolve_dtype(None, device), max_model_len=MAX_MODEL_LEN,
                          block_size=16, max_num_seqs=max_num_seqs)
    return target, draft, config


def worker_pythonpath() -> str:
    """PYTHONPATH for the Ray workers: this checkout first, then the driver's own entries."""
    return os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def time_steps(executors: Mapping[K, LocalExecutor | RayExecutor], plans: dict[int, StepPlan], warmup: int, rounds: int,
               steps: int, on_result: Callable[[K, int, StepResult], None] | None = None
               ) -> dict[tuple[K, int], list[float]]:
    """Seconds of each step of each executor (by its key) at each batch size: `warmup` steps of every plan first,
    then `rounds` rounds of steps // rounds steps each. Rounds interleave the variants, so drifting background load
    (Ray's own processes on a small CPU box) falls on all of them alike. on_result sees each timed step's result."""
    for ex in executors.values():
        for plan in plans.values():
            for _ in range(warmup):
                ex.execute(plan)
    samples: dict[tuple[K, int], list[float]] = {}
    for _ in range(rounds):
        for bs, plan in plans.items():
            for key, ex in executors.items():
                for _ in range(steps // rounds):
                    t0 = time.perf_counter()
                    result = ex.execute(plan)  # host values back: the step's device work is finished
                    samples.setdefault((key, bs), []).append(time.perf_counter() - t0)
                    if on_result is not None:
                        on_result(key, bs, result)
    return samples


def add_step_options(ap: argparse.ArgumentParser, batch_sizes: list[int], steps: int, warmup: int, rounds: int,
                     json_name: str) -> None:
    """The options this benchmark and cross_node_step.py share: the decode step timed (batch sizes, k, vocabulary),
    how long, and where the JSON goes (default: $OUT/json_name where OUT is set)."""
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=batch_sizes)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=128, help="49152 shows the cost of shipping draft probabilities")
    for flag, default in (("--steps", steps), ("--warmup", warmup), ("--rounds", rounds)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--save-json", default=os.environ.get("OUT") and os.path.join(os.environ["OUT"], json_name))


def decode_plan(batch: int, k: int, num_target_groups: int, num_draft_groups: int, block_size: int,
                vocab: int) -> StepPlan:
    """One decode step per request (speculating k tokens if k > 0), each request on its own blocks."""
    per_req = -(-(POSITION + k + 2) // block_size)
    reqs = []
    for i in range(batch):
        blocks = list(range(i * per_req, (i + 1) * per_req))
        tok = 3 + (7 * i) % (vocab - 3)
        reqs.append(PlannedRequest(
            request_id=f"r{i}", token_ids=[tok], start_pos=POSITION, num_draft_tokens=k, sample=True,
            block_tables=[blocks] * num_target_groups, draft_token_ids=[tok] if k else [],
            draft_start_pos=POSITION, draft_block_tables=[blocks] * num_draft_groups))
    return StepPlan(0, reqs, "probabilistic" if k else None)


def median_ms(fn: Callable[[], object], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()  # every executor returns host values: the step's device work is finished here
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def raw_ray_figures(steps: int, warmup: int) -> dict[str, float]:
    from ray.dag import InputNode, MultiOutputNode

    @ray.remote(num_cpus=0)
    class Echo:
        def f(self, x: object) -> object:
            return x

    a, b = Echo.remote(), Echo.remote()
    out = {"actor_call_ms": median_ms(lambda: ray.get(a.f.remote(1)), steps, warmup)}
    with InputNode() as inp:
        dag = MultiOutputNode([b.f.bind(a.f.bind(inp))])
    graph = dag.experimental_compile()
    out["compiled_graph_2hop_ms"] = median_ms(lambda: ray.get(graph.execute(1)), steps, warmup)
    graph.teardown()
    for h in (a, b):
        ray.kill(h)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--target-tp", type=int, default=1)
    ap.add_argument("--draft-tp", type=int, default=1)
    add_step_options(ap, batch_sizes=[1, 16], steps=300, warmup=30, rounds=5, json_name="router_overhead.json")
    args = ap.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)  # the workers run one thread each; the in-process baseline does too
    target, draft, config = tiny_pair(args.vocab, device, max(args.batch_sizes))
    ray.init(num_cpus=max(4, 2 * (args.target_tp + args.draft_tp)), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": worker_pythonpath()}})
    raw = raw_ray_figures(args.steps, args.warmup)
    print(raw, flush=True)

    rows = []
    for k in (0, args.k):
        draft_path = draft if k else None
        cfgs = {name: ModelConfig.from_path(p) for name, p in (("target", target), ("draft", draft_path)) if p}
        for c in cfgs.values():
            c.max_model_len = MAX_MODEL_LEN
        local = LocalExecutor(ModelRunner(cfgs["target"], config, "target"),
                              ModelRunner(cfgs["draft"], config, "draft") if k else None, keep_draft_probs=True,
                              seed=0)
        plans = {bs: decode_plan(bs, k, len(local.target_kv_groups), len(local.draft_kv_groups or []), 16,
                                 args.vocab) for bs in args.batch_sizes}
        executors: dict[str, LocalExecutor | RayExecutor] = {"local": local}
        for compiled in (True, False):
            executors["compiled" if compiled else "plain"] = RayExecutor(
                target, config, draft_path, rejection_sampling="probabilistic" if k else None,
                tensor_parallel_size=args.target_tp, draft_tensor_parallel_size=args.draft_tp,
                use_compiled_graph=compiled)
        dispatch: dict[int, list[float]] = {}

        def record_dispatch(name: str, bs: int, result: StepResult, dispatch: dict[int, list[float]] = dispatch
                            ) -> None:  # this k's dispatch, bound here
            if name == "compiled":
                dispatch.setdefault(bs, []).append(result.phase_seconds["dispatch"])

        try:
            samples = time_steps(executors, plans, args.warmup, args.rounds, args.steps, record_dispatch)
        finally:
            for ex in executors.values():
                if isinstance(ex, RayExecutor):
                    ex.shutdown()
        timings = {name: {bs: statistics.median(samples[(name, bs)]) * 1e3 for bs in plans} for name in executors}
        phases = {bs: {"dispatch": statistics.median(d) * 1e3} for bs, d in dispatch.items()}
        for bs in args.batch_sizes:
            loc, cg, pl = timings["local"][bs], timings["compiled"][bs], timings["plain"][bs]
            rows.append({"k": k, "batch": bs, "target_tp": args.target_tp, "draft_tp": args.draft_tp if k else None,
                         "local_ms": loc, "compiled_ms": cg, "plain_ms": pl, "compiled_overhead_ms": cg - loc,
                         "plain_overhead_ms": pl - loc, "compiled_dispatch_ms": phases[bs].get("dispatch")})
            print(rows[-1], flush=True)
    ray.shutdown()

    env = environment() | {"vocab": args.vocab, "steps": args.steps}
    save_json(args.save_json, {"environment": env, "raw_ray": raw, "rows": rows})
    print(f"\n{env}\nraw Ray: one actor call {raw['actor_call_ms']:.3f} ms, two-hop compiled graph "
          f"{raw['compiled_graph_2hop_ms']:.3f} ms (medians)\n")
    print(markdown_table(rows, ["k", "batch", "target_tp", "draft_tp", "local_ms", "compiled_ms", "plain_ms",
                                "compiled_overhead_ms", "plain_overhead_ms", "compiled_dispatch_ms"]))


if __name__ == "__main__":
    main()
