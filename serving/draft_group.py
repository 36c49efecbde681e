"""Replacing the Ray executor's draft group while its target serves on (serving/engine_recovery.py): drop the draft
ranks, start a new group beside the running target, and put it into the step between two steps. With a draft pool
(serving/draft_pool.py) the executor's draft is a share of a group that serves other targets too: dropping it
detaches this target, and a "new group" is a share of a live group of the pool, the dead one's replacement or
another."""

from __future__ import annotations

import time
import uuid
from typing import Any

import ray

from engine.config import EngineConfig
from engine.kv_cache.spec import KVCacheGroupSpec
from serving.placement import actor_options, bundle_task_options, create_group_placement, make_bundle
from serving.worker import ModelWorker, node_ip_and_free_port
from serving.worker_group import WorkerGroup, release_group


class DraftGroupReplacement:
    """A mixin of RayExecutor: it uses the executor's state below and its `_teardown_graph`, `_build_graph`,
    `_gather_info` and `check_health`."""

    engine_config: EngineConfig
    colocated: bool
    use_compiled_graph: bool
    speculation_ahead: bool
    draft: WorkerGroup | None
    draft_kv_groups: list[KVCacheGroupSpec] | None
    draft_num_blocks: int
    _graph: Any
    _broken: str | None
    _broken_role: str | None
    # What a replacement draft group is built from: (model path, tensor-parallel size, resources, rejection
    # sampling, placement timeout, load timeout), and one being built.
    _draft_args: tuple[str | None, int, dict[str, float] | None, str | None, float, float]
    _pending_draft: WorkerGroup | None
    _node_labels: dict[str, dict[str, str] | None]  # role -> the Ray node labels its group is placed by
    draft_pool: str | None

    def _attach_pooled_draft(self, path: str | None, timeout_s: float, exclude: str | None = None) -> WorkerGroup:
        """A share of the pool's least-loaded draft group (not replica `exclude`), as this executor's draft group
        of one "rank"."""
        from serving.draft_pool import attach_to_pool
        from serving.draft_pool_worker import TenantDraft
        from serving.worker import WorkerInfo

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

    def detach_draft(self) -> None:
        """Run on the target alone: drop the draft ranks (dead or alive) and rebuild the graph without them.
        Raises WorkerDiedError if a target rank is dead too, RuntimeError for a draft colocated in the target's
        ranks (its recovery rebuilds the whole engine)."""
        self._refuse_colocated("detach")
        self._teardown_graph()
        if self.draft is not None:
            release_group(self.draft)
        self.draft, self.draft_kv_groups, self.draft_num_blocks = None, None, 0
        self._broken = self._broken_role = None
        self.check_health()
        if self.use_compiled_graph:
            self._graph = self._build_graph()

    def start_draft_group(self) -> None:
        """Start and load a new draft group beside the running target (blocking; steps may run meanwhile).
        `attach_draft` then puts it into the step."""
        self._refuse_colocated("start a new draft group for")
        path, size, resources, rejection_sampling, placement_timeout_s, init_timeout_s = self._draft_args
        if path is None:
            raise RuntimeError("this executor was built without a draft model")
        if self._pending_draft is not None:
            release_group(self._pending_draft)
        if self.draft_pool is not None:
            self._pending_draft = self._attach_pooled_draft(path, init_timeout_s)
            return
        bundle = make_bundle(self.engine_config.device.type, resources)
        pg = create_group_placement(f"specserve-draft-{id(self):x}-{time.monotonic_ns():x}", size, bundle,
                                    placement_timeout_s, self._node_labels["draft"])
        group = WorkerGroup("draft", path, size, pg)
        self._pending_draft = group
        addr, port = "127.0.0.1", 0
        if size > 1:
            lookup = ray.remote(node_ip_and_free_port)
            # SYNC: off the step path (recovery).
            addr, port = ray.get(lookup.options(**bundle_task_options(pg, 0)).remote(), timeout=placement_timeout_s)
        actor_cls = ray.remote(ModelWorker)
        for rank in range(size):
            group.workers.append(actor_cls.options(**actor_options(pg, rank, bundle)).remote(
                "draft", path, self.engine_config, rank, size, addr, port, rejection_sampling,
                int(bundle.get("CPU", 1)), speculation_ahead=self.speculation_ahead))
        group.info = self._gather_info(group, init_timeout_s)

    def start_pooled_move(self, timeout_s: float = 10.0) -> WorkerGroup:
        """A target of a draft pool moving to another replica of it (serving/draft_moves.py): attach to the
        least-loaded other replica with room, as the started group that `attach_draft` puts into the step (after
        `detach_draft` lets go of the current one). Raises when no other replica has room within `timeout_s`."""
        if self.draft_pool is None or self.draft is None:
            raise RuntimeError("only a target attached to a draft pool moves between its replicas")
        current = self.draft.workers[0].replica
        if self._pending_draft is not None:
            release_group(self._pending_draft)
        self._pending_draft = self._attach_pooled_draft(self._draft_args[0], timeout_s, exclude=current)
        return self._pending_draft

    def attach_draft(self) -> None:
        """Put the group `start_draft_group` built into the step: the graph is rebuilt with it (between steps)."""
        self._refuse_colocated("attach")
        group, self._pending_draft = self._pending_draft, None
        if group is None or group.info is None:
            raise RuntimeError("no started draft group to attach: call start_draft_group() first")
        self._teardown_graph()
        self.draft = group
        self.draft_kv_groups, self.draft_num_blocks = group.info.kv_groups, group.info.num_blocks
        if self.use_compiled_graph:
            self._graph = self._build_graph()

    def _refuse_colocated(self, what: str) -> None:
        if self.colocated:
            raise RuntimeError(f"cannot {what} a draft colocated in the target's worker processes "
                               "(draft_placement 'colocated'): it lives and dies with the target's ranks, so the "
                               "engine is rebuilt whole instead")
