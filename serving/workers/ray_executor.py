"""The Executor that runs a StepPlan on Ray worker actors: target ranks and draft ranks, each model
tensor-parallel in its own placement group.

One engine step is one round trip from the router. With a Ray Compiled Graph (the default) the plan goes
into a shared-memory channel that every draft rank and every target rank reads; draft rank 0's proposal
goes straight to the target ranks through their own channels (never back through the router), and the
router reads target rank 0's StepResult. The target ranks build their verify input from the plan while the
draft proposes (`target_prepare`, a node of its own), so the proposal's ids are all that is left to write. The
step's nodes are described once, for the graph and for plain calls alike, in serving/workers/step_topology.py; each is
a thin wrapper over its rank's side of the step (serving/workers/worker.py, engine/speculation/speculative_step.py). A
draft may also run inside the target's ranks (`draft_placement="colocated"`): the graph is then one `spec_step` node
per rank, the whole step in one process, as in the in-process engine.

Asynchronous scheduling (the default here): the router submits step n+1 before it reads step n's result, and
every rank keeps its requests' state (engine/step/request_table.py). Target rank 0's result goes straight to the draft
ranks (`draft_absorb`), so the next proposal starts as soon as the verify ends, without a round trip through the
router; the router's hops and bookkeeping overlap the models' work.

Plain actor calls (`use_compiled_graph=False`) run the same methods with `.remote()` and ObjectRefs, for
comparison and debugging; a call costs about 1 ms on the GPU machine against 0.08-0.16 ms for a graph execution
(benchmarks/RESULTS.md), a large share of a small model's step.

Whether the workers are alive, and what a failed step means for the executor: serving/workers/health.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.actor import ActorHandle

from engine.config import EngineConfig
from engine.kv_cache.spec import KVCacheGroupSpec
from engine.models.eagle3_config import is_eagle3_checkpoint
from engine.step.phases import HOST, book_dispatch
from engine.step.plan import StepPlan, StepResult
from serving.engine_builders import DEFAULT_DRAFT_PLACEMENT
from serving.workers.draft_group import DraftGroupReplacement
from serving.workers.group import (  # noqa: F401 - check_tensor_parallel and launch_verify_ahead_for are public here too
    WorkerGroup,
    check_group_models,
    check_tensor_parallel,
    draft_placement_of,
    gather_info,
    launch_verify_ahead_for,
    release_group,
    speculation_ahead_for,
)
from serving.workers.health import WorkerDiedError, WorkerHealth  # noqa: F401 - WorkerDiedError is public here too
from serving.workers.pipelined_executions import PipelinedExecutions
from serving.workers.placement import actor_options, bundle_task_options, create_group_placement, make_bundle
from serving.workers.step_topology import GraphCalls, PlainCalls, step_nodes
from serving.workers.worker import ModelWorker, node_ip_and_free_port

logger = logging.getLogger("specserve")


class RayExecutor:
    """Executor protocol (engine/step/executor.py) over Ray actors: `execute(plan) -> StepResult`."""

    def __init__(self, model_path: str, engine_config: EngineConfig, draft_model_path: str | None = None, *,
                 rejection_sampling: str | None = None, tensor_parallel_size: int = 1,
                 draft_tensor_parallel_size: int = 1, use_compiled_graph: bool = True,
                 target_resources: dict[str, float] | None = None,
                 draft_resources: dict[str, float] | None = None, draft_tensor_transport: str | None = None,
                 launch_verify_ahead: bool | None = None, draft_placement: str = DEFAULT_DRAFT_PLACEMENT,
                 placement_timeout_s: float = 120.0, init_timeout_s: float = 900.0,
                 step_timeout_s: float = 300.0, draft_pool: str | None = None,
                 target_node_labels: dict[str, str] | None = None,
                 draft_node_labels: dict[str, str] | None = None) -> None:
        """target_resources / draft_resources: merged into each rank's bundle (default {"CPU": 1} on CPU,
        {"GPU": 1, "CPU": 1} on CUDA), e.g. {"CPU": 2} or a custom resource naming a node pool.
        target_node_labels / draft_node_labels: the group goes only on a node with these Ray labels. Either way a
        group's ranks share a node; the two groups may be on different nodes, where the step's proposal and result
        cross between them (serving/workers/node_placement.py).
        draft_tensor_transport: None keeps the proposal in the default shared-memory channel; "nccl" (or
        "accelerator") sends its tensors GPU to GPU (serving/workers/step_topology.py, `GraphCalls`).
        Speculation ahead (EngineConfig.speculation_ahead; None: on where every rank of both models has whole GPUs,
        i.e. the draft's forwards can run beside the target's): each draft rank drafts the next window while the
        target verifies (`draft_speculate_ahead`, a node between `draft_step` and `draft_absorb`).
        launch_verify_ahead: the target's ranks queue each verify forward on the GPU while the draft proposes,
        behind a kernel that waits for the draft's ids (engine/kernels/speculation/ids_gate.py), so the forward starts
        the moment they land. None (the default): on CUDA where every rank of both models has whole GPUs; a waiting
        kernel would take a draft's time slices on a GPU the two share.
        draft_placement: "separate" runs the draft's ranks as actors of their own; "colocated" builds
        the draft inside each target rank's process, on its device and tensor-parallel group (the draft's size must
        equal the target's), and runs each step there whole, as the in-process engine does: no proposal or result
        crosses processes (serving/workers/group.py, `check_draft_placement`). draft_resources, the draft's
        transport and launching the verify ahead then do not apply, speculation ahead runs after the verify as in
        process (off unless EngineConfig.speculation_ahead asks), and the draft cannot be replaced alone. "auto"
        (the default): colocated where the draft could only share the target's GPUs, else separate
        (serving/workers/group.py, `resolve_draft_placement`).
        draft_pool: the name of a draft pool (serving/draft_pool/pool.py) whose draft groups serve several targets: this
        executor attaches to one of them as a tenant instead of starting a draft group of its own, and runs its
        steps as plain actor calls (a compiled graph would hold the shared draft ranks for itself); speculation
        ahead is the pool's (serving/draft_pool/ahead.py)."""
        if not ray.is_initialized():
            raise RuntimeError("RayExecutor needs a Ray runtime: call ray.init() (or run inside Ray Serve) first")
        self.engine_config = engine_config
        self.draft_pool = draft_pool if draft_model_path is not None else None
        self.use_compiled_graph = use_compiled_graph and self.draft_pool is None
        use_compiled_graph = self.use_compiled_graph
        # Ordered actor calls and graph executions both keep submitted steps in order: either may run ahead.
        self.async_scheduling = (True if engine_config.async_scheduling is None
                                 else bool(engine_config.async_scheduling))
        self.draft_tensor_transport = draft_tensor_transport
        self.launch_verify_ahead = launch_verify_ahead
        self.speculation_ahead = False  # resolved in _start, once the bundles are known
        # The draft's runs ahead overlap the target's verify (a draft group of its own, not colocated): the engine
        # then fits each step's fan-out in the verify (engine/speculation/ahead/budget.py).
        self.ahead_overlaps_verify = False
        self.step_timeout_s = step_timeout_s
        self.target: WorkerGroup | None = None
        self.draft: WorkerGroup | None = None
        self._graph: Any = None  # ray.dag.CompiledDAG
        # Pipelined (a target alone, asynchronous scheduling): each execution returns the result of the step
        # submitted before it (serving/workers/pipelined_executions.py).
        self._pipelined = PipelinedExecutions(self._dispatch, self._get)
        self._last_collected = 0.0  # when the last step's result came back (perf_counter)
        # Whether the workers are alive, and whether a failed step broke this executor for good.
        self.health = WorkerHealth(lambda: (self.target, self.draft), self.draft_pool is not None, step_timeout_s)
        # New draft groups started beside the running target (serving/router/recovery.py), and one being built.
        self.draft_groups = DraftGroupReplacement(
            engine_config, self.draft_pool, draft_model_path, draft_tensor_parallel_size, draft_resources,
            rejection_sampling, placement_timeout_s, init_timeout_s, f"specserve-draft-{id(self):x}",
            draft_node_labels)
        eagle3 = draft_model_path is not None and is_eagle3_checkpoint(draft_model_path)
        self._node_labels = {"target": target_node_labels, "draft": draft_node_labels}
        self.draft_placement = draft_placement_of(  # serving/workers/group.py
            draft_placement, draft_model_path is not None, eagle3, self.draft_pool is not None,
            engine_config.device.type, tensor_parallel_size, draft_tensor_parallel_size,
            draft_resources is not None or draft_node_labels is not None)
        # A draft in the target's processes: one group of workers, each running the whole step.
        self.colocated = draft_model_path is not None and self.draft_placement == "colocated"
        # An EAGLE-3 head on workers of its own: the target's rank 0 sends each forward's states with its result,
        # which the head's ranks read at every step (`draft_absorb`, synchronous scheduling too).
        self.head_apart = eagle3 and not self.colocated
        self._head_aux_layers: tuple[int, ...] | None = None
        if self.head_apart:
            from engine.model_config import ModelConfig
            from engine.models.eagle3_config import Eagle3ModelConfig

            assert draft_model_path is not None
            self._head_aux_layers = Eagle3ModelConfig.from_head(draft_model_path,
                                                                ModelConfig.from_path(model_path)).aux_layer_ids
            self.draft_groups.worker_kwargs = {"target_model_path": model_path}
        check_group_models(model_path, None if eagle3 else draft_model_path, tensor_parallel_size,
                           draft_tensor_parallel_size, engine_config.draft_token_map, self.colocated)
        try:
            self._start(model_path, draft_model_path, rejection_sampling, tensor_parallel_size,
                        draft_tensor_parallel_size, target_resources, draft_resources, placement_timeout_s,
                        init_timeout_s)
            if use_compiled_graph:
                self._graph = self._build_graph()
        except BaseException:
            self.shutdown()  # no half-built executor keeps actors or placement groups alive
            raise
        assert self.target is not None and self.target.info is not None
        self.target_kv_groups: list[KVCacheGroupSpec] = self.target.info.kv_groups
        self.target_num_blocks: int = self.target.info.num_blocks
        self.vocab_size: int = self.target.info.vocab_size
        self.draft_kv_groups: list[KVCacheGroupSpec] | None = None
        self.draft_num_blocks: int = 0
        # What each model's rank 0 holds, {"bytes", "format"} (engine/quantization.weights_summary): for /health.
        self.target_weights: dict[str, Any] | None = self.target.info.weights
        self.draft_weights: dict[str, Any] | None = None
        if self.colocated:  # the target's ranks report their draft's KV caches too
            self.draft_kv_groups = self.target.info.draft_kv_groups
            self.draft_num_blocks = self.target.info.draft_num_blocks
            self.draft_weights = self.target.info.draft_weights
        elif self.draft is not None and self.draft.info is not None:
            self.draft_kv_groups, self.draft_num_blocks = self.draft.info.kv_groups, self.draft.info.num_blocks
            self.draft_weights = self.draft.info.weights

    # --- construction --------------------------------------------------------------------------------
    def _start(self, model_path: str, draft_model_path: str | None, rejection_sampling: str | None,
               tp: int, draft_tp: int, target_resources: dict[str, float] | None,
               draft_resources: dict[str, float] | None, placement_timeout_s: float, init_timeout_s: float) -> None:
        dev = self.engine_config.device.type
        specs = [("target", model_path, tp, make_bundle(dev, target_resources))]
        colocated_draft = draft_model_path if self.colocated else None
        if draft_model_path is not None and not self.colocated and self.draft_pool is None:
            specs.append(("draft", draft_model_path, draft_tp, make_bundle(dev, draft_resources)))
        groups = []
        for role, path, size, bundle in specs:
            pg = create_group_placement(f"specserve-{role}-{id(self):x}", size, bundle, placement_timeout_s,
                                        self._node_labels[role])
            group = WorkerGroup(role, path, size, pg)
            groups.append((group, bundle))
            if role == "target":
                self.target = group
            else:
                self.draft = group
        ahead = launch_verify_ahead_for(self.launch_verify_ahead, dev, [b for *_, b in specs], self.use_compiled_graph)
        # A colocated draft drafts ahead after the verify, as in process: only where asked.
        self.speculation_ahead = draft_model_path is not None and self.draft_pool is None and not self.head_apart and (
            bool(self.engine_config.speculation_ahead) if self.colocated
            else speculation_ahead_for(self.engine_config.speculation_ahead, dev, [b for *_, b in specs]))
        self.ahead_overlaps_verify = self.speculation_ahead and not self.colocated
        # Rank 0's node and a free port there, for each group's rendezvous (both looked up at once).
        lookup = ray.remote(node_ip_and_free_port)
        addr_refs = [lookup.options(**bundle_task_options(g.placement, 0)).remote() if g.size > 1 else None
                     for g, _ in groups]
        # SYNC: construction only.
        addrs = [ray.get(r, timeout=placement_timeout_s) if r is not None else ("127.0.0.1", 0) for r in addr_refs]
        # Every rank of both models starts at once: they load weights in parallel.
        actor_cls = ray.remote(ModelWorker)
        for (group, bundle), (addr, port) in zip(groups, addrs):
            for rank in range(group.size):
                opts = actor_options(group.placement, rank, bundle)
                group.workers.append(actor_cls.options(**opts).remote(
                    group.role, group.model_path, self.engine_config, rank, group.size, addr, port,
                    rejection_sampling if group.role == "draft" or self.colocated else None,
                    int(bundle.get("CPU", 1)), launch_verify_ahead=ahead and group.role == "target",
                    speculation_ahead=self.speculation_ahead and (group.role == "draft" or self.colocated),
                    draft_model_path=colocated_draft if group.role == "target" else None,
                    head_aux_layers=self._head_aux_layers if group.role == "target" else None,
                    **(self.draft_groups.worker_kwargs if group.role == "draft" else {})))
        for group, _ in groups:
            group.info = gather_info(group, init_timeout_s)
        if self.draft_pool is not None:
            self.draft = self.draft_groups.attach_pooled(init_timeout_s)
            # The pool's group drafts ahead for its targets where its configuration says (serving/draft_pool/ahead.py):
            # this target then calls `draft_speculate_ahead` after each proposal, and its runs ahead, on the draft's own
            # GPUs, overlap this target's verify (the engine sizes its fan-out from what the draft reports).
            self.speculation_ahead = bool(self.draft.workers[0].share.speculation_ahead)
            self.ahead_overlaps_verify = self.speculation_ahead

    def _build_graph(self) -> Any:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as plan:
            dag = MultiOutputNode(self._step_nodes(GraphCalls(self.draft_tensor_transport), plan))
        # Two executions in flight at most (EngineCore submits one before it collects the one before).
        return dag.experimental_compile(_submit_timeout=self.step_timeout_s, _max_inflight_executions=4)

    def _step_nodes(self, calls: GraphCalls | PlainCalls, plan: Any) -> list[Any]:
        """The step's calls (serving/workers/step_topology.py) on this executor's ranks."""
        assert self.target is not None
        return step_nodes(calls, plan, self.target.workers, self.draft.workers if self.draft is not None else [],
                          pipelined=self.pipelined, speculation_ahead=self.speculation_ahead,
                          async_scheduling=self.async_scheduling, colocated=self.colocated,
                          draft_reads_results=self.head_apart)

    # --- steps ---------------------------------------------------------------------------------------
    @property
    def pipelined(self) -> bool:
        """A target alone under asynchronous scheduling: its ranks queue each step before reading the last one's
        tokens (engine/decode_pipeline.py), and an execution returns the step before's result."""
        return self.draft is None and not self.colocated and self.async_scheduling

    def execute(self, plan: StepPlan, on_dispatched: Callable[[], None] | None = None) -> StepResult:
        """Run the plan on the workers; on_dispatched runs once the plan is sent, while the workers work."""
        handle = self.submit(plan)
        if on_dispatched is not None:
            on_dispatched()
        return self.collect(handle)

    def submit(self, plan: StepPlan) -> tuple[Any, float]:
        """Send the plan to the workers (a graph execution, or ordered actor calls); returns the handle."""
        self.health.check_usable()
        t0 = time.perf_counter()
        plan.sent_at, plan.sent_host = t0, HOST
        ref = self._dispatch(plan)
        if not self.pipelined:
            return ref, t0
        self._pipelined.add(ref)
        return plan.step_id, t0

    def _dispatch(self, plan: StepPlan | None) -> Any:
        """A graph execution, or the plain actor calls, of `plan`; a failure to send it is the step's error."""
        try:
            return self._graph.execute(plan) if self._graph is not None else self._submit_plain(plan)
        except Exception as e:
            self.health.raise_step_error(e)

    def runs_when_collected(self, handle: tuple[Any, float]) -> bool:
        return False  # submitted is sent: the workers run it while the router plans the next

    def collect(self, handle: tuple[Any, float]) -> StepResult:
        """Wait for a submitted step's result (target rank 0's)."""
        ref, t0 = handle
        if isinstance(ref, int):
            result = self._pipelined.result(ref)
        else:
            result = self._get(ref)[0]
        now = time.perf_counter()
        # A step submitted while the one before was still running is timed from that one's result: what its
        # transport added to the step period (engine/step/phases.py).
        book_dispatch(result.phase_seconds, now - max(t0, self._last_collected))
        self._last_collected = now
        return result

    def _get(self, ref: Any) -> list[Any]:
        try:
            # SYNC: the router needs the step's tokens to commit them (one step late with asynchronous scheduling).
            return ray.get(ref, timeout=self.step_timeout_s)
        except Exception as e:
            self._pipelined.clear()
            self.health.raise_step_error(e)

    def _submit_plain(self, plan: StepPlan | None) -> list[Any]:
        """The graph's calls as plain actor calls (each actor runs its calls in order). The proposal travels as an
        ObjectRef from draft rank 0 to the target ranks, and target rank 0's result to the draft ranks; the router
        waits once, for all of them."""
        return self._step_nodes(PlainCalls(), plan)

    # --- workers' health (serving/workers/health.py) ------------------------------------------------------
    def workers(self) -> list[tuple[str, int, ActorHandle]]:
        """(role, rank, actor handle) of every model worker, the target's first."""
        return self.health.workers()

    def check_health(self, timeout_s: float = 10.0) -> None:
        """Ping every worker; raise WorkerDiedError naming the first that is dead or does not answer (between steps:
        with plain actor calls a ping waits behind a running step). A broken executor raises at once."""
        self.health.check(timeout_s)

    # --- a new draft group while the target serves on (serving/workers/draft_group.py) ----------------------
    def detach_draft(self) -> None:
        """Run on the target alone: drop the draft ranks (dead or alive) and rebuild the graph without them.
        Raises WorkerDiedError if a target rank is dead too, RuntimeError for a draft colocated in the target's
        ranks (its recovery rebuilds the whole engine). With a draft pool, this target's share is detached."""
        self._refuse_colocated("detach")
        self._teardown_graph()
        if self.draft is not None:
            release_group(self.draft)
        self.draft, self.draft_kv_groups, self.draft_num_blocks = None, None, 0
        self.health.clear()
        self.check_health()
        if self.use_compiled_graph:
            self._graph = self._build_graph()

    def start_draft_group(self) -> None:
        """Start and load a new draft group beside the running target (blocking; steps may run meanwhile).
        `attach_draft` then puts it into the step."""
        self._refuse_colocated("start a new draft group for")
        self.draft_groups.start(self.speculation_ahead)

    def start_pooled_move(self, timeout_s: float = 10.0) -> WorkerGroup:
        """A target of a draft pool moving to another replica of it (serving/router/draft_moves.py): attach to the
        least-loaded other replica with room, as the started group that `attach_draft` puts into the step (after
        `detach_draft` lets go of the current one). Raises when no other replica has room within `timeout_s`."""
        if self.draft_pool is None or self.draft is None:
            raise RuntimeError("only a target attached to a draft pool moves between its replicas")
        return self.draft_groups.start_pooled_move(self.draft.workers[0].replica, timeout_s)

    def attach_draft(self) -> None:
        """Put the group `start_draft_group` built into the step: the graph is rebuilt with it (between steps)."""
        self._refuse_colocated("attach")
        group = self.draft_groups.take()
        self._teardown_graph()
        self.draft = group
        assert group.info is not None
        self.draft_kv_groups, self.draft_num_blocks = group.info.kv_groups, group.info.num_blocks
        if self.use_compiled_graph:
            self._graph = self._build_graph()

    def _refuse_colocated(self, what: str) -> None:
        if self.colocated:
            raise RuntimeError(f"cannot {what} a draft colocated in the target's worker processes "
                               "(draft_placement 'colocated'): it lives and dies with the target's ranks, so the "
                               "engine is rebuilt whole instead")

    # --- teardown -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tear down the graph, kill the workers and free their placement groups. Safe to call twice."""
        self._teardown_graph()
        for group in (self.target, self.draft, self.draft_groups.pending):
            if group is not None:
                release_group(group)
        self.health.mark_shut_down()

    def _teardown_graph(self) -> None:
        if self._graph is not None:
            try:
                self._graph.teardown()
            except Exception as e:  # a dead actor makes teardown complain; the kill below still runs
                logger.warning("compiled graph teardown: %s", e)
            self._graph = None

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

