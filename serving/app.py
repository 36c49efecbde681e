"""The Ray Serve application: an ingress deployment (HTTP + gRPC) in front of a deployment of engine replicas.

As in Ray Serve LLM, the ingress is a thin shim: its replicas tokenize, apply the chat template and format
OpenAI/gRPC responses, and send each request through a DeploymentHandle to one engine replica
(serving/engine_deployment.py: a router with its own target and draft worker groups). `num_replicas` and
`autoscaling_config` scale the engine replicas; `ingress_replicas` the shims. Serve's request router picks the
engine replica of each request (serving/router/replica_router.py): among the replicas that take requests, power of two
choices on queue length by default, or prefix affinity with `request_router: prefix_aware`. With
`direct_streaming` the engine deployment is the ingress itself (serving/engine_ingress.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from engine.gc_heap import freeze_startup_heap
from serving.engine_builders import DEFAULT_ENGINE_BUILDER, LOCAL_ENGINE_BUILDER
from serving.engine_deployment import ENGINE_DEPLOYMENT, EngineReplica
from serving.front_end import FrontEnd, tokenizer_source
from serving.serving_defaults import DRAIN_TIMEOUT_S, TENANT_TIMEOUT_S

if TYPE_CHECKING:
    from deploy.serve_options import ServingOptions

logger = logging.getLogger("specserve")

DEPLOYMENT_NAME = "SpecServe"  # the ingress
# request_router values -> whether the engine replicas' request router uses prefix affinity.
REQUEST_ROUTERS = {"power_of_two": False, "prefix_aware": True}
REQUEST_ROUTER_CLASS = "serving.router.replica_router:EngineRequestRouter"
# How often each engine replica's routing stats (whether it takes requests) reach the request routers.
ROUTING_STATS_PERIOD_S = 2.0


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress()  # the FastAPI app is built per replica by __serve_build_asgi_app__, around its RouterClient
class SpecServe:
    async def __init__(self, engine: Any, model: str, served_model_name: str | None = None,
                       security: dict[str, Any] | None = None, generation_config: str = "auto",
                       tokenizer: dict[str, Any] | None = None, chat: dict[str, Any] | None = None,
                       draft_pool: Any = None) -> None:
        """engine: a DeploymentHandle of the engine replicas; draft_pool: one of the draft pool's replicas
        (serving/draft_pool/pool.py), for /health, or None; the rest: serving.front_end.FrontEnd's."""
        info = await engine.info.remote()
        self.front = FrontEnd(engine, model, served_model_name, info["max_model_len"], security, generation_config,
                              tokenizer, chat)
        self.front.client.draft_pool = draft_pool
        self.gc_frozen = freeze_startup_heap(f"ingress of {served_model_name or model}")  # tokenizer loaded

    def __serve_build_asgi_app__(self) -> Any:
        return self.front.asgi_app()

    async def Generate(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802 - the RPC's name
        async for response in self.front.grpc_generate(request, grpc_context):
            yield response


def router_actor_options(engine_args: dict[str, Any], engine_builder: str,
                         overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Resources of the router. An in-process engine on GPU needs the GPU in the router itself; with the Ray
    executor the router only plans steps and the worker actors hold the GPUs."""
    opts: dict[str, Any] = {"num_cpus": 1}
    in_process = engine_builder == LOCAL_ENGINE_BUILDER
    if in_process and str(engine_args.get("device") or "").startswith("cuda"):
        opts["num_gpus"] = 1
    opts.update(overrides or {})
    return opts


def build_application(engine_args: dict[str, Any], options: ServingOptions, *,
                      engine_builder: str = DEFAULT_ENGINE_BUILDER, ingress_replicas: int = 1) -> serve.Application:
    """The bound application. `engine_args` are LLM's keyword arguments (model, draft_model, ...), what the engine
    builder takes; `options` the serving layer's (deploy.config.ServeConfig is one), with `ingress_replicas`
    resolved from its "auto". With `direct_streaming` the engine replicas are the ingress (serving/
    engine_ingress.py) and `ingress_replicas`, `ray_actor_options` and the request router do not apply."""
    if options.request_router not in REQUEST_ROUTERS:
        raise ValueError(f"request_router must be one of {sorted(REQUEST_ROUTERS)}, got {options.request_router!r}")
    if options.direct_streaming and REQUEST_ROUTERS[options.request_router]:
        raise ValueError("direct_streaming: the HTTP proxy picks each request's engine replica, so request_router "
                         f"{options.request_router!r} (prefix affinity) cannot apply; use power_of_two")
    model = engine_args["model"]
    # The ingress holds every request for its whole stream: room for what all engine replicas can hold.
    max_engines = int((options.autoscaling_config or {}).get("max_replicas") or
                      (options.num_replicas if isinstance(options.num_replicas, int) else 1))
    draft_pool, continue_without_draft = None, options.continue_without_draft
    if options.uses_draft_pool():
        if options.direct_streaming:
            raise ValueError("draft_replicas: the draft pool is served behind the ingress replicas; direct_streaming "
                             "cannot apply")
        draft_pool, engine_args = _draft_pool(engine_args, options, max_engines)
        continue_without_draft = True  # a draft replica that dies takes speculation, never requests, with it
    engine_options: dict[str, Any] = {
        "ray_actor_options": router_actor_options(engine_args, engine_builder, options.router_actor_options),
        # Scale-down: Serve waits this long for a replica's requests in flight before stopping it.
        "graceful_shutdown_timeout_s": options.drain_timeout_s}
    if options.autoscaling_config:
        engine_options["autoscaling_config"] = options.autoscaling_config  # Serve rejects it with num_replicas
    elif options.num_replicas is not None:
        engine_options["num_replicas"] = options.num_replicas
    if options.max_ongoing_requests is not None:
        engine_options["max_ongoing_requests"] = options.max_ongoing_requests
    if options.max_queued_requests is not None:
        # Serve's own queue in front of the engine replicas (requests not yet handed to one) is bounded too, so
        # that neither queue grows without limit under overload (past it the ingress answers 429). A replica has
        # room for max_ongoing_requests before Serve queues in front of it, and the router bounds its own waiting
        # queue (429 past max_queued_requests).
        engine_options["max_queued_requests"] = options.max_queued_requests
    from serving.router.replica_router import check_router_kwargs

    affinity = REQUEST_ROUTERS[options.request_router]
    kwargs = check_router_kwargs({**(options.request_router_kwargs or {}), "prefix_affinity": affinity})
    if affinity:
        engine_options["request_router_config"] = RequestRouterConfig(
            request_router_class=REQUEST_ROUTER_CLASS, request_router_kwargs=kwargs,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    name = options.served_model_name or model
    security = {"api_key": options.api_key, "max_request_body_bytes": options.max_request_body_bytes,
                "auth_health_metrics": options.auth_health_metrics}
    stream_interval = float(options.stream_interval_ms)
    if options.direct_streaming:
        from serving.engine_ingress import EngineIngressReplica

        return EngineIngressReplica.options(**engine_options).bind(
            engine_args, engine_builder, name, options.max_queued_requests, options.continue_without_draft, security,
            options.generation_config, options.chat_options(), stream_interval)
    engine = EngineReplica.options(**engine_options).bind(
        engine_args, engine_builder, name, options.max_queued_requests, continue_without_draft, stream_interval)

    per_engine = options.max_ongoing_requests or 100
    ingress_options: dict[str, Any] = {"ray_actor_options": options.ray_actor_options or {"num_cpus": 1},
                                       "num_replicas": ingress_replicas,
                                       "max_ongoing_requests": -(-per_engine * max_engines // ingress_replicas)}
    if options.max_queued_requests is not None:
        # Serve's proxy queue in front of the ingress: past it the proxy answers 503. Sized past what reaches
        # the engines, so that a burst reaches them and gets the engines' own 429 instead.
        ingress_options["max_queued_requests"] = options.max_queued_requests + per_engine * max_engines
    return SpecServe.options(**ingress_options).bind(engine, model, options.served_model_name, security,
                                                     options.generation_config, tokenizer_source(engine_args),
                                                     options.chat_options(), draft_pool)


def _draft_pool(engine_args: dict[str, Any], options: ServingOptions,
                max_engines: int) -> tuple[Any, dict[str, Any]]:
    """The draft pool's deployment (serving/draft_pool/pool.py) and the engine replicas' arguments that attach them
    to it: `draft_replicas` replicas, or as many as `draft_autoscaling_config` asks for
    (serving/draft_pool/autoscaling.py), each with room for its share of the engine replicas at their largest when
    the pool is at its smallest."""
    import uuid

    from serving.draft_pool.autoscaling import draft_autoscaling_config, min_draft_replicas
    from serving.draft_pool.pool import DraftPoolReplica, slots_per_draft

    if engine_args.get("draft_model") is None:
        raise ValueError("draft_replicas shares draft models between engine replicas: give a draft_model")
    pool = uuid.uuid4().hex[:12]
    drain_s = float(getattr(options, "drain_timeout_s", DRAIN_TIMEOUT_S))
    # The replica only supervises its group: the draft's ranks hold the resources (draft_resources).
    # Its health check only pings the ranks: checked often, a dead group is replaced (and its targets speculate
    # again) sooner. On scale-down it waits for its targets to move (up to drain_timeout_s) before Serve ends it.
    pool_options: dict[str, Any] = {"health_check_period_s": 3.0, "ray_actor_options": {"num_cpus": 0},
                                    "graceful_shutdown_timeout_s": drain_s + 15.0}
    scaling = getattr(options, "draft_autoscaling_config", None)
    if scaling:
        pool_options["autoscaling_config"] = draft_autoscaling_config(scaling)
        slots = slots_per_draft(max_engines, min_draft_replicas(pool_options["autoscaling_config"]))
    else:
        pool_options["num_replicas"] = int(options.draft_replicas)
        slots = slots_per_draft(max_engines, int(options.draft_replicas))
    deployment = DraftPoolReplica.options(**pool_options).bind(
        engine_args, pool, slots, float(getattr(options, "draft_tenant_timeout_s", TENANT_TIMEOUT_S)), drain_s)
    return deployment, {**engine_args, "draft_pool": pool}


def drain(timeout_s: float = DRAIN_TIMEOUT_S, app_name: str = "specserve") -> list[dict[str, Any]]:
    """Graceful shutdown, first half: every engine replica of the application refuses new requests (503) and
    waits up to `timeout_s` for the requests in flight to finish. Call it before serve.shutdown(); returns each
    replica's report."""
    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name)
    return handle.broadcast("drain", timeout_s).results(timeout_s=timeout_s + 30.0)
