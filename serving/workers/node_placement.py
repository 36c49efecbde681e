"""Which Ray node each worker group runs on, and the checks of the options that choose it.

Groups are placed by the resources and node labels of their bundles (serving/workers/placement.py; the options
target_resources, draft_resources, target_node_labels, draft_node_labels); this reads where they landed from the
actors themselves, for the router's metrics (serving/metrics.py, `specserve_worker_group_node_info`) and the tests
that check a placement: where a group runs is what a node's loss takes away."""

from __future__ import annotations

from typing import Any

import ray
from ray.actor import ActorHandle


def _node_id(_: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def actor_node_ids(actors: list[ActorHandle], timeout_s: float = 10.0) -> list[str | None]:
    """The node id of each actor (None for one that is dead or does not answer in time)."""
    refs = [a.__ray_call__.remote(_node_id) for a in actors]
    out: list[str | None] = []
    for ref in refs:
        try:
            # SYNC: off the step path (metrics, health, tests).
            out.append(ray.get(ref, timeout=timeout_s))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            out.append(None)
    return out


def group_actor(worker: Any) -> ActorHandle:
    """The actor behind a group's worker: a pooled draft's share (TenantDraft) runs on its replica's rank 0."""
    return getattr(worker, "worker", worker)


def executor_nodes(executor: Any, timeout_s: float = 10.0) -> dict[str, list[str | None]]:
    """role ("target" | "draft") -> the node id of each of the group's ranks, for a RayExecutor's groups."""
    out: dict[str, list[str | None]] = {}
    for group in (getattr(executor, "target", None), getattr(executor, "draft", None)):
        if group is not None and group.workers:
            out[group.role] = actor_node_ids([group_actor(w) for w in group.workers], timeout_s)
    return out


def check_node_placement(values: dict[str, Any]) -> None:
    """Raise ValueError, naming the option, for a node placement Ray would refuse or misread: resources must map
    names to numbers >= 0, node labels names to strings. values: the options by name (absent or None: unset)."""
    for role in ("target", "draft"):
        resources, labels = values.get(f"{role}_resources"), values.get(f"{role}_node_labels")
        if resources is not None:
            if not isinstance(resources, dict) or not all(
                    isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                    for k, v in resources.items()):
                raise ValueError(f"{role}_resources must map resource names to numbers >= 0, got {resources!r}")
        if labels is not None:
            if not isinstance(labels, dict) or not labels or not all(
                    isinstance(k, str) and isinstance(v, str) and k and v for k, v in labels.items()):
                raise ValueError(f"{role}_node_labels must map label names to non-empty strings, got {labels!r}")


class GroupNodes:
    """The nodes of an executor's groups, read from Ray again only when its workers change (a group replaced
    after a fault): a scrape then costs no actor call."""

    def __init__(self) -> None:
        self._key: tuple[str, ...] = ()
        self._nodes: dict[str, list[str | None]] = {}

    def of(self, executor: Any) -> dict[str, list[str | None]]:
        workers = getattr(executor, "workers", None)
        if workers is None:  # an engine in the router's own process: no worker groups
            return {}
        key = tuple(f"{role}:{w._actor_id.hex()}" for role, _, w in workers())
        if key != self._key or any(n is None for ns in self._nodes.values() for n in ns):
            self._key, self._nodes = key, executor_nodes(executor)
        return self._nodes
