"""Placement of one model's tensor-parallel ranks: one bundle per rank, all bundles of a group on one node.

Target and draft get a placement group each, so each is packed on its own (a node pool per model later,
through custom resources in the bundles) while the two need not share a node.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

# Ray's own resource names; everything else in a bundle is a custom resource (a node label of sorts).
_BUILTIN = ("CPU", "GPU", "memory")


def default_bundle(device_type: str) -> dict[str, float]:
    """One rank's bundle: a GPU and a CPU on CUDA, a CPU core on CPU (each rank runs one torch thread)."""
    return {"GPU": 1.0, "CPU": 1.0} if device_type == "cuda" else {"CPU": 1.0}


def make_bundle(device_type: str, resources: dict[str, float] | None) -> dict[str, float]:
    """The default bundle with `resources` merged in (overriding CPU/GPU or adding custom resources)."""
    bundle = default_bundle(device_type)
    bundle.update(resources or {})
    if device_type == "cuda" and bundle.get("GPU", 0) <= 0:
        raise ValueError(f"a CUDA worker needs a GPU in its bundle, got {bundle}")
    return {k: float(v) for k, v in bundle.items() if v}


def create_group_placement(name: str, size: int, bundle: dict[str, float], timeout_s: float,
                           node_labels: dict[str, str] | None = None) -> PlacementGroup:
    """A STRICT_PACK placement group of `size` copies of `bundle`, waited for until ready. node_labels: only on a
    node whose Ray labels match them all (a KubeRay worker group's `rayStartParams.labels`)."""
    selector = [dict(node_labels) for _ in range(size)] if node_labels else None
    pg = placement_group([dict(bundle) for _ in range(size)], strategy="STRICT_PACK", name=name,
                         bundle_label_selector=selector)
    try:
        # SYNC: not on the step path; construction waits for the cluster to grant the resources.
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(
            f"{name}: the cluster could not place {size} x {bundle} on one node"
            f"{f' labelled {node_labels}' if node_labels else ''} within {timeout_s:.0f} s "
            f"(cluster has {ray.cluster_resources()}); add nodes/resources or lower the tensor-parallel size"
        ) from None
    return pg


def actor_options(pg: PlacementGroup, bundle_index: int, bundle: dict[str, float]) -> dict:
    """`.options(...)` for an actor that takes the whole bundle `bundle_index` of `pg`."""
    opts: dict = {} if "memory" not in bundle else {"memory": bundle["memory"]}
    return opts | {
        "num_cpus": bundle.get("CPU", 0.0),
        "num_gpus": bundle.get("GPU", 0.0),
        "resources": {k: v for k, v in bundle.items() if k not in _BUILTIN},
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=True),
    }


def bundle_task_options(pg: PlacementGroup, bundle_index: int) -> dict:
    """`.options(...)` for a resource-free task that runs on the node of one bundle (rendezvous lookup)."""
    return {"num_cpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=bundle_index)}
