"""A draft pool: draft groups of their own, each shared by several target engine replicas (`draft_replicas`).

Each replica of the draft deployment owns one draft worker group (a placement group of one bundle per
tensor-parallel rank, serving/draft_pool/worker.py), with room for `slots` targets: the number of engine replicas
the pool's replicas share out (ceil(engine replicas / draft replicas)). Rank 0 of each group is a named actor,
`<pool>:<replica>`; an engine replica's executor (serving/workers/ray_executor.py, `draft_pool`) lists the pool's named
ranks, attaches to the one with the fewest targets (least-loaded; ties by name, so an empty pool fills round
robin) and calls it directly with plain actor calls: the proposal goes from the draft's rank 0 to the target's
ranks as an ObjectRef, never through Serve's handles. Rank 0 runs its targets' calls in threads, and the draft
steps of targets waiting at the same time as one draft step (serving/draft_pool/batch.py); the replica exports the
histogram of targets per draft forward (`metrics`).

Faults: a draft replica whose rank died fails Serve's health check and is replaced; its targets' steps fail with a
dead draft worker, each goes on without speculation (lossless, serving/router/recovery.py) and attaches to a
live group, the replacement or another, when one has room. A target that dies (its router actor is gone) or is
not heard from for `tenant_timeout_s` is detached by the replica's watch loop: its share and its requests' draft
state are freed.

Scaling (`draft_autoscaling_config`, serving/draft_pool/autoscaling.py): each replica reports its draft's busy fraction
to Serve's autoscaler. The watch loop also balances the pool: a replica holding two targets more than another
replica with room (a replica just started, say) asks one of its targets to move, and the target moves between two
of its steps (serving/router/draft_moves.py); the replica Serve stops asks all of its targets to move and waits for them
(up to `drain_timeout_s`) before it releases its group, so a scale-down takes no step of theirs without a draft.
A target that is still attached when the group goes fails over as from a dead draft (exact, without speculation,
until it attaches again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray import serve

from serving.serving_defaults import DRAIN_TIMEOUT_S, TENANT_TIMEOUT_S

logger = logging.getLogger("specserve")

DRAFT_DEPLOYMENT = "SpecServeDraft"
POOL_PREFIX = "specserve-draft-pool"
WATCH_PERIOD_S = 2.0
# Executor-only arguments of the engine builder (serving/engine_factory.py): not the draft's.
_EXECUTOR_ARGS = ("use_compiled_graph", "target_resources", "draft_tensor_transport", "launch_verify_ahead",
                  "draft_placement", "step_timeout_s", "draft_pool", "tenant_timeout_s", "target_node_labels")


def pool_actor_prefix(pool: str) -> str:
    return f"{POOL_PREFIX}:{pool}:"


def slots_per_draft(num_engine_replicas: int, draft_replicas: int) -> int:
    """Targets each draft replica makes room for: the engine replicas shared out over the draft replicas."""
    if draft_replicas < 1:
        raise ValueError(f"draft_replicas must be >= 1, got {draft_replicas}")
    return max(1, -(-num_engine_replicas // draft_replicas))


def draft_worker_config(engine_args: dict[str, Any], slots: int) -> tuple[str, Any, Any]:
    """(draft model path, EngineConfig, SpeculativeConfig) of a pooled draft, resolved exactly as the engine
    builder resolves its targets' (so the block size, context and dtype agree). A fixed `num_kv_blocks` is each
    target's share: the pool gets `slots` of them; so are max_num_seqs and max_num_batched_tokens (a draft step may
    batch every target's plan)."""
    import dataclasses

    import torch

    from engine.config import resolve_dtype
    from engine.model_setup import configure_engine, split_launch

    args = {k: v for k, v in engine_args.items() if k not in (*_EXECUTOR_ARGS, "draft_resources", "draft_node_labels")}
    launch, args = split_launch(args, "a draft pool's engine arguments")
    if launch.draft_model is None:
        raise ValueError("draft_replicas needs a draft model")
    dev = torch.device(launch.device or ("cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"))
    pair, config = configure_engine(launch.model, launch.draft_model, device=dev,
                                    dtype=resolve_dtype(launch.dtype, dev), max_model_len=launch.max_model_len,
                                    options=args)
    if config.num_kv_blocks is not None:
        config = dataclasses.replace(config, num_kv_blocks=(config.num_kv_blocks - 1) * slots + 1)
    # One draft step may draft for every target at once (serving/draft_pool/batch.py): room for all of their batches.
    config = dataclasses.replace(config, max_num_seqs=config.max_num_seqs * slots,
                                 max_num_batched_tokens=config.max_num_batched_tokens * slots)
    assert pair.draft is not None
    return str(pair.draft.path), config, pair.spec


@serve.deployment(name=DRAFT_DEPLOYMENT)
class DraftPoolReplica:
    """One draft group of the pool, and the loop that frees the shares of targets that left."""

    def __init__(self, engine_args: dict[str, Any], pool: str, slots: int, tenant_timeout_s: float = TENANT_TIMEOUT_S,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """drain_timeout_s: on scale-down, how long the replica waits for its targets to move elsewhere."""
        from engine.model_config import ModelConfig
        from serving.draft_pool.worker import PooledDraftWorker, rank0_concurrency
        from serving.workers.group import WorkerGroup, check_tensor_parallel, release_group
        from serving.workers.placement import actor_options, bundle_task_options, create_group_placement, make_bundle
        from serving.workers.worker import node_ip_and_free_port

        try:
            self.replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (a test)
            self.replica = f"local-{time.monotonic_ns():x}"
        from serving.draft_pool.autoscaling import BusyMeter

        self.pool, self.tenant_timeout_s, self.drain_timeout_s = pool, tenant_timeout_s, drain_timeout_s
        self._busy = BusyMeter()
        self._release = release_group  # kept: __del__ may run while the interpreter shuts down
        path, config, spec = draft_worker_config(engine_args, slots)
        size = spec.draft_tensor_parallel_size
        check_tensor_parallel(ModelConfig.from_path(path), size, "draft")
        bundle = make_bundle(config.device.type, engine_args.get("draft_resources"))
        pg = create_group_placement(f"specserve-draft-pool-{self.replica}", size, bundle, 120.0,
                                    engine_args.get("draft_node_labels"))
        self.group = WorkerGroup("draft", path, size, pg)
        addr, port = "127.0.0.1", 0
        if size > 1:
            # SYNC: construction only.
            addr, port = ray.get(ray.remote(node_ip_and_free_port).options(**bundle_task_options(pg, 0)).remote())
        self.name = pool_actor_prefix(pool) + self.replica
        # Speculation ahead (serving/draft_pool/ahead.py): as asked, else on where the draft has GPUs of its own (the
        # targets always do: their windows ahead run beside their verifies), as for a draft group of one target.
        ahead = (bool(config.speculation_ahead) if config.speculation_ahead is not None
                 else config.device.type == "cuda" and bundle.get("GPU", 0) >= 1)
        actor_cls = ray.remote(PooledDraftWorker)
        for rank in range(size):
            opts = actor_options(pg, rank, bundle)
            if rank == 0:
                opts["name"] = self.name  # what the targets find it by
                # Threads: the targets' calls meet there, to be batched (the other ranks run rank 0's order).
                opts["max_concurrency"] = rank0_concurrency(slots)
            self.group.workers.append(actor_cls.options(**opts).remote(
                path, config, rank, size, addr, port, spec.rejection_sampling, int(bundle.get("CPU", 1)), slots,
                speculation_ahead=ahead))
        # SYNC: construction only; waits for the model to load (a share too small for max_model_len raises here).
        ray.get([w.ping.remote() for w in self.group.workers], timeout=900.0)
        ray.get(self.rank0.set_peers.remote(self.group.workers[1:]))
        self._watch: asyncio.Task | None = None
        logger.info("draft replica %s: %s on %d rank(s), %d target slots", self.replica, path, size, slots)

    @property
    def rank0(self) -> Any:
        return self.group.workers[0]

    async def _watch_tenants(self) -> None:
        """Free the shares of targets whose router died, or that went silent (rank 0 checks the silence); then
        balance the pool's targets."""
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            try:
                owners = await self.rank0.tenant_owners.remote()
                dead = [tid for tid, owner in owners.items() if not await _alive(owner)]
                await self.rank0.evict.remote(self.tenant_timeout_s, dead)
                await self._balance()
            except Exception as e:  # noqa: BLE001 - a dead rank: the health check replaces this replica
                logger.warning("draft replica %s: tenant watch: %s", self.replica, e)

    async def _balance(self) -> None:
        """Ask one target to move when this replica holds two more (not counting those already asked) than
        another replica of the pool with room: each move then narrows the gap, and one ask at a time per replica
        keeps the targets from all leaving for the same new replica at once."""
        loads = {}
        for name, handle in await asyncio.to_thread(find_pool_ranks, self.pool):
            try:
                loads[name] = await asyncio.wait_for(handle.pool_load.remote(), 5.0)
            except Exception:  # noqa: BLE001 - starting, stopping or dead: not a place to move to
                continue
        mine = loads.pop(self.name, None)
        room = [load["tenants"] for load in loads.values() if not load["draining"] and load["tenants"] < load["slots"]]
        if mine is None or mine["draining"] or mine["moving"] or not room:
            return
        if mine["tenants"] - min(room) >= 2:
            await self.rank0.ask_to_move.remote(f"another draft replica of the pool has {min(room)} targets, "
                                                f"this one {mine['tenants']}")

    def _ensure_watch(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._watch_tenants())

    async def check_health(self) -> None:
        """Serve's health check: every rank answers (a dead one gets this replica replaced, with its group)."""
        self._ensure_watch()
        for rank, w in enumerate(self.group.workers):
            try:
                await asyncio.wait_for(w.ping.remote(), 10.0)
            except Exception as e:
                raise RuntimeError(f"draft replica {self.replica}: rank {rank} is dead or hung: {e}") from e

    async def health(self) -> dict[str, Any]:
        self._ensure_watch()
        try:
            await self.check_health()
        except RuntimeError as e:
            return {"healthy": False, "reason": str(e), "replica": self.replica}
        return {"healthy": True, "replica": self.replica, **await self.rank0.pool_load.remote()}

    async def metrics(self) -> tuple[str, str]:
        """(this replica's id, its exposition): the ingress merges them under `draft_replica`."""
        from serving.metrics import draft_pool_exposition

        self._ensure_watch()
        stats = await self.rank0.pool_stats.remote()
        return self.replica, draft_pool_exposition(stats["batch_tenants"])

    async def stats(self) -> dict[str, Any]:
        self._ensure_watch()
        return {"replica": self.replica, "name": self.name, **await self.rank0.pool_stats.remote()}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (called only with draft_autoscaling_config): the draft's busy
        fraction since the last call and its targets, for DraftBusyPolicy (serving/draft_pool/autoscaling.py)."""
        from serving.draft_pool.autoscaling import DRAFT_BUSY, DRAFT_TENANTS

        self._ensure_watch()
        stats = await self.rank0.pool_stats.remote()
        return {DRAFT_BUSY: self._busy.read(stats["busy_s"]), DRAFT_TENANTS: float(stats["tenants"])}

    def drain_and_release(self) -> bool:
        """Ask the targets to move to other replicas and wait for them (up to drain_timeout_s), then release the
        draft's ranks and their placement group. Whether every target left first."""
        group = getattr(self, "group", None)
        if group is None or not group.workers:
            return True
        left = False
        try:
            # SYNC: shutdown only.
            ray.get(self.rank0.set_draining.remote(), timeout=5.0)
            deadline = time.monotonic() + self.drain_timeout_s
            while not left and time.monotonic() < deadline:
                left = ray.get(self.rank0.pool_load.remote(), timeout=5.0)["tenants"] == 0  # SYNC: as above
                if not left:
                    time.sleep(0.2)
            if not left:
                logger.warning("draft replica %s: targets still attached after %.0f s; they go on without "
                               "speculation until they attach elsewhere", self.replica, self.drain_timeout_s)
        except Exception as e:  # noqa: BLE001 - a dead rank, or the interpreter going down: release anyway
            logger.warning("draft replica %s: draining: %s", self.replica, e)
        finally:
            self._release(group)
        return left

    def __del__(self) -> None:
        """Serve's scale-down or shutdown: drain (the targets move elsewhere), then release the group now. Serve
        calls this on the replica's event loop, which has nothing else left to do: it waits blocking."""
        self.drain_and_release()


async def _alive(actor: Any, timeout_s: float = 5.0) -> bool:
    """False only for an actor Ray reports dead; a busy one (no answer in time) counts as alive: the silence
    timeout catches one that hangs for good."""
    try:
        await asyncio.wait_for(actor.__ray_ready__.remote(), timeout_s)
    except ray.exceptions.RayActorError:
        return False
    except asyncio.TimeoutError:
        pass
    return True


def find_pool_ranks(pool: str) -> list[tuple[str, Any]]:
    """The pool's draft groups now alive, as (name, rank 0's handle), by name. In every namespace: a pool's name is
    its own (a uuid), and its replicas need not share the targets' namespace (Serve's, a driver's)."""
    prefix = pool_actor_prefix(pool)
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, namespace = entry.get("name", ""), entry.get("namespace")
        if name.startswith(prefix):
            try:
                found.append((name, ray.get_actor(name, namespace=namespace)))
            except ValueError:  # gone since it was listed
                continue
    return sorted(found, key=lambda f: f[0])


def attach_to_pool(pool: str, tenant_id: str, owner: Any, timeout_s: float,
                   exclude: str | None = None) -> tuple[str, Any, Any]:
    """Attach `tenant_id` to the pool's least-loaded live draft group that is not draining, waiting up to
    `timeout_s` for one with room (a replica starting or being replaced). exclude: a replica id not to attach to
    (the one a target moves away from). Returns (the draft replica's id, rank 0's handle,
    serving.draft_pool.worker.TenantShare)."""
    deadline = time.monotonic() + timeout_s
    last = "no draft replica of the pool is up"
    while True:
        loads = []
        for name, handle in find_pool_ranks(pool):
            if exclude is not None and name == pool_actor_prefix(pool) + exclude:
                continue
            try:
                # SYNC: attaching (construction or recovery), off the step path.
                load = ray.get(handle.pool_load.remote(), timeout=10.0)
            except Exception as e:  # noqa: BLE001 - starting, dead or hung: try the others
                last = f"{name}: {e}"
                continue
            if load["tenants"] < load["slots"] and not load.get("draining"):
                loads.append((load["tenants"], name, handle))
        for _, name, handle in sorted(loads, key=lambda x: (x[0], x[1])):
            try:
                # SYNC: as above.
                share = ray.get(handle.attach_tenant.remote(tenant_id, owner), timeout=30.0)
                return name.removeprefix(pool_actor_prefix(pool)), handle, share
            except Exception as e:  # noqa: BLE001 - filled up meanwhile, or died
                last = f"{name}: {e}"
        if time.monotonic() > deadline:
            raise RuntimeError(f"could not attach to draft pool {pool!r} within {timeout_s:.0f} s: {last}")
        time.sleep(0.5)
