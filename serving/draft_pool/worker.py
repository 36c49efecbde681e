"""One rank of a pooled draft group: a draft worker that several target engines use at once
(serving/draft_pool/pool.py).

Each attached target is a *tenant*: it gets a slot, hence a disjoint range of the draft's KV blocks
(serving/draft_pool/shares.py), and a request table of its own, over the group's one proposer (its CUDA graphs and
static buffers are captured once, not per target). A seeded request draws from generators of its seed and output
position, so its proposals are what a draft group of its own would have drafted, whichever tenants' requests share
its draft forward, as long as that forward takes the same path (on a GPU a grammar request of any tenant moves the
batch from the draft loop to the eager path, which draws differently); unseeded ones share the proposer's generator
(lossless either way). A tenant's calls carry its id; before anything reads a tenant's plan, its request ids are
put under the tenant's name (two targets may use the same request id, and process-wide state such as the grammar
matchers is keyed by it) and its draft block ids are moved into its range. Detaching a tenant (the target asked,
or died, or was not heard from for `tenant_timeout_s`) drops its table, hence every per-request state it held, and
frees its slot; its blocks need no clearing, since the next tenant's router starts with an empty KV manager and
writes a block before it reads it.

The routers call rank 0 only, which runs their calls in threads: each tenant's calls one at a time, in the order
its target made them (serving/draft_pool/tenant_calls.py), different tenants' at once. Draft steps of tenants that
wait at the same time run as one draft step over the union of their requests (continuous batching,
serving/draft_pool/batch.py):
each tenant's plan is resolved by its own table, the plans are merged (engine/step/plan_merge.py), the proposer
drafts for all of them in one forward, and the proposal is cut back into each tenant's. A tenant evicted while its
call waited for a batch, or whose plan its table cannot resolve, fails alone; the others' step runs. Rank 0
forwards every call that touches state (each batch whole, absorbs, attaches, detaches) to the other ranks before
running it itself, so that every rank runs the same batches in the same order (their collectives pair up); a rank
that died makes rank 0 exit too, so the group fails as a whole and its replica is replaced. With speculation ahead,
a target's `draft_speculate_ahead` (after its proposal) drafts ahead for every target of its draft step at once, and
each target's windows stay its own (serving/draft_pool/ahead.py).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorHandle

from engine.config import EngineConfig
from engine.sample import grammar_matchers
from engine.step.phases import HOST
from engine.step.plan import StepPlan, StepResult
from engine.step.plan_merge import merge_plans, split_proposal
from engine.step.request_table import RequestTable
from serving.draft_pool.ahead import PoolAhead
from serving.draft_pool.batch import DraftBatcher
from serving.draft_pool.shares import BlockShare, check_share_fits
from serving.draft_pool.tenant_calls import CallOrder, CallSequence, TenantCall, TenantGone, unbox
from serving.workers.worker import DraftOutput, ModelWorker

logger = logging.getLogger("specserve")

__all__ = ["PooledDraftWorker", "TenantDraft", "TenantGone", "TenantShare", "rank0_concurrency"]

# How long a tenant's call waits for the call before it in its target's order (serving/draft_pool/tenant_calls.py),
# and for the target's result an absorb carries: past the longest step a target may take (the executor's
# step_timeout_s).
TURN_TIMEOUT_S = 300.0
# How long a tenant asked to move counts as moving: one that has not left by then (it found no room elsewhere, or
# its router is busy recovering) may be asked again, or another in its place.
MOVE_ASK_TIMEOUT_S = 30.0


def rank0_concurrency(slots: int) -> int:
    """Threads of rank 0: per target, its calls of two steps in flight (a draft step and an absorb each) and a ping
    or a detach; and the replica's own calls (stats, load, eviction, health)."""
    return 6 * slots + 8


@dataclass
class Tenant:
    share: BlockShare
    table: RequestTable  # what the draft knows of the tenant's requests, under their ids in the group
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
    # The group drafts ahead: the target calls `draft_speculate_ahead` after each proposal.
    speculation_ahead: bool = False


class PooledDraftWorker(ModelWorker):
    """A draft rank serving the tenants' calls (`tenant_*`), drafting ahead for them where `speculation_ahead`
    (serving/draft_pool/ahead.py)."""

    def __init__(self, model_path: str, engine_config: EngineConfig | dict[str, Any], rank: int, world_size: int,
                 master_addr: str, master_port: int, rejection_sampling: str | None, cpu_threads: int,
                 slots: int, speculation_ahead: bool = False) -> None:
        super().__init__("draft", model_path, engine_config, rank, world_size, master_addr, master_port,
                         rejection_sampling, cpu_threads, speculation_ahead=speculation_ahead)
        # The side ModelWorker built: its proposer drafts for every tenant; the tenants keep tables of their own.
        self.base_side, self.draft_side = self.draft_side, None
        # Speculation ahead: one AheadProposer for every tenant (its scratch reserved once, sized for the pool's
        # batch), each tenant's windows kept apart by its name (AheadProposer.use_scopes).
        self.pool_ahead = PoolAhead(self.base_side.ahead)
        self.slots = slots
        self.blocks_per_slot = check_share_fits(self.runner.num_blocks, slots, self.config.block_size,
                                                self.config.max_model_len)
        self.tenants: dict[str, Tenant] = {}
        self.peers: list[ActorHandle] = []  # ranks 1.. (rank 0 only)
        self.evicted: list[str] = []  # why tenants were dropped, newest last (bounded)
        self.draining = False  # Serve is stopping this replica: its tenants are asked to move, none may attach
        self.move_asked: dict[str, tuple[str, float]] = {}  # tenants asked to move: (why, time.monotonic())
        self.order = CallOrder()
        self.batcher: DraftBatcher[tuple[str, StepPlan]] = DraftBatcher(self._run_batch, self.config.max_num_seqs)

    # --- the group ------------------------------------------------------------------------------------
    def set_peers(self, peers: list[ActorHandle]) -> None:
        self.peers = list(peers)

    def _forward(self, method: str, *args: Any) -> list[Any]:
        return [getattr(p, method).remote(*args) for p in self.peers]

    def _join(self, refs: list[Any]) -> list[Any]:
        try:
            # SYNC: the other ranks' share of this call; they run it in the order rank 0 forwarded it.
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            logger.error("a draft pool rank died (%s); ending rank 0 so that the group is replaced whole", e)
            os._exit(1)

    def pool_load(self) -> dict[str, Any]:
        """For a router choosing a draft replica, and the replicas balancing their targets: slots taken and free,
        whether it drains, and how many of its tenants were asked to move and have not yet."""
        now = time.monotonic()
        moving = sum(1 for tid, (_, t) in dict(self.move_asked).items()
                     if tid in self.tenants and now - t < MOVE_ASK_TIMEOUT_S)
        return {"tenants": len(self.tenants), "slots": self.slots, "blocks_per_slot": self.blocks_per_slot,
                "draining": self.draining, "moving": moving}

    def pool_stats(self) -> dict[str, Any]:
        """The load, the tenants, why tenants left, `batch_tenants` ({tenants in a draft forward: forwards}) and
        `busy_s` (seconds spent in draft forwards in all)."""
        now = time.monotonic()
        tenants = dict(self.tenants)
        return {**self.pool_load(), "evicted": list(self.evicted), "batch_tenants": dict(self.batcher.stats.sizes),
                "busy_s": self.batcher.stats.busy_s, "speculation_ahead": self.pool_ahead.totals(),
                "by_tenant": {tid: {"slot": t.share.slot, "idle_s": now - t.last_seen, "steps": t.num_steps,
                                    "requests": len(t.table.requests), **self.pool_ahead.tenant_stats(tid)}
                              for tid, t in tenants.items()}}

    # --- tenancy (under the batcher's lock: never while a batch runs) ---------------------------------
    def attach_tenant(self, tenant_id: str, owner: ActorHandle | None = None, slot: int | None = None) -> TenantShare:
        """Give `tenant_id` a free slot (rank 0 picks it and hands it to the others). RuntimeError when full."""
        with self.batcher.lock:
            if self.draining and slot is None:
                raise RuntimeError("this draft replica is stopping")
            if tenant_id in self.tenants:
                self._drop(tenant_id, "attached again")
            if slot is None:
                taken = {t.share.slot for t in self.tenants.values()}
                free = [s for s in range(self.slots) if s not in taken]
                if not free:
                    raise RuntimeError(f"this draft replica serves {self.slots} target engines already")
                slot = free[0]
            refs = self._forward("attach_tenant", tenant_id, None, slot)
            self.tenants[tenant_id] = Tenant(BlockShare(slot, self.blocks_per_slot), RequestTable(), owner,
                                             time.monotonic())
            self.order.open(tenant_id)
            self._join(refs)
        logger.info("draft pool: target %s attached in slot %d (%d blocks)", tenant_id, slot, self.blocks_per_slot)
        return TenantShare(tenant_id, slot, self.blocks_per_slot + 1, self.runner.kv_groups, self.runner.vocab_size,
                           self.pool_ahead.on)

    def detach_tenant(self, tenant_id: str, why: str = "detached") -> bool:
        """Drop a tenant's state and free its slot; False if it was not attached."""
        with self.batcher.lock:
            refs = self._forward("detach_tenant", tenant_id, why)
            found = self._drop(tenant_id, why)
            self._join(refs)
        return found

    def _drop(self, tenant_id: str, why: str) -> bool:
        self.order.close(tenant_id)
        self.move_asked.pop(tenant_id, None)
        tenant = self.tenants.pop(tenant_id, None)
        if tenant is None:
            return False
        grammar_matchers.forget(list(tenant.table.requests))  # ids under the tenant's name
        self.pool_ahead.forget(tenant_id)  # its windows, their scratch blocks, its counters
        self.evicted = (self.evicted + [f"{tenant_id}: {why}"])[-32:]
        logger.info("draft pool: target %s left slot %d: %s", tenant_id, tenant.share.slot, why)
        return True

    # --- placement: tenants asked to move to another replica of the pool -------------------------------
    def set_draining(self) -> None:
        """Serve is stopping this replica: every tenant is asked to move, and no target may attach any more."""
        self.draining = True

    def ask_to_move(self, why: str) -> str | None:
        """Ask one tenant to move to another replica (the pool's balance, serving/draft_pool/pool.py): the one with the
        fewest requests, whose draft state is the cheapest to rebuild there. Its id, or None if none is left
        to ask."""
        now = time.monotonic()
        candidates = [(len(t.table.requests), tid) for tid, t in dict(self.tenants).items()
                      if tid not in self.move_asked or now - self.move_asked[tid][1] >= MOVE_ASK_TIMEOUT_S]
        if not candidates:
            return None
        tid = min(candidates)[1]
        self.move_asked[tid] = (why, now)
        logger.info("draft pool: asking target %s to move to another draft replica: %s", tid, why)
        return tid

    def tenant_placement(self, tenant_id: str) -> str | None:
        """Polled by each attached target (serving/router/draft_moves.py): why it should move to another replica of the
        pool (this one drains, or holds more targets than another), or None to stay."""
        if self.draining:
            return "its draft replica is stopping"
        asked = self.move_asked.get(tenant_id)
        if asked is not None and tenant_id in self.tenants and time.monotonic() - asked[1] < MOVE_ASK_TIMEOUT_S:
            return asked[0]
        return None

    def tenant_owners(self) -> dict[str, ActorHandle]:
        """Each tenant's router actor, where it gave one: the replica's watch loop probes them."""
        return {tid: t.owner for tid, t in dict(self.tenants).items() if t.owner is not None}

    def evict(self, timeout_s: float, dead: list[str] | None = None) -> list[str]:
        """Detach the tenants whose router the watch loop found dead (`dead`) and those not heard from for
        `timeout_s` (rank 0; the probes run in the replica, so that this rank's steps never wait on them)."""
        now = time.monotonic()
        tenants = dict(self.tenants)
        gone = {tid: "its router died" for tid in dead or () if tid in tenants}
        gone.update({tid: f"not heard from for {now - t.last_seen:.0f} s" for tid, t in tenants.items()
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

    # --- a tenant's step (the calls of serving/workers/step_topology.py, with the tenant's id and order first) -----
    def tenant_ping(self, tenant_id: str) -> tuple[str, int, int]:
        self._tenant(tenant_id)
        return self.ping()

    def tenant_draft_step(self, tenant_id: str, seq: int, plan: StepPlan) -> DraftOutput | None:
        """Rank 0: the tenant's proposal, from the next draft step that has room for its plan (drafting for every
        tenant waiting with it)."""
        self._tenant(tenant_id)
        with self.order.turn(tenant_id, seq, TURN_TIMEOUT_S):
            return self.batcher.submit((tenant_id, plan), len(plan.requests))

    def tenant_absorb(self, tenant_id: str, seq: int, result: Any) -> None:
        """Rank 0: the target's result of the tenant's last step (boxed: it is waited for here, in turn)."""
        self._tenant(tenant_id)
        with self.order.turn(tenant_id, seq, TURN_TIMEOUT_S):
            result = unbox(result, TURN_TIMEOUT_S)
            if result is None:
                raise RuntimeError("tenant_absorb() needs target rank 0's result")
            refs = self._forward("peer_absorb", tenant_id, result)
            self.peer_absorb(tenant_id, result)
            self._join(refs)

    def tenant_speculate_ahead(self, tenant_id: str, seq: int) -> None:
        """Rank 0: speculation ahead, after the tenant's proposal went out: draft ahead for the draft step it was
        part of, for every tenant of that step at once (serving/draft_pool/ahead.py); nothing if another of them,
        or the next draft step, already did."""
        self._tenant(tenant_id)
        with self.order.turn(tenant_id, seq, TURN_TIMEOUT_S), self.batcher.lock:
            refs = self._forward("peer_speculate_ahead")
            self.peer_speculate_ahead()
            self._join(refs)

    def peer_speculate_ahead(self) -> None:
        """Every rank: the pending pre-draft, in the order rank 0 ran it."""
        self.pool_ahead.run_pending()

    def peer_absorb(self, tenant_id: str, result: StepResult) -> None:
        """Every rank: record the result in the tenant's table (only the tenant's own calls touch its table)."""
        self._tenant(tenant_id).table.record(result)

    def _run_batch(self, calls: list[tuple[str, StepPlan]]) -> list[Any]:
        """Rank 0 (under the batcher's lock): forward the batch to the other ranks, then run it here too."""
        refs = self._forward("peer_draft_batch", calls)
        outcomes = self.peer_draft_batch(calls)
        self._join(refs)  # the same outcomes, from the same tables and the same collectives: rank 0's are returned
        return outcomes

    def peer_draft_batch(self, calls: list[tuple[str, StepPlan]]) -> list[Any]:
        """Every rank: one draft step for the tenants' plans; per call its DraftOutput (None off rank 0) or the
        exception it alone failed with. A merged step that fails runs each plan alone, so that one tenant's bad
        plan fails only that tenant (every rank fails alike, and retries alike)."""
        t0 = time.perf_counter()
        outcomes: list[Any] = [None] * len(calls)
        parts: list[tuple[int, str, StepPlan]] = []
        for i, (tenant_id, plan) in enumerate(calls):
            try:
                tenant = self._tenant(tenant_id)
                tenant.num_steps += 1
                parts.append((i, tenant_id, tenant.table.resolve(self._own_plan(tenant_id, tenant, plan))))
            except Exception as e:  # noqa: BLE001 - evicted while it waited, or a plan its table cannot resolve
                outcomes[i] = e
        if not parts:
            return outcomes
        try:
            self._propose(parts, outcomes, t0)
        except Exception:  # noqa: BLE001
            if len(parts) == 1:
                raise
            logger.warning("draft pool: a batch of %d targets failed; drafting for each alone", len(parts))
            for part in parts:
                try:
                    self._propose([part], outcomes, time.perf_counter())
                except Exception as e:  # noqa: BLE001 - this tenant's alone
                    outcomes[part[0]] = e
        return outcomes

    def _propose(self, parts: list[tuple[int, str, StepPlan]], outcomes: list[Any], t0: float) -> None:
        """Draft for resolved plans (row, tenant, plan) in one step; rank 0 puts each one's DraftOutput at its row
        of `outcomes`."""
        merged = merge_plans([p for *_, p in parts])
        tenants = [tid for _, tid, _ in parts]
        proposal = self.pool_ahead.propose(self.base_side, merged.plan, tenants)
        if self.rank != 0:
            return
        proposal = proposal.to_host([r.num_draft_tokens for r in merged.plan.requests])
        now = time.perf_counter()
        for (i, tid, _), part in zip(parts, split_proposal(proposal, merged)):
            outcomes[i] = DraftOutput(part, now - t0, now, HOST, self.pool_ahead.tenant_totals(tid),
                                      self.pool_ahead.take_window(tid))


class TenantDraft:
    """A target executor's view of its share of a pooled draft group: the one "draft worker" of its step
    (serving/workers/step_topology.py calls `draft_step` and `draft_absorb` on it), pinged for health, and released by
    detaching (never killed: the group serves other targets)."""

    def __init__(self, worker: ActorHandle, share: TenantShare, pool_name: str, replica: str) -> None:
        """replica: the draft replica's id (the `draft_replica` label of this target's draft metrics)."""
        self.worker, self.share, self.pool_name, self.replica = worker, share, pool_name, replica
        self._actor_id = worker._actor_id
        sequence = CallSequence()  # the order of this target's step calls (serving/draft_pool/tenant_calls.py)
        self.draft_step = TenantCall(worker, "tenant_draft_step", share.tenant_id, sequence)
        self.draft_absorb = TenantCall(worker, "tenant_absorb", share.tenant_id, sequence)
        self.draft_speculate_ahead = TenantCall(worker, "tenant_speculate_ahead", share.tenant_id, sequence)
        self.ping = TenantCall(worker, "tenant_ping", share.tenant_id, None)

    def release(self) -> None:
        """Detach (best effort: a dead group frees nothing, and its replacement never knew this tenant)."""
        try:
            self.worker.detach_tenant.remote(self.share.tenant_id, "its target detached")
        except Exception as e:  # noqa: BLE001
            logger.warning("detaching from draft pool %s: %s", self.pool_name, e)
