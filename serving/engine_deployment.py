"""Engine replicas: the Serve deployment whose every replica is one router, hence one engine.

A replica owns a Router (serving/router/router.py): one EngineCore with its own target and draft worker groups, each in
a placement group of its own (custom resources such as `specserve_target` / `specserve_draft` in the bundles
place them on the right node pool). So `num_replicas` and `autoscaling_config` scale engines, not front ends:
Serve's controller starts and stops replicas, and each new replica builds its workers, which Ray places (and a
cluster autoscaler adds nodes for, when the placement groups wait for GPUs).

Serve's own mechanisms do the rest:
- routing: the ingress calls this deployment through a DeploymentHandle, whose request router
  (serving/router/replica_router.py) picks a replica per request among those that report taking requests
  (`record_routing_stats`): power of two choices on queue length, or prefix affinity;
- scale-down: Serve stops routing to a replica it removes, waits up to `graceful_shutdown_timeout_s` for its
  requests in flight, then calls `__del__`, which refuses stragglers and releases the workers;
- health: Serve calls `check_health`; a replica whose worker died rebuilds its workers itself (the router's
  recovery) and only fails the check when it cannot, so Serve replaces it while the other replicas serve.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve

from serving.engine_builders import DEFAULT_ENGINE_BUILDER
from serving.router.replica_router import ACCEPTING
from serving.router.router import Router

logger = logging.getLogger("specserve")

ENGINE_DEPLOYMENT = "SpecServeEngine"


def replica_label() -> str:
    """This replica's short id (Serve's unique id), the `replica` label of its metrics; "local" outside Serve."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a Serve replica (a plain actor, a test)
        return "local"


@serve.deployment(name=ENGINE_DEPLOYMENT)
class EngineReplica(Router):
    """One engine replica: the router with Serve's hooks (health check, shutdown) and a replica label."""

    def __init__(self, engine_args: dict[str, Any], engine_builder: str = DEFAULT_ENGINE_BUILDER,
                 model_name: str | None = None, max_queued_requests: int | None = None,
                 continue_without_draft: bool = False, stream_interval_ms: float = 0.0) -> None:
        self.replica = replica_label()
        super().__init__(engine_args, engine_builder, model_name, max_queued_requests, continue_without_draft,
                         stream_interval_ms)
        logger.info("engine replica %s is serving", self.replica)

    async def check_health(self) -> None:
        """Serve's health check. A replica rebuilding its workers passes (it answers 503 meanwhile and comes
        back by itself); a broken engine that is not recovering fails, so that Serve replaces the replica."""
        health = await self.health()
        if not health["healthy"] and not health["recovering"]:
            raise RuntimeError(f"engine replica {self.replica} is unhealthy: {health['reason']}")

    async def health(self) -> dict[str, Any]:
        return {**await super().health(), "replica": self.replica}

    async def stats(self) -> dict[str, Any]:
        return {**await super().stats(), "replica": self.replica}

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing stats, polled every few seconds and handed to the request routers: whether this replica
        takes requests (not while it rebuilds its workers or drains), so that they send them elsewhere."""
        return {ACCEPTING: self.recovery.unhealthy is None and not self._draining}

    async def replica_metrics(self) -> tuple[str, str]:
        """(replica label, this engine's exposition): the ingress merges every replica's into one /metrics."""
        return self.replica, await self.metrics_text()  # Router.metrics_text: prefix-cache counters brought up

    def __del__(self) -> None:
        """Serve calls this on scale-down or shutdown, once the requests in flight have finished (or its
        graceful shutdown timeout passed): refuse any late request, and release the model workers (their
        placement groups, hence their GPUs) now rather than when the actor's process exits."""
        self._draining = True
        engine = getattr(self, "engine", None)  # absent when the constructor failed
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - shutting down anyway; the workers die with this process
                logger.exception("engine replica %s: releasing the workers failed", self.replica)
