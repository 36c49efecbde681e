"""The step's calls (engine/speculation/step_order.py) bound to worker actors: which worker method each call is, on
which ranks, fed by what, for the two ways the Ray executor runs a step. `GraphCalls` binds the nodes of a Ray
Compiled Graph; `PlainCalls` makes the same calls with `.remote()`, each actor running its calls in the order they
were made.

    plan ──> draft[0..D-1].draft_step(plan) ──(draft[0]'s proposal)──> target[0..T-1].target_step ──> router
         └──> target[0..T-1].target_prepare(plan) ──(the same rank's verify input)──┘      │
                  draft[0..D-1].draft_speculate_ahead (speculation ahead: after the rank's draft_step)
                                   draft[0..D-1].draft_absorb <──(target[0]'s result)──────┘  (async, or a head apart)

How a call of the step order becomes nodes: every rank of its side runs it (`WORKER_METHODS` names the worker
method); an input from the same side is the same rank's output; an input from the other side is that side's rank
0's (the other ranks return None), and a target call's rank 0 also takes the other draft ranks' outputs of the
call it reads, so that an error on any draft rank reaches the router. The router reads every target rank's result
(rank 0's first), then each draft call's output that no later call reads or follows.

A target alone: target[i].target_step(plan), or under asynchronous scheduling target[i].target_decode(plan). A
draft colocated in the target's ranks: target[i].spec_step(plan), the whole step in each rank's process.

The two ways differ only where their mechanics do:
- an argument that only orders two calls (`after`) is bound in the graph, which has no other order and may have no
  leaf nodes; plain calls are ordered by their actor already, so it is left out (passing a ref would make the
  router wait for it before sending the call) and the router waits for the call's result directly instead;
- the verify input is built ahead by `target_prepare` in the graph only, where a node's output stays in its
  process; a plain call's would go through the object store, so there `target_step` builds it from the plan;
- the proposal's tensors may travel GPU to GPU in the graph (`tensor_transport`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from ray.actor import ActorHandle

from engine.speculation.step_order import DRAFT, PLAN, RESULT, SPECULATION_STEP, TARGET, StepMode


def graph_node(method: Callable[..., Any]) -> Callable[..., Any]:
    """A worker method a graph node may bind `after` other nodes: the graph orders two nodes only through an
    argument, so such a node is also handed their outputs, after its own arguments. This drops them, so that the
    method's signature says only what it reads; ordered actor calls never pass them."""
    num_args = len(inspect.signature(method).parameters) - 1  # without self

    @functools.wraps(method)
    def node(self: Any, *args: Any) -> Any:
        return method(self, *args[:num_args])

    # What Ray checks a bind's arguments against: any number of them (Ray unwraps to the method it checks, so the
    # wrapper must not point to the method it wraps).
    del node.__wrapped__  # type: ignore[attr-defined]
    node.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)])
    return node


class GraphCalls:
    """Nodes of a compiled graph (`method.bind`)."""

    prepares_verify = True

    def __init__(self, tensor_transport: str | None = None) -> None:
        self.tensor_transport = tensor_transport

    def __call__(self, worker: ActorHandle, method: str, *args: Any, after: Sequence[Any] = ()) -> Any:
        return getattr(worker, method).bind(*args, *after)

    def proposal(self, node: Any) -> Any:
        if self.tensor_transport is None:
            return node
        # GPU to GPU: the proposal's tensors (draft ids and the [num_reqs, k, vocab] float32 draft probabilities,
        # 12.6 MB for 16 requests x k=4 x 49152) go over NCCL from draft rank 0 to each target rank, and only the
        # small rest through shared memory. Without it (the default, and the only choice on CPU) Ray serializes
        # them through shared memory, copying GPU -> host -> GPU. Both ends need a GPU;
        # `benchmarks/router_overhead.py` measures the step. Groups on different nodes share no memory: there the
        # graph's channels carry the proposal between the nodes' object stores (`benchmarks/cross_node_step.py`).
        return node.with_tensor_transport(transport=self.tensor_transport)

    def outputs(self, outs: list[Any]) -> list[Any]:
        return outs


class PlainCalls:
    """Ordered actor calls (`method.remote`); ObjectRefs carry results from one call to the next."""

    prepares_verify = False

    def __init__(self) -> None:
        self._unread: list[Any] = []  # refs no later call reads: the router waits for them, to surface errors

    def __call__(self, worker: ActorHandle, method: str, *args: Any, after: Sequence[Any] = ()) -> Any:
        self._unread = [r for r in self._unread if not any(r is a for a in args)]
        ref = getattr(worker, method).remote(*args)
        self._unread.append(ref)
        return ref

    def proposal(self, ref: Any) -> Any:
        return ref

    def outputs(self, outs: list[Any]) -> list[Any]:
        return outs + [r for r in self._unread if not any(r is o for o in outs)]


# The worker method (serving/workers/worker.py) of each call of the step order.
WORKER_METHODS = {(DRAFT, "propose"): "draft_step", (TARGET, "prepare"): "target_prepare",
                  (TARGET, "verify"): "target_step", (DRAFT, "speculate_ahead"): "draft_speculate_ahead",
                  (DRAFT, "absorb"): "draft_absorb"}


def step_nodes(calls: GraphCalls | PlainCalls, plan: Any, targets: list[ActorHandle], drafts: list[ActorHandle],
               *, pipelined: bool, speculation_ahead: bool, async_scheduling: bool,
               colocated: bool = False, draft_reads_results: bool = False) -> list[Any]:
    """One step's calls; returns what the router reads, target rank 0's result first. `plan` is the graph's input
    node or the plan itself; `drafts` empty: the target alone, or (colocated) a draft inside each target rank.
    draft_reads_results: the draft's ranks take every result (`draft_absorb`) under synchronous scheduling too (an
    EAGLE-3 head on workers of its own: the result brings the target's states it drafts from)."""
    if colocated:
        return calls.outputs([calls(w, "spec_step", plan) for w in targets])
    if pipelined:
        return calls.outputs([calls(w, "target_decode", plan) for w in targets])
    if not drafts:
        return calls.outputs([calls(w, "target_step", plan) for w in targets])
    # Each target rank builds its verify input while the draft proposes (graph only); the draft's ranks keep
    # tables of their own, which learn each result from target rank 0 under asynchronous scheduling.
    mode = StepMode(prepares_verify=calls.prepares_verify, speculation_ahead=speculation_ahead,
                    draft_has_own_table=async_scheduling or draft_reads_results)
    ranks = {DRAFT: drafts, TARGET: targets}
    made: dict[str, tuple[str, list[Any]]] = {}  # per call: its side and each rank's node (left out: its input's)
    crossed: dict[str, Any] = {}  # a draft call's rank-0 node as the target's ranks read it
    read: list[Any] = []  # nodes a later call reads or follows

    def node(name: str, side: str, rank: int) -> Any:
        if name == PLAN:
            return plan
        source, outs = made[name]
        read.append(outs[rank if source == side else 0])
        if source == side:
            return outs[rank]
        if name not in crossed:
            crossed[name] = calls.proposal(outs[0]) if source == DRAFT else outs[0]
        return crossed[name]

    ran = []
    for call in SPECULATION_STEP:
        workers = ranks[call.side]
        if not call.runs(mode):
            if call.inputs:
                made[call.method] = (call.side, [node(call.inputs[0], call.side, r) for r in range(len(workers))])
            continue
        outs = []
        for rank, worker in enumerate(workers):
            args = [node(name, call.side, rank) for name in call.inputs]
            after = [made[name][1][rank] for name in call.after if name in made]
            if call.side == TARGET and rank == 0:
                after += [n for name in call.inputs if name in made and made[name][0] == DRAFT
                          for n in made[name][1][1:]]
            read.extend(after)
            outs.append(calls(worker, WORKER_METHODS[call.side, call.method], *args, after=after))
        made[call.method] = (call.side, outs)
        ran.append(call)
    leaves = [n for call in ran if call.side == DRAFT for n in made[call.method][1] if not any(n is r for r in read)]
    return calls.outputs(made[RESULT][1] + leaves)
