"""Direct streaming (`direct_streaming: true`): each engine replica is the HTTP and gRPC server itself.

By default a request crosses two Serve handle hops between the server that takes it and the engine: the ingress
replica calls the engine replica, and every streamed delta comes back the same way before the ingress formats it
(one H100, benchmarks/RESULTS.md, "HAProxy in front of the ingress": 4.5 ms for the call and 1.8 ms for the first
delta back at c=1, 9.7 and 3.4 ms in a wave of 16 requests). With direct streaming, as Ray Serve LLM's option of
that name, the engine deployment is the application's ingress: HAProxy (or Serve's proxy) hands each connection to
an engine replica, whose FastAPI app and gRPC method stream its own router's deltas in process.

What it costs: no ingress replicas of their own (tokenizing, templating and formatting run on the router's event
loop, beside its step thread), and the HTTP proxy, not the project's request router, picks the replica: no prefix
affinity (`request_router: prefix_aware` is refused with it). Health and /metrics still ask every engine replica,
through a handle to the deployment.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from engine.gc_heap import freeze_startup_heap
from serving.engine_builders import DEFAULT_ENGINE_BUILDER
from serving.engine_deployment import ENGINE_DEPLOYMENT, EngineReplica
from serving.front_end import FrontEnd, tokenizer_source


class InProcessStream:
    """A request's deltas from a router in this process, shaped like a streaming DeploymentResponseGenerator:
    iterate it; `cancel()` closes the router's stream, which aborts the request and frees its KV blocks."""

    def __init__(self, deltas: AsyncIterator[dict[str, Any]]) -> None:
        self._deltas = deltas
        self._closing: asyncio.Task | None = None

    def __aiter__(self) -> InProcessStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await self._deltas.__anext__()

    def cancel(self) -> None:
        # Called from a `finally` that may not await (RouterClient's, as for a Serve response): close on the loop.
        self._closing = asyncio.get_running_loop().create_task(self._deltas.aclose())


class _Method:
    def __init__(self, call: Any) -> None:
        self.remote = call


class ReplicaEngine:
    """What RouterClient asks of a DeploymentHandle, for the engine replica it runs in: `generate` goes to this
    replica's router in process; `broadcast` (health, metrics, drain) to every replica of the deployment."""

    def __init__(self, router: Any, deployment: Any) -> None:
        self._router = router
        self._deployment = deployment  # a DeploymentHandle of the engine deployment (this replica's own)
        self.generate = _Method(lambda *args: InProcessStream(router.generate(*args)))

    def options(self, stream: bool = False) -> ReplicaEngine:
        return self

    def broadcast(self, method: str, *args: Any) -> Any:
        return self._deployment.broadcast(method, *args)


@serve.deployment(name=ENGINE_DEPLOYMENT)
@serve.ingress()  # the FastAPI app is built per replica by __serve_build_asgi_app__, around its own router
class EngineIngressReplica(EngineReplica.func_or_class):
    """An engine replica that also answers HTTP and gRPC (the application's ingress)."""

    FREEZE_HEAP_AT_INIT = False  # frozen once below, with the front end built too

    def __init__(self, engine_args: dict[str, Any], engine_builder: str = DEFAULT_ENGINE_BUILDER,
                 model_name: str | None = None, max_queued_requests: int | None = None,
                 continue_without_draft: bool = False, security: dict[str, Any] | None = None,
                 generation_config: str = "auto", chat: dict[str, Any] | None = None,
                 stream_interval_ms: float = 0.0) -> None:
        """The engine replica's arguments, then the front end's (serving.front_end.FrontEnd); `model_name` is the
        served model name, as for the engine replica."""
        super().__init__(engine_args, engine_builder, model_name, max_queued_requests, continue_without_draft,
                         stream_interval_ms)
        ctx = serve.get_replica_context()
        deployment = serve.get_deployment_handle(ENGINE_DEPLOYMENT, ctx.app_name)
        self.front = FrontEnd(ReplicaEngine(self, deployment), str(engine_args["model"]), model_name,
                              self.engine.config.max_model_len, security, generation_config,
                              tokenizer_source(engine_args), chat)
        self.gc_frozen = freeze_startup_heap(f"engine ingress of {model_name or engine_args['model']}")

    def __serve_build_asgi_app__(self) -> Any:
        return self.front.asgi_app()

    async def Generate(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802 - the RPC's name
        async for response in self.front.grpc_generate(request, grpc_context):
            yield response
