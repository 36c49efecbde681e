"""The `specserve` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

from deploy.bench.cli import add_bench_parser
from deploy.distill_cli import _add_distill_parser
from serving.engine_builders import DRAFT_PLACEMENTS

if TYPE_CHECKING:
    from deploy.config import ServeConfig

DEFAULT_MODEL = "smollm2-135m-instruct"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="bundled name, HF directory or .gguf path")
    p.add_argument("--draft-model", default=None, help="draft for speculative decoding (same forms); none = off")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--rejection-sampling", default="probabilistic", choices=["strict", "probabilistic", "synthetic"])
    p.add_argument("--synthetic-acceptance-rate", type=float, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--draft-tensor-parallel-size", type=int, default=1)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes computed before (default on)")


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    prompts = list(args.prompt or [])
    if not prompts:
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("specserve generate: give --prompt TEXT (repeatable) or prompts on stdin", file=sys.stderr)
        return 2
    llm = LLM(model=args.model, draft_model=args.draft_model, num_speculative_tokens=args.num_speculative_tokens,
              rejection_sampling=args.rejection_sampling, synthetic_acceptance_rate=args.synthetic_acceptance_rate,
              tensor_parallel_size=args.tensor_parallel_size,
              draft_tensor_parallel_size=args.draft_tensor_parallel_size, device=args.device, dtype=args.dtype,
              max_model_len=args.max_model_len, seed=args.seed, enable_prefix_caching=args.enable_prefix_caching)
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
    if args.draft_model:
        extra = f", acceptance rate {stats.acceptance_rate:.2f}, acceptance length {stats.acceptance_length:.2f}"
    print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s){extra}", file=sys.stderr)
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """Flags default to "not given" (SUPPRESS), so a --config file's values hold unless a flag overrides them.
    Defaults and meanings are deploy.config.ServeConfig's."""
    s = argparse.SUPPRESS
    p.add_argument("--config", default=None, metavar="FILE", help="YAML file of ServeConfig fields (flags override)")
    p.add_argument("--model", default=s, help=f"bundled name, HF directory or .gguf path (default {DEFAULT_MODEL})")
    p.add_argument("--draft-model", default=s,
                   help="draft for speculative decoding; 'none' = off; default 'auto': the bundled draft of the "
                        "default model when installed")
    p.add_argument("--num-speculative-tokens", type=int, default=s, help="draft tokens per step, k (default 4)")
    p.add_argument("--rejection-sampling", default=s, choices=["strict", "probabilistic", "synthetic"])
    p.add_argument("--synthetic-acceptance-rate", type=float, default=s)
    p.add_argument("--draft-length-schedule", default=s, metavar="B:K,...",
                   help="load-adaptive speculation: draft length K for steps of up to B requests, e.g. 4:4,16:2 "
                        "(default: --num-speculative-tokens at every batch size)")
    p.add_argument("--spec-disable-above-batch-size", default=s, metavar="N",
                   help="no speculation for steps of more than N requests (default 32; none = never off)")
    p.add_argument("--tensor-parallel-size", type=int, default=s)
    p.add_argument("--draft-tensor-parallel-size", type=int, default=s)
    p.add_argument("--draft-placement", default=s, choices=list(DRAFT_PLACEMENTS),
                   help="separate: the draft's ranks are actors of their own; colocated: inside the target's ranks, "
                        "on their GPUs; auto (default): colocated where the draft could only share the target's GPUs")
    p.add_argument("--max-model-len", type=int, default=s)
    p.add_argument("--device", default=s, help="cpu or cuda (default: cuda when the cluster has GPUs)")
    p.add_argument("--dtype", default=s)
    p.add_argument("--seed", type=int, default=s)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=s,
                   help="reuse the KV of prompt prefixes (full blocks) computed before, in the target's and the "
                        "draft's caches (default on)")
    p.add_argument("--served-model-name", default=s, help="model name clients send (default: --model)")
    p.add_argument("--generation-config", choices=["auto", "vllm"], default=s,
                   help="auto: the model's generation_config.json gives defaults of unset sampling fields (default);"
                        " vllm: OpenAI's defaults")
    p.add_argument("--host", default=s, help="HTTP bind address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=s, help="HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=s, help="gRPC port (default 9000)")
    p.add_argument("--num-replicas", type=int, default=s,
                   help="engine replicas: each a router with its own target and draft worker groups (default 1)")
    p.add_argument("--autoscaling-config", default=s, metavar="YAML",
                   help="scale engine replicas on load instead, e.g. '{min_replicas: 1, max_replicas: 4, "
                        "target_ongoing_requests: 32}' (Serve's autoscaling_config; replaces --num-replicas)")
    p.add_argument("--max-ongoing-requests", type=int, default=s,
                   help="requests one engine replica holds before Serve queues in front of it (default 128)")
    p.add_argument("--ingress-replicas", default=s, metavar="N|auto",
                   help="HTTP/gRPC replicas (default auto: two per engine replica on GPUs, one on CPU)")
    p.add_argument("--http-proxy", default=s, choices=["auto", "haproxy", "serve"],
                   help="what takes client connections on a local cluster: HAProxy, forwarding each to an ingress "
                        "replica, or Serve's Python proxy (default auto: HAProxy for GPU engines when --host is "
                        "every interface and HAProxy is installed)")
    p.add_argument("--direct-streaming", action="store_true", default=s,
                   help="the engine replicas answer HTTP and gRPC themselves: no ingress replicas, no handle hop "
                        "between them and the engine (the HTTP proxy picks the replica: no prefix affinity)")
    p.add_argument("--request-router", default=s, choices=["power_of_two", "prefix_aware"],
                   help="how a request picks its engine replica: the shorter of two random queues (default), or "
                        "the replica that served its longest prompt prefix")
    p.add_argument("--api-key", default=s,
                   help="require 'Authorization: Bearer KEY' (gRPC: metadata authorization) on every request; "
                        "default: $SPECSERVE_API_KEY if set, else no key")
    p.add_argument("--auth-health-metrics", action="store_true", default=s,
                   help="require the API key on /health and /metrics too (open by default, for probes)")
    p.add_argument("--max-request-body-bytes", type=_int_or_none, default=s,
                   help="larger HTTP request bodies get 413 (default 4194304; none = no limit)")
    p.add_argument("--max-queued-requests", type=_int_or_none, default=s,
                   help="requests that may wait for a batch slot; more get 429 + Retry-After (default 256)")
    p.add_argument("--continue-without-draft", action="store_true", default=s,
                   help="if the draft's workers die, keep serving without speculation while they restart")
    p.add_argument("--drain-timeout-s", type=float, default=s,
                   help="on shutdown, seconds the requests in flight may take to finish (default 30)")
    p.add_argument("--enable-auto-tool-choice", action="store_true", default=s,
                   help="serve tool_choice 'auto' (the default with tools): the model may call or answer")
    p.add_argument("--tool-call-parser", default=s, choices=["hermes", "llama3_json", "mistral", "pythonic"],
                   help="the model family's call markup, forced and parsed (default hermes: Qwen, SmolLM)")
    p.add_argument("--chat-template", default=s, help="Jinja chat template (file path or inline) for chat")
    p.add_argument("--reasoning-parser", default=s, choices=["qwen3", "deepseek_r1"],
                   help="<think>...</think> as reasoning_content apart from content")


def _local_cpus(cfg: ServeConfig) -> int:
    """Logical CPUs the app reserves at its largest: the ingress replicas, and per engine replica its router and
    one per model rank (the default bundles)."""
    from deploy.app import default_device

    ranks = cfg.tensor_parallel_size + (cfg.draft_tensor_parallel_size if cfg.resolved_draft() else 0)
    ingress = 0 if cfg.direct_streaming else cfg.resolved_ingress_replicas(cfg.device or default_device())
    return ingress + cfg.max_engine_replicas() * (1 + ranks)


def _int_or_none(value: str) -> int | None:
    return None if value.strip().lower() in ("none", "null", "") else int(value)


def _serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from deploy.app import apply_local_cluster_env, build_app_from_config
    from deploy.config import load_config
    from serving.grpc_service import SERVICER_FUNCTION
    from serving.serve_process_env import HAPROXY_ENV

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func", "verbose", "config")}
    cfg = load_config(args.config, flags)
    app = build_app_from_config(cfg)  # validates the config before Ray starts
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
        ray.init(num_cpus=max(os.cpu_count() or 1, _local_cpus(cfg)), include_dashboard=False)
    # The handler only appends to a list: a threading.Event set from a handler deadlocks when a second signal (a
    # second Ctrl-C, a supervisor's SIGTERM after SIGINT) lands while the first handler holds the Event's lock.
    signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: signals.append(signum))
    try:
        serve.start(http_options={"host": cfg.host, "port": cfg.port},
                    grpc_options={"port": cfg.grpc_port, "grpc_servicer_functions": [SERVICER_FUNCTION]})
        serve.run(app, name="specserve", route_prefix="/")
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
    parser = argparse.ArgumentParser(prog="specserve", description="LLM serving with speculative decoding")
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
