"""One rank of a pooled draft group: a draft worker that several target engines use at once (serving/draft_pool.py).

Each attached target is a *tenant*: it gets a slot, hence a disjoint range of the draft's KV blocks
(serving/draft_shares.py), and a DraftSide of its own: its own request table, over the group's one proposer (its
CUDA graphs and static buffers are captured once, not per target). A seeded request draws from generators of its
seed and output position, so its proposals are what a draft group of its own would have drafted; unseeded ones
share the proposer's generator (lossless either way). A tenant's calls carry its id; before
anything reads a tenant's plan, its request ids are put under the tenant's name (two targets may use the same
request id, and process-wide state such as the grammar matchers is keyed by it) and its draft block ids are moved
into its range. Detaching a tenant (the target asked, or died, or was not heard from for `tenant_timeout_s`)
drops its side, hence every per-request state it held, and frees its slot; its blocks need no clearing, since the
next tenant's router starts with an empty KV manager and writes a block before it reads it.

The routers call rank 0 only. Rank 0 forwards each call to the other ranks before running it itself, so that
every rank runs every tenant's calls in the same order (their collectives pair up), whichever routers sent them;
a rank that died makes rank 0 exit too, so the group fails as a whole and its replica is replaced. Calls of
different tenants run one after another; batching them into one draft forward is not built yet.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorHandle

from engine.config import EngineConfig
from engine.sample import grammar_matchers
from engine.speculation.speculative_step import DraftSide
from engine.step.plan import StepPlan, StepResult
from engine.step.request_table import RequestTable
from serving.draft_shares import BlockShare, check_share_fits
from serving.worker import DraftOutput, ModelWorker

logger = logging.getLogger("specserve")


class TenantGone(RuntimeError):
    """A call for a tenant this draft group does not hold (never attached, detached or evicted)."""


@dataclass
class Tenant:
    share: BlockShare
    side: DraftSide
    owner: ActorHandle | None  # the target's router actor, when it has one: checked for liveness
    last_seen: float  # time.monotonic() of its last call
    num_steps: int = 0


@dataclass
class TenantShare:
    """What an attached target builds its draft KV manager from."""

    tenant_id: str
    slot: int
    num_blocks: int  # its share, the null block included (local ids 0..num_blocks-1)
    kv_groups: list[Any]  # the draft's KVCacheGroupSpecs
    vocab_size: int


class PooledDraftWorker(ModelWorker):
    """A draft rank serving the tenants' calls (`tenant_*`). Speculation ahead stays off: its scratch blocks are
    reserved per proposer, outside any tenant's share."""

    def __init__(self, model_path: str, engine_config: EngineConfig | dict[str, Any], rank: int, world_size: int,
                 master_addr: str, master_port: int, rejection_sampling: str | None, cpu_threads: int,
                 slots: int) -> None:
        super().__init__("draft", model_path, engine_config, rank, world_size, master_addr, master_port,
                         rejection_sampling, cpu_threads)
        # The side ModelWorker built: its proposer serves every tenant; tenants' sides are copies with their own table.
        self.base_side, self.draft_side = self.draft_side, None
        self.slots = slots
        self.blocks_per_slot = check_share_fits(self.runner.num_blocks, slots, self.config.block_size,
                                                self.config.max_model_len)
        self.tenants: dict[str, Tenant] = {}
        self.peers: list[ActorHandle] = []  # ranks 1.. (rank 0 only)
        self.evicted: list[str] = []  # why tenants were dropped, newest last (bounded)

    # --- the group ------------------------------------------------------------------------------------
    def set_peers(self, peers: list[ActorHandle]) -> None:
        self.peers = list(peers)

    def _forward(self, method: str, *args: Any) -> list[Any]:
        return [getattr(p, method).remote(*args) for p in self.peers]

    def _join(self, refs: list[Any]) -> None:
        try:
            # SYNC: the other ranks' share of this call; they run it in the order rank 0 forwarded it.
            ray.get(refs)
        except ray.exceptions.RayActorError as e:
            logger.error("a draft pool rank died (%s); ending rank 0 so that the group is replaced whole", e)
            os._exit(1)

    def pool_load(self) -> dict[str, Any]:
        """For a router choosing a draft replica: slots taken and free."""
        return {"tenants": len(self.tenants), "slots": self.slots, "blocks_per_slot": self.blocks_per_slot}

    def pool_stats(self) -> dict[str, Any]:
        now = time.monotonic()
        return {**self.pool_load(), "evicted": list(self.evicted),
                "by_tenant": {tid: {"slot": t.share.slot, "idle_s": now - t.last_seen, "steps": t.num_steps,
                                    "requests": len(t.side.table.requests)} for tid, t in self.tenants.items()}}

    # --- tenancy --------------------------------------------------------------------------------------
    def attach_tenant(self, tenant_id: str, owner: ActorHandle | None = None, slot: int | None = None) -> TenantShare:
        """Give `tenant_id` a free slot (rank 0 picks it and hands it to the others). RuntimeError when full."""
        if tenant_id in self.tenants:
            self._drop(tenant_id, "attached again")
        if slot is None:
            taken = {t.share.slot for t in self.tenants.values()}
            free = [s for s in range(self.slots) if s not in taken]
            if not free:
                raise RuntimeError(f"this draft replica serves {self.slots} target engines already")
            slot = free[0]
        refs = self._forward("attach_tenant", tenant_id, None, slot)
        side = copy.copy(self.base_side)
        side.table, side._proposed = RequestTable(), None
        self.tenants[tenant_id] = Tenant(BlockShare(slot, self.blocks_per_slot), side, owner, time.monotonic())
        self._join(refs)
        logger.info("draft pool: target %s attached in slot %d (%d blocks)", tenant_id, slot, self.blocks_per_slot)
        return TenantShare(tenant_id, slot, self.blocks_per_slot + 1, self.runner.kv_groups, self.runner.vocab_size)

    def detach_tenant(self, tenant_id: str, why: str = "detached") -> bool:
        """Drop a tenant's state and free its slot; False if it was not attached."""
        refs = self._forward("detach_tenant", tenant_id, why)
        found = self._drop(tenant_id, why)
        self._join(refs)
        return found

    def _drop(self, tenant_id: str, why: str) -> bool:
        tenant = self.tenants.pop(tenant_id, None)
        if tenant is None:
            return False
        grammar_matchers.forget(list(tenant.side.table.requests))  # ids under the tenant's name
        self.evicted = (self.evicted + [f"{tenant_id}: {why}"])[-32:]
        logger.info("draft pool: target %s left slot %d: %s", tenant_id, tenant.share.slot, why)
        return True

    def tenant_owners(self) -> dict[str, ActorHandle]:
        """Each tenant's router actor, where it gave one: the replica's watch loop probes them."""
        return {tid: t.owner for tid, t in self.tenants.items() if t.owner is not None}

    def evict(self, timeout_s: float, dead: list[str] | None = None) -> list[str]:
        """Detach the tenants whose router the watch loop found dead (`dead`) and those not heard from for
        `timeout_s` (rank 0; the probes run in the replica, so that this rank's steps never wait on them)."""
        now = time.monotonic()
        gone = {tid: "its router died" for tid in dead or () if tid in self.tenants}
        gone.update({tid: f"not heard from for {now - t.last_seen:.0f} s" for tid, t in self.tenants.items()
                     if tid not in gone and now - t.last_seen > timeout_s})
        for tid, why in gone.items():
            self.detach_tenant(tid, why)
        return list(gone)

    def _tenant(self, tenant_id: str) -> Tenant:
        tenant = self.tenants.get(tenant_id)
        if tenant is None:
            raise TenantGone(f"target {tenant_id} is not attached to this draft replica (detached or evicted)")
        tenant.last_seen = time.monotonic()
        return tenant

    def _own_plan(self, tenant_id: str, tenant: Tenant, plan: StepPlan) -> StepPlan:
        """The plan with the tenant's request ids and block ids as this group keys them (in place: every call
        brings its own copy of the plan)."""
        share = tenant.share
        for p in plan.requests:
            p.request_id = f"{tenant_id}/{p.request_id}"
            p.draft_block_tables = [share.to_global(t) for t in p.draft_block_tables]
        plan.finished_ids = [f"{tenant_id}/{rid}" for rid in plan.finished_ids]
        return plan

    # --- a tenant's step (the calls of serving/step_topology.py, with the tenant's id first) ----------------
    def tenant_ping(self, tenant_id: str) -> tuple[str, int, int]:
        self._tenant(tenant_id)
        return self.ping()

    def tenant_draft_step(self, tenant_id: str, plan: StepPlan) -> DraftOutput | None:
        tenant = self._tenant(tenant_id)
        refs = self._forward("tenant_draft_step", tenant_id, plan)
        tenant.num_steps += 1
        self.draft_side = tenant.side
        try:
            out = self.draft_step(self._own_plan(tenant_id, tenant, plan))
        finally:
            self.draft_side = None
        self._join(refs)
        return out

    def tenant_absorb(self, tenant_id: str, result: StepResult | None) -> None:
        tenant = self._tenant(tenant_id)
        refs = self._forward("tenant_absorb", tenant_id, result)
        if result is None:
            raise RuntimeError("tenant_absorb() needs target rank 0's result")
        tenant.side.absorb(result)
        self._join(refs)


class TenantCall:
    """A pooled rank's `tenant_<method>` with the tenant's id bound, as step_topology calls a worker method."""

    def __init__(self, worker: ActorHandle, method: str, tenant_id: str) -> None:
        self._method = getattr(worker, method)
        self._tenant_id = tenant_id

    def remote(self, *args: Any) -> Any:
        return self._method.remote(self._tenant_id, *args)


class TenantDraft:
    """A target executor's view of its share of a pooled draft group: the one "draft worker" of its step
    (serving/step_topology.py calls `draft_step` and `draft_absorb` on it), pinged for health, and released by
    detaching (never killed: the group serves other targets)."""

    def __init__(self, worker: ActorHandle, share: TenantShare, pool_name: str, replica: str) -> None:
        """replica: the draft replica's id (the `draft_replica` label of this target's draft metrics)."""
        self.worker, self.share, self.pool_name, self.replica = worker, share, pool_name, replica
        self._actor_id = worker._actor_id
        self.draft_step = TenantCall(worker, "tenant_draft_step", share.tenant_id)
        self.draft_absorb = TenantCall(worker, "tenant_absorb", share.tenant_id)
        self.ping = TenantCall(worker, "tenant_ping", share.tenant_id)

    def release(self) -> None:
        """Detach (best effort: a dead group frees nothing, and its replacement never knew this tenant)."""
        try:
            self.worker.detach_tenant.remote(self.share.tenant_id, "its target detached")
        except Exception as e:  # noqa: BLE001
            logger.warning("detaching from draft pool %s: %s", self.pool_name, e)
