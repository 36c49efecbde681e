"""The `specserve` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, NoReturn

from deploy import options
from deploy.bench.cli import add_bench_parser
from deploy.distill_cli import _add_distill_parser
from deploy.serve_options import DEFAULT_MODEL
from engine.config import option_default

if TYPE_CHECKING:
    from deploy.config import ServeConfig


class _Parser(argparse.ArgumentParser):
    """Errors in one line naming the flag (argparse's usage block buries it), and no abbreviated flags (a typo
    must not quietly match another flag)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# `specserve generate` shares the engine's and the speculation's options, without the serving-layer ones.
_GENERATE_SKIP = ("engine_kwargs", "engine_builder", "draft_placement")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from deploy.serve_options import EngineOptions, SpeculationOptions

    options.add_flags(p, EngineOptions, suppress=False, skip=_GENERATE_SKIP, title="engine")
    options.add_flags(p, SpeculationOptions, suppress=False, skip=_GENERATE_SKIP, title="speculation")
    _add_speculative_config(p)
    # Offline, a draft is used only when named (the engine's default; served, "auto" picks the bundled one).
    p.set_defaults(draft_model=option_default("draft_model"))


def _add_speculative_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", default=argparse.SUPPRESS, metavar="JSON",
                   help="vLLM's form of the speculation options: '{\"model\": DRAFT, \"num_speculative_tokens\": 4, "
                        "\"method\": \"draft_model\", \"draft_tensor_parallel_size\": 1}' (other speculation "
                        "fields by their names)")


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The options on the command line: the namespace less the subcommand's own entries, the positional model
    folded into `model`."""
    given = {k: v for k, v in vars(args).items()
             if k not in ("command", "func", "verbose", "config", "model_tag", "prompt", "chat", "max_tokens",
                          "temperature", "top_p", "top_k", "sample_seed", "stop", "ignore_eos", "json")}
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if "model" in given and given["model"] != tag:
            raise ValueError(f"two models given: {tag!r} (positional) and --model {given['model']!r}")
        given["model"] = tag
    return given


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    prompts = list(args.prompt or [])
    if not prompts:
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("specserve generate: give --prompt TEXT (repeatable) or prompts on stdin", file=sys.stderr)
        return 2
    from deploy.config import ServeConfig

    cfg = ServeConfig.from_dict(_given(args))
    cfg.validate()
    llm = LLM(**cfg.engine_args())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos)
    if args.chat:
        t0 = time.perf_counter()
        outs = [llm.chat([{"role": "user", "content": p}], params) for p in prompts]
    else:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt": p, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                              "spec_decode": {"num_drafts": o.spec.num_drafts,
                                              "num_draft_tokens": o.spec.num_draft_tokens,
                                              "num_accepted_tokens": o.spec.num_accepted_tokens,
                                              "accepted_per_position": o.spec.accepted_per_position}}))
        else:
            print(f"--- {p!r}\n{o.text}\n[finish_reason={o.finish_reason}, {len(o.token_ids)} tokens]")
    n = sum(len(o.token_ids) for o in outs)
    stats = llm.spec_stats(outs)
    extra = ""
    if cfg.draft_model:
        extra = f", acceptance rate {stats.acceptance_rate:.2f}, acceptance length {stats.acceptance_length:.2f}"
    print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s){extra}", file=sys.stderr)
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """A flag per ServeConfig field (deploy/serve_options.py), each defaulting to "not given" (SUPPRESS) so that a
    --config file's values hold unless a flag overrides them; the model also as vLLM's positional argument."""
    from deploy.serve_options import EngineOptions, ServingOptions, SpeculationOptions

    p.add_argument("model_tag", nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
                   help=f"the model to serve, as `vllm serve MODEL` takes it (or --model; default {DEFAULT_MODEL})")
    p.add_argument("--config", default=None, metavar="FILE", help="YAML file of ServeConfig fields (flags override)")
    options.add_flags(p, EngineOptions, title="engine")
    options.add_flags(p, SpeculationOptions, title="speculation")
    _add_speculative_config(p)
    options.add_flags(p, ServingOptions, title="serving")


def _local_cpus(cfg: ServeConfig) -> int:
    """Logical CPUs the app reserves at its largest: the ingress replicas, and per engine replica its router and
    one per model rank (the default bundles)."""
    from deploy.app import default_device

    ranks = cfg.tensor_parallel_size + (cfg.draft_tensor_parallel_size if cfg.resolved_draft() else 0)
    ingress = 0 if cfg.direct_streaming else cfg.resolved_ingress_replicas(cfg.device or default_device())
    return ingress + cfg.max_engine_replicas() * (1 + ranks)


def _serve(args: argparse.Namespace) -> int:
    from deploy.config import load_config

    cfg = load_config(args.config, _given(args))
    # Everything that can fail before Ray starts fails here, in seconds, with one line naming the cause (Ray and
    # Serve are imported after it: that alone takes seconds).
    device = cfg.device
    if device is None and not os.environ.get("RAY_ADDRESS"):
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"  # a local cluster: this machine's devices
    cfg.preflight(device or "cpu")  # joining a cluster: the models are checked here, the devices by the cluster
    if device is not None and not device.startswith("cuda"):
        for note in cfg.cpu_notes():
            print(f"specserve: {note}", file=sys.stderr, flush=True)

    import ray
    from ray import serve

    from deploy.app import apply_local_cluster_env, build_app_from_config
    from serving.grpc_service import SERVICER_FUNCTION
    from serving.serve_process_env import HAPROXY_ENV

    app = build_app_from_config(cfg)
    proxy = None
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])  # join the cluster (KubeRay head, `ray start`)
    else:
        # Serve's replicas run user code and their request router on their own event loop, and HAProxy or Serve's
        # proxy takes the connections (serving/serve_process_env.py); the local cluster's processes inherit this
        # environment.
        proxy = "HAProxy" if apply_local_cluster_env(cfg).get(HAPROXY_ENV) == "1" else "Serve"
        # A local cluster for this process, with a logical CPU for each HTTP/gRPC replica, and for each engine
        # replica's router and model ranks: each reserves one, and on a small box they would otherwise wait forever
        # for each other; they are single-threaded and mostly idle, so oversubscribing the cores is harmless.
        # address="local": a cluster of its own even where a run that crashed left Ray's current-cluster file
        # behind, which ray.init() without an address would try to join (and fail: "When connecting to an existing
        # cluster, num_cpus and num_gpus must not be provided").
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, _local_cpus(cfg)), include_dashboard=False,
                 logging_level=logging.INFO if args.verbose else logging.WARNING)
    # The handler only appends to a list: a threading.Event set from a handler deadlocks when a second signal (a
    # second Ctrl-C, a supervisor's SIGTERM after SIGINT) lands while the first handler holds the Event's lock.
    signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: signals.append(signum))
    try:
        # Serve's INFO lines (each replica added, each call) drown what matters: warnings and errors stay, and the
        # replicas' own summary lines; -v brings them back.
        serve_logs = {"log_level": "INFO" if args.verbose else "WARNING"}
        if not args.verbose:
            logging.getLogger("ray.serve").setLevel(logging.WARNING)
        serve.start(http_options={"host": cfg.host, "port": cfg.port},
                    grpc_options={"port": cfg.grpc_port, "grpc_servicer_functions": [SERVICER_FUNCTION]},
                    logging_config=serve_logs)
        serve.run(app, name="specserve", route_prefix="/", logging_config=serve_logs)
        host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
        print(f"specserve: serving {cfg.served_model_name or cfg.model}\n"
              f"  OpenAI HTTP  http://{host}:{cfg.port}/v1\n"
              f"  gRPC         {host}:{cfg.grpc_port} (specserve.v1.Generation)\n"
              f"  metrics      http://{host}:{cfg.port}/metrics\n"
              + (f"  HTTP proxy   {proxy}\n" if proxy else "") +
              "Ctrl-C to stop.", flush=True)
        while not signals:
            time.sleep(0.2)
        print(f"specserve: shutting down: new requests get 503, waiting up to {cfg.drain_timeout_s:g} s for "
              "the requests in flight", file=sys.stderr, flush=True)
        from serving.app import drain

        try:
            drain(cfg.drain_timeout_s)
        except Exception as e:  # noqa: BLE001 - shut down anyway
            print(f"specserve: draining failed: {e}", file=sys.stderr, flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specserve", description="LLM serving with speculative decoding")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline, in this process (no Ray)")
    _add_model_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable); default: one per stdin line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="serve over OpenAI-compatible HTTP and gRPC on Ray Serve")
    _add_serve_args(srv)
    srv.set_defaults(func=_serve)
    _add_distill_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
