"""The speculation step's order (engine/speculation/step_order.py) as the Ray executor binds it to worker actors
(serving/workers/step_topology.py): every call, its ranks, its arguments and the nodes it follows, as the module
docstring there draws them. Recorded without Ray: a stand-in for the graph's `bind` that notes each node."""

from __future__ import annotations

from typing import Any

import pytest

from engine.speculation.step_order import SPECULATION_STEP, StepMode, run_in_process
from serving.workers.step_topology import GraphCalls, PlainCalls, graph_node, step_nodes


class Recorder(GraphCalls):
    """GraphCalls whose `bind` is a note: (rank name, worker method, argument names, names of the nodes followed)."""

    def __init__(self, tensor_transport: str | None = None) -> None:
        super().__init__(tensor_transport)
        self.nodes: list[tuple[str, str, tuple[str, ...], tuple[str, ...]]] = []

    def __call__(self, worker: Any, method: str, *args: Any, after: Any = ()) -> str:
        self.nodes.append((worker, method, tuple(args), tuple(after)))
        return f"{worker}.{method}"

    def proposal(self, node: Any) -> Any:
        return f"sent({node})" if self.tensor_transport else node


def test_a_separate_draft_step_binds_the_declared_order() -> None:
    calls = Recorder("nccl")
    outs = step_nodes(calls, "plan", ["t0", "t1"], ["d0", "d1"], pipelined=False, speculation_ahead=True,
                      async_scheduling=True)
    assert calls.nodes == [
        ("d0", "draft_step", ("plan",), ()),
        ("d1", "draft_step", ("plan",), ()),
        ("t0", "target_prepare", ("plan",), ()),
        ("t1", "target_prepare", ("plan",), ()),
        # Target rank 0 also follows the other draft ranks, so that their errors reach the router.
        ("t0", "target_step", ("t0.target_prepare", "sent(d0.draft_step)"), ("d1.draft_step",)),
        ("t1", "target_step", ("t1.target_prepare", "sent(d0.draft_step)"), ()),
        ("d0", "draft_speculate_ahead", (), ("d0.draft_step",)),
        ("d1", "draft_speculate_ahead", (), ("d1.draft_step",)),
        ("d0", "draft_absorb", ("t0.target_step",), ("d0.draft_speculate_ahead",)),
        ("d1", "draft_absorb", ("t0.target_step",), ("d1.draft_speculate_ahead",)),
    ]
    assert outs == ["t0.target_step", "t1.target_step", "d0.draft_absorb", "d1.draft_absorb"]


def test_calls_left_out_hand_their_input_on() -> None:
    """No prepare (plain calls), no speculation ahead, synchronous: the verify reads the plan, and the router
    reads the target's results alone (the draft ranks' proposals are read or followed by target rank 0)."""
    calls = Recorder()
    calls.prepares_verify = False
    outs = step_nodes(calls, "plan", ["t0"], ["d0", "d1"], pipelined=False, speculation_ahead=False,
                      async_scheduling=False)
    assert [(w, m) for w, m, *_ in calls.nodes] == [("d0", "draft_step"), ("d1", "draft_step"),
                                                    ("t0", "target_step")]
    assert calls.nodes[-1][2:] == (("plan", "d0.draft_step"), ("d1.draft_step",))
    assert outs == ["t0.target_step"]
    # Synchronous with speculation ahead: the runs ahead are leaves, which the router reads.
    calls = Recorder()
    outs = step_nodes(calls, "plan", ["t0"], ["d0"], pipelined=False, speculation_ahead=True, async_scheduling=False)
    assert outs == ["t0.target_step", "d0.draft_speculate_ahead"]


def test_plain_calls_wait_for_what_no_call_reads() -> None:
    made: list[str] = []

    class Worker:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getattr__(self, method: str) -> Any:
            outer = self

            class Method:
                @staticmethod
                def remote(*args: Any) -> str:
                    made.append(f"{outer.name}.{method}")
                    return f"{outer.name}.{method}"
            return Method

    outs = step_nodes(PlainCalls(), "plan", [Worker("t0")], [Worker("d0"), Worker("d1")], pipelined=False,
                      speculation_ahead=True, async_scheduling=True)
    assert made == ["d0.draft_step", "d1.draft_step", "t0.target_step", "d0.draft_speculate_ahead",
                    "d1.draft_speculate_ahead", "d0.draft_absorb", "d1.draft_absorb"]
    # The result first, then every ref no later call took as an argument (plain calls pass no ordering ones).
    assert outs == ["t0.target_step", "d0.draft_absorb", "d1.draft_absorb", "d1.draft_step", "d0.draft_speculate_ahead",
                    "d1.draft_speculate_ahead"]


@pytest.mark.parametrize("ahead", [False, True])
def test_in_process_runs_the_same_order(ahead: bool) -> None:
    seen: list[str] = []

    class Side:
        def __getattr__(self, method: str) -> Any:
            return lambda *args: seen.append(method) or f"{method}{args}"

    result = run_in_process({"draft": Side(), "target": Side()}, StepMode(False, ahead, False), "plan")
    assert seen == ["propose", "verify"] + (["speculate_ahead"] if ahead else [])
    assert result == "verify('plan', \"propose('plan',)\")"
    assert [c.method for c in SPECULATION_STEP if c.runs(StepMode(True, True, True))] == \
        ["propose", "prepare", "verify", "speculate_ahead", "absorb"]


def test_graph_node_drops_ordering_arguments() -> None:
    class Worker:
        @graph_node
        def step(self, a: int, b: int | None = None) -> tuple[int, int | None]:
            return a, b

    assert Worker().step(1) == (1, None)
    assert Worker().step(1, 2, "ordering", "only") == (1, 2)
