"""Speculation ahead's on/off gate by load (engine/speculation/ahead/gate.py): per bucket of speculating requests the
engine plans the setting (drafting ahead or not) whose committed tokens per second measured higher, probing the other
now and then. The rule runs here on a simulated clock; the engine is checked to obey each plan's setting with exact
outputs (greedy against the target alone, seeded sampling against plain speculation), and to gate only where runs
ahead overlap the verify."""

from __future__ import annotations

import pytest
from spec_support import GREEDY, PROMPTS
from test_ahead_budget import AHEAD, record_speculation_ahead
from test_speculation_ahead import _ahead
from test_speculation_ahead_branches import SEEDED, SEEDED_PROMPTS, seeded_near  # noqa: F401 - fixture

from engine import LLM
from engine.speculation.ahead import gate as gate_module
from engine.speculation.ahead.gate import AheadGate, bucket_of

pytestmark = pytest.mark.usefixtures("one_thread")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _simulate(gate: AheadGate, clock: _Clock, loads: list[int], seconds: dict[tuple[int, bool], float],
              steps: int, tokens: int = 40, idle: float = 0.0, start: int = 0) -> list[bool]:
    """`steps` steps at each load in turn, each planned after `idle` seconds with nothing in flight; a step takes
    seconds[(load, setting)] and commits `tokens`. Returns the settings planned, in order."""
    planned = []
    step_id = start
    for n in loads:
        for _ in range(steps):
            clock.now += idle  # the engine idle before the plan: not the step's time
            on = gate.plan(step_id, n)
            clock.now += seconds[(n, on)]
            gate.observe(step_id, tokens)
            planned.append(on)
            step_id += 1
    return planned


def test_gate_keeps_the_faster_setting_per_load():
    clock = _Clock()
    gate = AheadGate(True, clock)
    # One request: drafting ahead hides the draft (4 against 5 ms a step). Sixteen: it holds misses up (6 against 5).
    seconds = {(1, True): 0.004, (1, False): 0.005, (16, True): 0.006, (16, False): 0.005}
    one = _simulate(gate, clock, [1], seconds, 2000)
    sixteen = _simulate(gate, clock, [16], seconds, 2000, start=2000)
    assert bucket_of(1) != bucket_of(16)
    assert gate.buckets[bucket_of(1)].best() and not gate.buckets[bucket_of(16)].best()
    # After the first probe, the loser runs only in probes.
    share = gate_module.PROBE_STEPS / gate_module.PROBE_EVERY
    assert one[:gate_module.FIRST_PROBE - 1].count(False) == 0  # on until the first probe
    assert one[200:].count(False) / len(one[200:]) <= share * 1.2
    assert sixteen[200:].count(True) / len(sixteen[200:]) <= share * 1.2
    assert gate.buckets[bucket_of(16)].rate[False] == pytest.approx(40 / 0.005)
    # The loads alternate: each bucket keeps its own choice.
    mixed = _simulate(gate, clock, [1, 16, 1, 16], seconds, 100, start=4000)
    assert mixed[0:100].count(True) > 90 and mixed[100:200].count(False) > 90


def test_gate_follows_the_load_back_and_needs_a_margin():
    clock = _Clock()
    gate = AheadGate(True, clock)
    slow_on = {(8, True): 0.006, (8, False): 0.005}
    _simulate(gate, clock, [8], slow_on, 1000)
    assert not gate.buckets[bucket_of(8)].best()
    # The draft got faster (a shorter context): the probes see it and drafting ahead comes back.
    fast_on = {(8, True): 0.004, (8, False): 0.005}
    after = _simulate(gate, clock, [8], fast_on, 2000, start=1000)
    assert gate.buckets[bucket_of(8)].best() and after[-500:].count(True) > 450
    # Off within MARGIN of on is not taken: ties keep drafting ahead.
    gate = AheadGate(True, clock)
    _simulate(gate, clock, [2], {(2, True): 0.00500, (2, False): 0.00495}, 1000)
    assert gate.buckets[bucket_of(2)].best()


def test_idle_time_and_lost_plans_do_not_count():
    clock = _Clock()
    gate = AheadGate(True, clock)
    # Each step comes after a second of idle (one request at a time, far apart): measured from its plan, not from
    # the commit before, and the faster setting is still found.
    _simulate(gate, clock, [4], {(4, True): 0.006, (4, False): 0.005}, 1000, idle=1.0)
    assert not gate.buckets[bucket_of(4)].best()
    assert gate.buckets[bucket_of(4)].rate[False] == pytest.approx(40 / 0.005)
    # Plans never committed (a failed step) are dropped, and a commit of an unknown step is ignored.
    for s in range(10_000, 10_000 + 5 * gate_module.MAX_PLANNED):
        gate.plan(s, 4)
    assert len(gate._planned) == gate_module.MAX_PLANNED
    gate.observe(-7, 100)


def test_disabled_gate_always_drafts_ahead():
    gate = AheadGate(False)
    assert all(gate.plan(s, n) for s, n in enumerate([1, 16, 64] * 100))
    assert not gate.buckets and gate.steps_off == 0


class _Script(AheadGate):
    """A gate that plans a script of settings (cycled), to drive the draft."""

    def __init__(self, settings: list[bool]) -> None:
        super().__init__(True)
        self.settings, self.calls = settings, 0

    def plan(self, step_id: int, num_requests: int) -> bool:
        self.last = self.settings[self.calls % len(self.settings)]
        self.calls += 1
        self.steps_off += not self.last
        return self.last


def test_off_steps_draft_nothing_ahead_and_greedy_stays_exact(tiny_models, near_drafts, target_greedy):
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
              speculation_ahead_branches=3, **AHEAD)
    llm.engine.speculation_ahead.gate = _Script([True, False, False, True, True])
    seen = record_speculation_ahead(llm, lambda plan, n: (plan.ahead_off, n))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == target_greedy("llama")
    assert {off for off, _ in seen} == {True, False}
    assert all(n == 0 for off, n in seen if off) and any(n > 0 for off, n in seen if not off)
    assert _ahead(llm).stats.hits > 0  # the steps after an on step still hit
    llm.engine.speculation_ahead.gate.last = False
    assert llm.engine.speculation_ahead_branches() == 0  # the gauge shows the gate's off


def test_gated_steps_keep_seeded_sampling_exact(tiny_models, near_drafts, seeded_near):  # noqa: F811
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
              speculation_ahead_branches=3, **AHEAD)
    llm.engine.speculation_ahead.gate = _Script([False, True, True])
    assert [o.token_ids for o in llm.generate(SEEDED_PROMPTS, SEEDED)] == seeded_near


def test_in_process_engine_does_not_gate(tiny_models, tiny_drafts):
    # In one process the runs ahead follow the verify instead of overlapping it: nothing to measure against.
    llm = LLM(tiny_models["llama"].path, draft_model=tiny_drafts["llama-1l"].path, num_speculative_tokens=3,
              **AHEAD)
    assert not llm.engine.speculation_ahead.gate.enabled
    llm.generate(PROMPTS, GREEDY)
    assert llm.engine.speculation_ahead.gate.steps_off == 0


def test_off_steps_counter_follows_the_engine_total():
    from serving.metrics import EngineMetrics

    m = EngineMetrics()
    value = lambda: m.registry.get_sample_value("specserve_speculation_ahead_off_steps_total")  # noqa: E731
    assert value() == 0
    for total in (5, 5, 8):
        m.on_ahead_off_steps(total)
    assert value() == 8
    m.on_ahead_off_steps(2)  # a new gate (the draft group set up again) counts from zero
    assert value() == 10
