"""The Ray Serve application: one ingress deployment (HTTP + gRPC) in front of one Router actor.

As in Ray Serve LLM, the deployment is a thin shim: its replicas tokenize, apply the chat template and
format OpenAI/gRPC responses; the Router (a deployment-scoped actor: created by the Serve controller
before the first replica, shared by every replica, recreated when it fails its health checks, deleted
with the deployment) owns the engine. Scaling the deployment scales the HTTP/gRPC front end; all its
replicas feed one continuous batch.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray import serve
from ray.serve.config import DeploymentActorConfig

from serving import grpc_service
from serving.engine_builders import DEFAULT_ENGINE_BUILDER, LOCAL_ENGINE_BUILDER
from serving.generation_config import load_generation_defaults
from serving.openai_api import create_openai_app
from serving.openai_protocol import SUPPORTED_DEFAULTS
from serving.router import Router
from serving.router_client import GenerationError, RouterClient

logger = logging.getLogger("specserve")

ROUTER_ACTOR = "router"
DEPLOYMENT_NAME = "SpecServe"


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress()  # the FastAPI app is built per replica by __serve_build_asgi_app__, around its RouterClient
class SpecServe:
    async def __init__(self, model: str, served_model_name: str | None = None,
                       security: dict[str, Any] | None = None, generation_config: str = "auto") -> None:
        """security: `api_key` (None: the SPECSERVE_API_KEY environment variable, else no key),
        `max_request_body_bytes`, `auth_health_metrics` (see deploy.config.ServeConfig). generation_config: "auto"
        (the model's generation_config.json gives sampling defaults) or "vllm" (OpenAI's defaults)."""
        from engine.llm import load_tokenizer
        from engine.models.source import resolve_model

        # The router resolved (and, for a GGUF, converted) the model before this replica started: on its
        # node this is a cache hit; elsewhere it converts once, under the source's file lock. Only the tokenizer
        # is read here: a directory of random weights (load_format "dummy") holds none.
        model_dir = str(resolve_model(model, require_weights=False).path)
        tokenizer = load_tokenizer(model_dir)
        if tokenizer is None:
            raise ValueError(f"model {model} has no tokenizer: the HTTP and gRPC APIs need one for text")
        router = serve.get_deployment_actor(ROUTER_ACTOR)
        info = await router.info.remote()
        self.client = RouterClient(lambda: serve.get_deployment_actor(ROUTER_ACTOR), served_model_name or model,
                                   tokenizer, info["max_model_len"],
                                   load_generation_defaults(model_dir, SUPPORTED_DEFAULTS)
                                   if generation_config == "auto" else {})
        security = dict(security or {})
        # A key from the environment (a Kubernetes Secret) stays out of Serve's stored config.
        self.api_key: str | None = security.get("api_key") or os.environ.get("SPECSERVE_API_KEY") or None
        self.max_body_bytes: int | None = security.get("max_request_body_bytes")
        self.auth_health_metrics = bool(security.get("auth_health_metrics", False))

    def __serve_build_asgi_app__(self) -> Any:
        return create_openai_app(self.client, api_key=self.api_key, max_body_bytes=self.max_body_bytes,
                                 auth_health_metrics=self.auth_health_metrics)

    async def Generate(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802 - the RPC's name
        async for response in grpc_service.generate(self.client, request, grpc_context, self.api_key):
            yield response

    async def check_health(self) -> None:
        """Serve's replica health check. A router that is alive but reports a broken engine fails it; a router
        that is gone does not: Serve's controller recreates deployment actors itself, and restarting this
        replica would not bring the router back sooner (its /health answers 503 meanwhile)."""
        try:
            health = await self.client.router_health(timeout_s=30.0)
        except GenerationError:
            return
        # While the router rebuilds its workers, restarting this replica would only drop its connections.
        if not health.get("healthy", False) and not health.get("recovering", False):
            raise RuntimeError(f"the engine is unhealthy: {health.get('reason')}")


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


def build_application(engine_args: dict[str, Any], *, served_model_name: str | None = None,
                      engine_builder: str = DEFAULT_ENGINE_BUILDER, num_replicas: int | str | None = None,
                      autoscaling_config: dict[str, Any] | None = None, max_ongoing_requests: int | None = None,
                      ray_actor_options: dict[str, Any] | None = None,
                      router_options: dict[str, Any] | None = None, max_queued_requests: int | None = None,
                      continue_without_draft: bool = False, api_key: str | None = None,
                      max_request_body_bytes: int | None = None,
                      auth_health_metrics: bool = False, generation_config: str = "auto") -> serve.Application:
    """The bound application. `engine_args` are LLM's keyword arguments (model, draft_model, ...); the rest are
    deploy.config.ServeConfig's fields of the same names."""
    model = engine_args["model"]
    router = DeploymentActorConfig(
        name=ROUTER_ACTOR, actor_class=Router,
        init_kwargs={"engine_args": engine_args, "engine_builder": engine_builder,
                     "model_name": served_model_name or model, "max_queued_requests": max_queued_requests,
                     "continue_without_draft": continue_without_draft},
        actor_options=router_actor_options(engine_args, engine_builder, router_options))
    options: dict[str, Any] = {"deployment_actors": [router],
                               "ray_actor_options": ray_actor_options or {"num_cpus": 1}}
    if autoscaling_config:
        options["autoscaling_config"] = autoscaling_config  # Serve rejects it together with num_replicas
    elif num_replicas is not None:
        options["num_replicas"] = num_replicas
    if max_ongoing_requests is not None:
        options["max_ongoing_requests"] = max_ongoing_requests
    if max_queued_requests is not None:
        # Serve's own queue in front of the replicas (requests not yet handed to one) is bounded too, so that
        # neither queue grows without limit under overload (past it Serve's proxy answers 503). It is sized past
        # a replica's capacity: a burst of arrivals waits there for a few milliseconds even when the router has
        # room, and those must reach the router, which answers 429 itself.
        options["max_queued_requests"] = max_queued_requests + (max_ongoing_requests or 100)
    security = {"api_key": api_key, "max_request_body_bytes": max_request_body_bytes,
                "auth_health_metrics": auth_health_metrics}
    return SpecServe.options(**options).bind(model, served_model_name, security, generation_config)


def router_actors() -> list[Any]:
    """Handles of every specserve router in the cluster (one per application)."""
    names = [(a["name"], a.get("namespace")) for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].endswith(f"::{ROUTER_ACTOR}")]
    return [ray.get_actor(name, namespace=ns or "serve") for name, ns in names]


def drain(timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Graceful shutdown, first half: every router refuses new requests (503) and waits up to `timeout_s` for
    the requests in flight to finish. Call it before serve.shutdown(); returns each router's report."""
    refs = [r.drain.remote(timeout_s) for r in router_actors()]
    return ray.get(refs, timeout=timeout_s + 30.0) if refs else []
