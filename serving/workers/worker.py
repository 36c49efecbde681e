"""One tensor-parallel rank of one model (the target or the draft) as a Ray actor.

`ModelWorker` is a plain class; whoever creates it applies `ray.remote(...)` with the resources and
placement it needs (serving/workers/ray_executor.py does, tests may set other options). Each worker joins its
model's torch.distributed group, installs it as the engine's tensor-parallel group BEFORE the model is
built (the parallel layers read the group at construction to size their shards), then builds the
ModelRunner and its side of the speculation step (engine/speculation/speculative_step.py): a DraftSide (role "draft") or
a TargetSide (role "target"). The step methods below are thin wrappers over the side, adding what crosses
processes: the proposal as host lists with its timing (`DraftOutput`), and the target's result for the draft's
table. A target rank may also hold the draft (RayExecutor's draft_placement "colocated"): it then builds the
draft's runner after its own, on the same device and tensor-parallel group, and runs whole steps (`spec_step`).

Every rank runs the same plan with the same sampling: generators are seeded alike, and the logits are
all-gathered (all-reduce and all-gather hand every rank the same bits), so every rank draws the same
tokens and the ranks never diverge. Only rank 0's return
value is used; the other ranks return None from the step methods to keep the messages back small.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.config import EngineConfig, resolve_dtype
from engine.decode_pipeline import DecodePipeline
from engine.gc_heap import freeze_startup_heap
from engine.kv_cache.spec import KVCacheGroupSpec
from engine.model_config import ModelConfig
from engine.models.eagle3_config import is_eagle3_checkpoint
from engine.parallel import TensorParallelGroup, set_tp_group
from engine.runner.model_runner import ModelRunner
from engine.speculation.ahead.proposer import AheadProposer
from engine.speculation.eagle3_proposer import Eagle3Proposer
from engine.speculation.speculative_step import DraftSide, SpeculativeStep, TargetSide
from engine.speculation.verifier import VerifyInput
from engine.step.phases import HOST, book_between, book_remote_proposal
from engine.step.plan import StepPlan, StepResult
from engine.step.proposal import DraftProposal
from engine.step.request_table import RequestTable
from serving.thread_switch import set_gil_switch_interval
from serving.workers.step_topology import graph_node

ROLES = ("target", "draft")
# Generous: rank 0 waits here for the other ranks' processes to start and import torch. It is also every
# collective's timeout: a rank whose peer died mid-step errors out after it instead of hanging forever.
_RENDEZVOUS_TIMEOUT = timedelta(minutes=5)


@dataclass
class WorkerInfo:
    """What the router needs from a model's workers to build its KV managers (same on every rank)."""

    role: str
    kv_groups: list[KVCacheGroupSpec]
    num_blocks: int
    vocab_size: int
    world_size: int
    device: str
    node_ip: str
    pid: int
    # A draft colocated in the target's ranks (RayExecutor's draft_placement "colocated"): its KV caches.
    draft_kv_groups: list[KVCacheGroupSpec] | None = None
    draft_num_blocks: int = 0
    gc_frozen: int = 0  # objects frozen out of garbage collection at start (engine/gc_heap.py)
    # What the rank's weights hold, {"bytes", "format"} (engine/quantization.weights_summary), and its colocated
    # draft's.
    weights: dict[str, Any] | None = None
    draft_weights: dict[str, Any] | None = None


@dataclass
class DraftOutput:
    """What draft rank 0 hands to the target ranks through the graph: the proposal (ids as host lists), its wall
    time, and when and where it was sent (perf_counter is the host's monotonic clock: comparable between processes
    of one host). Small on purpose: it is serialized on the draft's worker and read on the target's while the
    step waits."""

    proposal: DraftProposal
    seconds: float
    sent_at: float
    host: str
    speculation_ahead_totals: tuple[int, ...] | None = None  # the rank's (StepResult.speculation_ahead_totals)
    # its last run ahead, (rows, seconds) (StepResult.speculation_ahead_window)
    speculation_ahead_window: tuple[int, float] | None = None


def engine_config_from(config: EngineConfig | dict[str, Any]) -> EngineConfig:
    """An EngineConfig from itself or from a plain dict (device/dtype as strings are fine)."""
    if isinstance(config, EngineConfig):
        return config
    fields = dict(config)
    device = torch.device(fields.pop("device", "cpu"))
    dtype = resolve_dtype(fields.pop("dtype", None), device)
    return EngineConfig(device=device, dtype=dtype, **fields)


def _load_runner(model_path: str, config: EngineConfig, name: str, draft: bool,
                 target: ModelConfig | None = None) -> ModelRunner:
    """target: the target's config, where the draft is colocated with it (an EAGLE-3 head's config reads it)."""
    if draft and target is not None and is_eagle3_checkpoint(model_path):
        from engine.models.eagle3_config import Eagle3ModelConfig

        return ModelRunner(Eagle3ModelConfig.from_head(model_path, target), config, name)
    model_config = ModelConfig.from_path(model_path)
    model_config.max_model_len = config.max_model_len
    return ModelRunner(model_config, config, name, draft_token_map=config.draft_token_map if draft else None)


def node_ip_and_free_port() -> tuple[str, int]:
    """This node's IP and a TCP port free right now, for rank 0's rendezvous.

    Run as a task on the node of rank 0's bundle. The port is released before rank 0 binds it, so another
    process could take it in between; the window is short and a clash fails loudly at init.
    """
    import ray

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


class ModelWorker:
    """One rank of the target or the draft model: its side of the step (engine/speculation/speculative_step.py) behind
    the compiled graph's nodes, which add only what crosses processes."""

    def __init__(self, role: str, model_path: str, engine_config: EngineConfig | dict[str, Any], rank: int = 0,
                 world_size: int = 1, master_addr: str = "127.0.0.1", master_port: int = 0,
                 rejection_sampling: str | None = None, cpu_threads: int = 1,
                 launch_verify_ahead: bool = False, speculation_ahead: bool = False,
                 draft_model_path: str | None = None, target_model_path: str | None = None,
                 head_aux_layers: tuple[int, ...] | None = None) -> None:
        """draft_model_path (role "target" only): a draft colocated in this rank's process, on its device and
        tensor-parallel group; the rank then runs whole steps (`spec_step`), as the in-process engine does. An EAGLE-3
        head on workers of its own: its ranks (role "draft") take the target's checkpoint (target_model_path: its
        config, and its embedding where the head has none), and the target's ranks the head's auxiliary layers
        (head_aux_layers), whose states rank 0 sends with each result."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if draft_model_path is not None and role != "target":
            raise ValueError("only a target worker takes a colocated draft")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the group of {world_size}")
        self.role, self.rank, self.world_size = role, rank, world_size
        set_gil_switch_interval()
        config = engine_config_from(engine_config)
        if config.device.type == "cuda":
            # Ray gives the actor one GPU through CUDA_VISIBLE_DEVICES: it is cuda:0 in here.
            torch.cuda.set_device(0)
            config = dataclasses.replace(config, device=torch.device("cuda", 0))
        else:
            # The machine's cores are shared by every rank of both models: one intra-op pool each, sized
            # to the CPUs of the actor's bundle, not to the whole machine.
            torch.set_num_threads(max(1, cpu_threads))
        self.config = config
        set_tp_group(self._init_distributed(master_addr, master_port))
        head_target = None
        if role == "draft" and is_eagle3_checkpoint(model_path):
            if target_model_path is None:
                raise ValueError("an EAGLE-3 head's worker needs the target's checkpoint (target_model_path)")
            head_target = ModelConfig.from_path(target_model_path)
            head_target.max_model_len = config.max_model_len
        self.runner = _load_runner(model_path, config, f"{role}[{rank}/{world_size}]", draft=role == "draft",
                                   target=head_target)
        # A colocated draft is built right after the target, as the in-process engine builds them: each sizes its
        # KV cache from the device memory the one before left. Both use the tensor-parallel group set above.
        self.draft_runner = (_load_runner(draft_model_path, config, f"draft[{rank}/{world_size}]", draft=True,
                                          target=self.runner.model_config)
                             if draft_model_path is not None else None)
        keep_probs = rejection_sampling == "probabilistic"
        # Each side keeps what this rank knows of its requests between steps in its request table: open plan
        # entries (asynchronous scheduling) are resolved from it. Every rank of both models keeps the same table.
        self.draft_side: DraftSide | None = None
        self.target_side: TargetSide | None = None
        self.spec: SpeculativeStep | None = None  # both sides in this process (a colocated draft), one table
        if role == "draft":
            proposer = (Eagle3Proposer(self.runner, None, keep_probs, config.seed, target_model_path)
                        if head_target is not None else None)
            self.draft_side = DraftSide(self.runner, keep_probs, config.seed, speculation_ahead, proposer=proposer)
        elif self.draft_runner is not None:
            self.spec = SpeculativeStep.build(self.runner, self.draft_runner, keep_probs, config.seed,
                                              speculation_ahead)
            self.target_side, self.draft_side = self.spec.target, self.spec.draft
        else:
            # A head on workers of its own reads the states of every target forward: kept before the graphs are
            # captured (by the verifier), sent by rank 0 with each result.
            ship = (Eagle3Proposer.ship_target_states(self.runner, tuple(head_aux_layers))
                    if head_aux_layers is not None else None)
            # Queue each verify forward before the draft's ids come (Verifier.enable_gated_launch): only where
            # graphs replay on CUDA, so it stays off on CPU and under enforce_eager whatever was asked.
            self.target_side = TargetSide(self.runner, config.seed, gated_launch=launch_verify_ahead)
            if ship is not None and rank == 0:
                self.target_side.verifier.on_forward = ship
        # A target without a draft queues each step before reading the last one's tokens (`target_decode`).
        self.pipeline: DecodePipeline | None = None
        self._returned_at = 0.0  # when `spec_step` last returned a result (rank 0): the `between` phase
        self.gc_frozen = freeze_startup_heap(f"{role}[{rank}/{world_size}]")  # models loaded, graphs captured

    def _init_distributed(self, master_addr: str, master_port: int) -> TensorParallelGroup:
        if self.world_size == 1:
            return TensorParallelGroup()  # collectives are the identity; no process group needed
        backend = "nccl" if self.config.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                world_size=self.world_size, timeout=_RENDEZVOUS_TIMEOUT)
        # One process per rank of one model: the world group is the tensor-parallel group.
        return TensorParallelGroup(self.rank, self.world_size, dist.group.WORLD)

    # --- what tests and the executor read -------------------------------------------------------------
    @property
    def table(self) -> RequestTable:
        side = self.target_side if self.target_side is not None else self.draft_side
        assert side is not None
        return side.table

    @property
    def ahead(self) -> AheadProposer | None:
        return self.draft_side.ahead if self.draft_side is not None else None

    @property
    def launch_verify_ahead(self) -> bool:
        return self.target_side is not None and self.target_side.gated_launch

    @property
    def num_prepared_ahead(self) -> int:
        return self.target_side.num_prepared_during_draft if self.target_side is not None else 0

    @property
    def num_launched_ahead(self) -> int:
        return self.target_side.num_gated_launches if self.target_side is not None else 0

    def _draft(self, method: str) -> DraftSide:
        if self.draft_side is None:
            raise RuntimeError(f"{method}() called on a {self.role} worker")
        return self.draft_side

    def _target(self, method: str) -> TargetSide:
        if self.target_side is None:
            raise RuntimeError(f"{method}() called on a {self.role} worker")
        return self.target_side

    # --- control -------------------------------------------------------------------------------------
    def ping(self) -> tuple[str, int, int]:
        return self.role, self.rank, os.getpid()

    def info(self) -> WorkerInfo:
        import ray

        r, d = self.runner, self.draft_runner
        return WorkerInfo(self.role, r.kv_groups, r.num_blocks, r.vocab_size, self.world_size, str(r.device),
                          ray.util.get_node_ip_address(), os.getpid(), d.kv_groups if d is not None else None,
                          d.num_blocks if d is not None else 0, self.gc_frozen, r.weights,
                          d.weights if d is not None else None)

    # --- one step: graph nodes, or ordered actor calls (ranks > 0 return None) -------------------------
    def draft_step(self, plan: StepPlan) -> DraftOutput | None:
        """Draft rank's proposal for the plan; rank 0 hands it to the target's ranks as host lists, timed."""
        t0 = time.perf_counter()
        side = self._draft("draft_step")
        plan = side.resolve(plan)
        proposal = side.propose(plan)
        if self.rank != 0:
            return None
        proposal = proposal.to_host([r.num_draft_tokens for r in plan.requests])
        now = time.perf_counter()
        return DraftOutput(proposal, now - t0, now, HOST, side.speculation_ahead_totals,
                           side.take_speculation_ahead_window())

    @graph_node
    def draft_speculate_ahead(self) -> None:
        """Draft the next window of the proposal this rank just sent (speculation ahead), while the target verifies
        it. A graph node bound after `draft_step` and before `draft_absorb`."""
        self._draft("draft_speculate_ahead").speculate_ahead()

    @graph_node
    def draft_absorb(self, result: StepResult | None) -> None:
        """The target's result of the step this rank just proposed for (asynchronous scheduling): recorded
        here, so the next step's open entries resolve without the scheduler. It comes straight from target
        rank 0, while the router is still on its way to the result; in the graph, after the rank's
        `draft_speculate_ahead`."""
        if result is None:
            raise RuntimeError("draft_absorb() needs target rank 0's result")
        self._draft("draft_absorb").absorb(result)

    def target_prepare(self, plan: StepPlan) -> VerifyInput:
        """The verify input of a step with a draft, built from the plan alone: a graph node bound to the plan, so
        it runs while the draft's workers propose and the proposal finds the input ready."""
        side = self._target("target_prepare")
        return side.prepare(side.resolve(plan), with_drafts=True, gated_launch=True)

    @graph_node
    def target_step(self, step: StepPlan | VerifyInput, draft: DraftOutput | None = None) -> StepResult | None:
        """`step` is the plan, or its verify input from `target_prepare`; `draft` is draft rank 0's output (rank 0
        is bound after the other draft ranks too, so that the graph has no leaf nodes)."""
        received = time.perf_counter()
        side = self._target("target_step")
        result = side.verify(side.resolve(step) if isinstance(step, StepPlan) else step,
                             draft.proposal if draft is not None else None)
        if self.rank != 0:
            return None
        if draft is not None:
            book_remote_proposal(result.phase_seconds, draft.seconds, draft.sent_at, draft.host, received)
            result.speculation_ahead_totals = draft.speculation_ahead_totals
            result.speculation_ahead_window = draft.speculation_ahead_window
        return result

    def spec_step(self, plan: StepPlan) -> StepResult | None:
        """A whole speculation step in this rank's process (a colocated draft): the graph's one node per rank. No
        proposal leaves the process, and the result is recorded once, for both models."""
        if self.spec is None:
            raise RuntimeError(f"spec_step() called on a {self.role} worker without a colocated draft")
        started = time.perf_counter()
        result = self.spec.run(plan)
        if self.rank != 0:
            return None
        book_between(result.phase_seconds, started, self._returned_at, plan.sent_at, plan.sent_host)
        self._returned_at = time.perf_counter()
        return result

    def target_decode(self, plan: StepPlan | None) -> StepResult | None:
        """A draft-less step, pipelined (engine/decode_pipeline.py): queue `plan`, then return the result of the
        step queued before it (None: there was none). `plan` None queues nothing: the executor's way to collect
        the last step. The graph node of an engine without a draft under asynchronous scheduling."""
        side = self._target("target_decode")
        if self.pipeline is None:
            self.pipeline = DecodePipeline(side.verifier, side.table)
        result = self.pipeline.step(plan)
        return result if self.rank == 0 else None
