"""Replacing the Ray executor's draft group while its target serves on (serving/router/recovery.py): drop the draft
ranks, start a new group beside the running target, and put it into the step between two steps. With a draft pool
(serving/draft_pool/pool.py) the executor's draft is a share of a group that serves other targets too: dropping it
detaches this target, and a "new group" is a share of a live group of the pool, the dead one's replacement or
another."""

from __future__ import annotations

import time
import uuid

import ray

from engine.config import EngineConfig
from serving.workers.group import WorkerGroup, gather_info, release_group
from serving.workers.placement import actor_options, bundle_task_options, create_group_placement, make_bundle
from serving.workers.worker import ModelWorker, node_ip_and_free_port


class DraftGroupReplacement:
    """The draft groups a running executor (serving/workers/ray_executor.py) starts beside its target: what one is
    built from and the one started but not yet put into the step (`pending`). The executor holds one, starts a
    group through it and takes the started group when it puts it into the step (its `attach_draft`)."""

    def __init__(self, engine_config: EngineConfig, draft_pool: str | None, model_path: str | None,
                 tensor_parallel_size: int, resources: dict[str, float] | None, rejection_sampling: str | None,
                 placement_timeout_s: float, init_timeout_s: float, placement_prefix: str,
                 node_labels: dict[str, str] | None = None) -> None:
        """draft_pool: a pool's name to take shares of (serving/draft_pool/pool.py), else None: groups of its own,
        whose placement groups are named after `placement_prefix` and placed on a node with `node_labels`."""
        self.engine_config, self.draft_pool, self.placement_prefix = engine_config, draft_pool, placement_prefix
        # What a new group is built from: (model path, tensor-parallel size, resources, rejection sampling, placement
        # timeout, load timeout).
        self.args = (model_path, tensor_parallel_size, resources, rejection_sampling, placement_timeout_s,
                     init_timeout_s)
        self.node_labels = node_labels  # the Ray node labels a new group is placed by (None: any node)
        # More of ModelWorker's keyword arguments for a new group's ranks (an EAGLE-3 head's: target_model_path).
        self.worker_kwargs: dict[str, object] = {}
        self.pending: WorkerGroup | None = None  # started, not attached yet

    def attach_pooled(self, timeout_s: float, exclude: str | None = None) -> WorkerGroup:
        """A share of the pool's least-loaded draft group (not replica `exclude`), as the executor's draft group
        of one "rank"."""
        from serving.draft_pool.pool import attach_to_pool
        from serving.draft_pool.worker import TenantDraft
        from serving.workers.worker import WorkerInfo

        path = self.args[0]
        assert self.draft_pool is not None and path is not None
        try:
            owner = ray.get_runtime_context().current_actor  # the router: the pool frees the share if it dies
        except Exception:  # noqa: BLE001 - not in an actor (a driver, a test): the pool's timeout frees it
            owner = None
        replica, handle, share = attach_to_pool(self.draft_pool, uuid.uuid4().hex[:12], owner, timeout_s, exclude)
        group = WorkerGroup("draft", path, 1, None, [TenantDraft(handle, share, self.draft_pool, replica)])
        group.info = WorkerInfo("draft", share.kv_groups, share.num_blocks, share.vocab_size, 1,
                                str(self.engine_config.device), "", 0)
        return group

    def start(self, speculation_ahead: bool) -> None:
        """Start and load a new draft group (blocking; the target's steps may run meanwhile), as `pending`."""
        path, size, resources, rejection_sampling, placement_timeout_s, init_timeout_s = self.args
        if path is None:
            raise RuntimeError("this executor was built without a draft model")
        if self.pending is not None:
            release_group(self.pending)
        if self.draft_pool is not None:
            self.pending = self.attach_pooled(init_timeout_s)
            return
        bundle = make_bundle(self.engine_config.device.type, resources)
        pg = create_group_placement(f"{self.placement_prefix}-{time.monotonic_ns():x}", size, bundle,
                                    placement_timeout_s, self.node_labels)
        group = WorkerGroup("draft", path, size, pg)
        self.pending = group
        addr, port = "127.0.0.1", 0
        if size > 1:
            lookup = ray.remote(node_ip_and_free_port)
            # SYNC: off the step path (recovery).
            addr, port = ray.get(lookup.options(**bundle_task_options(pg, 0)).remote(), timeout=placement_timeout_s)
        actor_cls = ray.remote(ModelWorker)
        for rank in range(size):
            group.workers.append(actor_cls.options(**actor_options(pg, rank, bundle)).remote(
                "draft", path, self.engine_config, rank, size, addr, port, rejection_sampling,
                int(bundle.get("CPU", 1)), speculation_ahead=speculation_ahead, **self.worker_kwargs))
        group.info = gather_info(group, init_timeout_s)

    def start_pooled_move(self, current: str, timeout_s: float) -> WorkerGroup:
        """A share of the least-loaded replica of the pool other than `current` with room, as `pending`. Raises
        when no other replica has room within `timeout_s`."""
        if self.pending is not None:
            release_group(self.pending)
        self.pending = self.attach_pooled(timeout_s, exclude=current)
        return self.pending

    def take(self) -> WorkerGroup:
        """The started group, no longer pending: the executor puts it into the step."""
        group, self.pending = self.pending, None
        if group is None or group.info is None:
            raise RuntimeError("no started draft group to attach: call start_draft_group() first")
        return group

    def drop(self, group: WorkerGroup) -> None:
        """Release `group` if it is still the pending one (a move that lost to a recovery)."""
        if self.pending is group:
            release_group(group)
            self.pending = None
