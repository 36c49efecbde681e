"""One model's tensor-parallel ranks as the Ray executor holds them, and the checks and policies that decide how a
group is built: whether a model splits over its ranks, where the draft runs, and whether the target's ranks launch
the verify ahead."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, remove_placement_group

from engine.model_config import ModelConfig
from engine.runner.draft_vocabulary import check_token_map
from serving.engine_builders import DRAFT_PLACEMENTS
from serving.workers.worker import WorkerInfo

logger = logging.getLogger("specserve")


@dataclass
class WorkerGroup:
    """The ranks of one model."""

    role: str  # "target" | "draft"
    model_path: str
    size: int  # tensor-parallel ranks
    placement: PlacementGroup | None
    workers: list[ActorHandle] = field(default_factory=list)  # [size], by rank
    info: WorkerInfo | None = None


def check_tensor_parallel(cfg: ModelConfig, size: int, role: str) -> None:
    """Fail on the router, with the numbers, before any worker starts, for a model that cannot be split."""
    if size < 1:
        raise ValueError(f"{role} tensor-parallel size must be >= 1, got {size}")
    hf = cfg.hf_config
    checks = [("attention heads", cfg.num_heads), ("MLP intermediate size", getattr(hf, "intermediate_size", 0))]
    for what, n in checks:
        if n % size:
            raise ValueError(f"{role} model: {what} ({n}) is not divisible by tensor_parallel_size={size}")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        # Fewer KV heads than ranks is fine (each is replicated), but the split must be even either way.
        raise ValueError(f"{role} model: {kv} KV heads cannot be split over tensor_parallel_size={size}; "
                         "use a size that divides the KV head count or is a multiple of it")


def check_group_models(model_path: str, draft_model_path: str | None, tp: int, draft_tp: int,
                       draft_token_map: str | None, colocated: bool) -> None:
    """Fail on the router, before any worker starts, for a model that cannot be split over its ranks or a draft token
    map the draft cannot take. draft_model_path: a draft model's (None: no draft, or an EAGLE-3 head, whose checks
    ran in configure_engine); colocated: the draft runs on the target's ranks, hence at the target's size."""
    check_tensor_parallel(ModelConfig.from_path(model_path), tp, "target")
    if draft_model_path is not None:
        draft_config = ModelConfig.from_path(draft_model_path)
        check_tensor_parallel(draft_config, draft_tp, "draft")
        if draft_token_map is not None:
            check_token_map(draft_token_map, draft_config.vocab_size, tp if colocated else draft_tp)


def check_draft_placement(placement: str, tp: int, draft_tp: int) -> None:
    """Fail on the router, before any worker starts, for a placement the executor cannot build. A colocated draft
    runs in each target rank's process on the target's tensor-parallel group, so it needs the target's size."""
    if placement not in DRAFT_PLACEMENTS:
        raise ValueError(f"draft_placement must be one of {list(DRAFT_PLACEMENTS)}, got {placement!r}")
    if placement == "colocated" and draft_tp != tp:
        raise ValueError(f"draft_placement 'colocated' runs the draft in the target's ranks, so its tensor-parallel "
                         f"size must equal the target's: draft_tensor_parallel_size={draft_tp}, "
                         f"tensor_parallel_size={tp}")


def resolve_draft_placement(placement: str, device_type: str, tp: int, draft_tp: int, cluster_gpus: float,
                            draft_resources_given: bool) -> str:
    """`placement` with "auto" decided: "colocated" where the draft's ranks could only share the target's GPUs
    (a CUDA cluster of fewer than tp + draft_tp GPUs, equal sizes, no resources given for the draft), so the
    step runs whole in each target rank's process rather than crossing processes on one device (measured faster
    on one GPU: benchmarks/RESULTS.md); "separate" everywhere else: on GPUs of its own the draft works beside the
    target (speculation ahead), and on CPU each model keeps a process, hence a core, of its own. cluster_gpus:
    the cluster's GPUs (not the free ones, so an engine rebuilt after a failure decides the same way);
    draft_resources_given: the draft's ranks were given resources of their own, which only a separate draft has."""
    check_draft_placement(placement, tp, draft_tp)
    if placement != "auto":
        return placement
    if device_type == "cuda" and draft_tp == tp and not draft_resources_given and cluster_gpus < tp + draft_tp:
        return "colocated"
    return "separate"


def draft_placement_of(placement: str, has_draft: bool, eagle3: bool, pooled: bool, device_type: str, tp: int,
                       draft_tp: int, draft_resources_given: bool) -> str:
    """Where the executor runs its draft: an EAGLE-3 head colocated unless asked "separate" (it reads the target's
    hidden states, which then travel with each result), a pooled draft's share separate (serving/draft_pool/pool.py),
    anything else as asked, with "auto" decided from the cluster's GPUs (`resolve_draft_placement`). has_draft: a
    draft model or head is given."""
    if eagle3:
        if pooled:
            raise ValueError("an EAGLE-3 head reads its own target's hidden states: it cannot be a draft pool's")
        # Beside the target by default: its states stay in the target's process (a separate head's cross with each
        # result, benchmarks/RESULTS.md).
        placement = "separate" if placement == "separate" else "colocated"
    if pooled:
        placement = "separate"
    resolved = resolve_draft_placement(placement, device_type, tp, draft_tp, ray.cluster_resources().get("GPU", 0.0),
                                       draft_resources_given)
    if has_draft and placement == "auto":
        logger.info("draft_placement 'auto': %s", resolved)
    return resolved


def launch_verify_ahead_for(requested: bool | None, device_type: str, bundles: list[dict[str, float]],
                            use_compiled_graph: bool) -> bool:
    """Whether the target's ranks launch each verify forward before the draft's ids come. `requested` wins when
    set. By default: with a draft, through the compiled graph (which runs `target_prepare` ahead), on CUDA, and
    only where every rank of both models has whole GPUs (bundles: the target's, then the draft's): the gate's
    waiting kernel would take a draft's time slices on a GPU the two share."""
    if requested is not None:
        return requested
    return (device_type == "cuda" and len(bundles) == 2 and use_compiled_graph
            and all(b.get("GPU", 0) >= 1 for b in bundles))


def speculation_ahead_for(requested: bool | None, device_type: str, bundles: list[dict[str, float]]) -> bool:
    """Whether the draft's ranks draft the next window while the target verifies. `requested` wins when set. By
    default only where every rank of both models (bundles: the target's, then the draft's) has whole GPUs: there
    the window ahead runs beside the verify, where a shared device would queue it behind it."""
    if requested is not None:
        return requested
    return device_type == "cuda" and len(bundles) == 2 and all(b.get("GPU", 0) >= 1 for b in bundles)


def release_group(group: WorkerGroup) -> None:
    """Kill a group's workers and free its placement group (a dead worker's kill is a no-op). A share of a pooled
    draft group (serving/draft_pool/worker.py, TenantDraft) is detached instead: the group serves other targets."""
    for w in group.workers:
        try:
            if hasattr(w, "release"):
                w.release()
                continue
            ray.kill(w)
        except Exception as e:
            logger.warning("killing a %s worker: %s", group.role, e)
    group.workers = []
    if group.placement is not None:
        try:
            remove_placement_group(group.placement)
        except Exception as e:
            logger.warning("removing the %s placement group: %s", group.role, e)
        group.placement = None


def gather_info(group: WorkerGroup, timeout_s: float) -> WorkerInfo:
    """Wait for every rank of a freshly started group to load its model; rank 0's WorkerInfo, once every rank
    agrees with it on its KV caches and vocabulary."""
    try:
        # SYNC: construction only; waits for the models to load.
        infos: list[WorkerInfo] = ray.get([w.info.remote() for w in group.workers], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"{group.role} workers did not finish loading {group.model_path} within "
                           f"{timeout_s:.0f} s") from None
    except ray.exceptions.RayActorError as e:
        raise RuntimeError(f"a {group.role} worker failed while loading {group.model_path}: {e}") from e
    first = infos[0]
    for rank, info in enumerate(infos[1:], start=1):
        if _kv_shape(info) != _kv_shape(first):
            raise RuntimeError(f"{group.role} rank {rank} disagrees with rank 0 on its KV cache: "
                               f"{info.num_blocks} vs {first.num_blocks} blocks (a colocated draft's: "
                               f"{info.draft_num_blocks} vs {first.draft_num_blocks})")
    logger.info("%s: %d rank(s) on %s, %d KV blocks, %d KV-cache group(s)", group.role, group.size,
                sorted({i.node_ip for i in infos}), first.num_blocks, len(first.kv_groups))
    return first


def _kv_shape(info: WorkerInfo) -> tuple:
    """What every rank of a group must agree on: its models' KV caches and vocabulary."""
    return info.num_blocks, info.kv_groups, info.vocab_size, info.draft_num_blocks, info.draft_kv_groups
