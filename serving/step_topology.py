"""Which worker methods one engine step calls, on which ranks, fed by what: described once (`step_nodes`), for the
two ways the Ray executor runs a step. `GraphCalls` binds the nodes of a Ray Compiled Graph; `PlainCalls` makes the
same calls with `.remote()`, each actor running its calls in the order they were made.

    plan ──> draft[0..D-1].draft_step(plan) ──(draft[0]'s proposal)──> target[0..T-1].target_step ──> router
         └──> target[0..T-1].target_prepare(plan) ──(the same rank's verify input)──┘      │
                  draft[0..D-1].draft_predraft (speculation ahead: after the rank's draft_step)
                                   draft[0..D-1].draft_absorb <──(target[0]'s result)──────┘  (async only)

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

from collections.abc import Sequence
from typing import Any

from ray.actor import ActorHandle


class GraphCalls:
    """Nodes of a compiled graph (`method.bind`)."""

    prepares_ahead = True

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
        # `benchmarks/router_overhead.py` measures the step.
        return node.with_tensor_transport(transport=self.tensor_transport)

    def outputs(self, outs: list[Any]) -> list[Any]:
        return outs


class PlainCalls:
    """Ordered actor calls (`method.remote`); ObjectRefs carry results from one call to the next."""

    prepares_ahead = False

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


def step_nodes(calls: GraphCalls | PlainCalls, plan: Any, targets: list[ActorHandle], drafts: list[ActorHandle],
               *, pipelined: bool, speculation_ahead: bool, async_scheduling: bool,
               colocated: bool = False) -> list[Any]:
    """One step's calls; returns what the router reads, target rank 0's result first. `plan` is the graph's input
    node or the plan itself; `drafts` empty: the target alone, or (colocated) a draft inside each target rank."""
    if colocated:
        return calls.outputs([calls(w, "spec_step", plan) for w in targets])
    if pipelined:
        return calls.outputs([calls(w, "target_decode", plan) for w in targets])
    if not drafts:
        return calls.outputs([calls(w, "target_step", plan) for w in targets])
    proposed = [calls(w, "draft_step", plan) for w in drafts]
    proposal = calls.proposal(proposed[0])
    # Each target rank builds its verify input while the draft proposes. Target rank 0 also takes the other draft
    # ranks' outputs (None), so that an error on any draft rank reaches the router.
    inputs = [calls(w, "target_prepare", plan) for w in targets] if calls.prepares_ahead else [plan] * len(targets)
    outs = [calls(w, "target_step", inputs[rank], proposal, after=proposed[1:] if rank == 0 else ())
            for rank, w in enumerate(targets)]
    # Each draft rank drafts the next window after its proposal has gone out, while the target verifies.
    ahead = ([[calls(w, "draft_predraft", after=[proposed[rank]])] for rank, w in enumerate(drafts)]
             if speculation_ahead else [[] for _ in drafts])
    if async_scheduling:
        outs += [calls(w, "draft_absorb", outs[0], after=ahead[rank]) for rank, w in enumerate(drafts)]
    else:
        outs += [node for rank_ahead in ahead for node in rank_ahead]
    return calls.outputs(outs)
