"""Whether drafting ahead pays at the current load, measured: speculation ahead on or off per batch size.

Why: a draft on GPUs of its own drafts the next windows while the target verifies (engine/speculation/
ahead/proposer.py). At one request that hides the draft (two H200s: 1.23x tokens/s); at sixteen the same layout
lost 9.6% to itself without drafting ahead (benchmarks/RESULTS.md, "The load sweep"): the run ahead and the just-in-
time drafts of the misses share the draft's GPU, and a run that is not done when the verify's result arrives holds
the misses up. Where the crossover lies depends on the pair, the machines and the hit rate, so no fixed batch size
fits: the engine measures it. The fan-out budget (budget.py) sizes what is drafted ahead; this gate decides
whether anything is.

How: steps are bucketed by their speculating requests (1, 2-3, 4-7, ...: powers of two). In a bucket the gate keeps
two running means of committed tokens per second, for steps planned with drafting ahead and without, each fed one
window at a time (WINDOW_STEPS consecutive steps of one bucket and one setting, after SETTLE_STEPS that still carry
the setting before them: a step's proposal is served by what the step before drafted ahead). It plans the faster
setting (without drafting ahead only when that is MARGIN faster: ties keep the default), and every PROBE_EVERY steps
of a bucket runs PROBE_STEPS steps the other way, so the loser's figure follows the load; the first probe comes after
FIRST_PROBE steps. The cost of probing is the loser's deficit over PROBE_STEPS / PROBE_EVERY of the steps (~6%).

A step's time is the wall time from the commit before it, or from its own plan where the engine was idle since, to
its commit: in steady state the interval between commits, whatever the steps in flight. Exactness does not depend on
the gate: a step planned without drafting ahead proposes just in time, as a step whose lookups all missed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SMOOTHING = 0.3  # weight of a new window in a setting's running mean
MARGIN = 0.03  # off is planned only when its tokens/s beat on's by this share
WINDOW_STEPS = 8  # counted steps a measurement window holds
SETTLE_STEPS = 2  # steps after a switch of setting or bucket that are not counted
PROBE_STEPS = SETTLE_STEPS + 2 * WINDOW_STEPS  # steps of the other setting a probe runs
PROBE_EVERY = 320  # steps of a bucket between probes
FIRST_PROBE = 48  # the first probe of a bucket (its default's figure measured first)
MAX_PLANNED = 64  # plans awaiting their commit kept at most


def bucket_of(num_requests: int) -> int:
    """1 -> 0, 2-3 -> 1, 4-7 -> 2, ...: the load buckets."""
    return max(num_requests, 1).bit_length() - 1


@dataclass
class _Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # setting (drafting ahead?) -> tokens/s, running mean
    steps: int = 0  # steps planned in this bucket
    probe_left: int = 0  # steps of the current probe still to plan

    def best(self) -> bool:
        on, off = self.rate.get(True), self.rate.get(False)
        return on is None or off is None or off <= on * (1.0 + MARGIN)


@dataclass
class _Run:
    """The steps committed since the last switch of bucket or setting."""

    key: tuple[int, bool]
    steps: int = 0  # steps committed in this run
    tokens: int = 0  # counted tokens and seconds of its current window
    seconds: float = 0.0


class AheadGate:
    """See the module docstring. `enabled` False: every step drafts ahead (where speculation ahead is on)."""

    def __init__(self, enabled: bool, clock=time.perf_counter) -> None:  # noqa: ANN001 - a () -> float
        self.enabled = enabled
        self.clock = clock
        self.buckets: dict[int, _Bucket] = {}
        self._planned: dict[int, tuple[int, bool, float]] = {}  # step id -> (bucket, setting, plan time)
        self._run: _Run | None = None
        self._last_commit: float | None = None
        self.steps_off = 0  # steps planned without drafting ahead (specserve_speculation_ahead_off_steps_total)
        self.last = True  # the last plan's setting

    def plan(self, step_id: int, num_requests: int) -> bool:
        """Whether step `step_id`, with `num_requests` requests drafted ahead for, drafts ahead."""
        if not self.enabled or num_requests <= 0:
            self.last = True
            return True
        b = bucket_of(num_requests)
        st = self.buckets.setdefault(b, _Bucket())
        st.steps += 1
        best = st.best()
        if st.probe_left == 0 and st.steps % PROBE_EVERY == FIRST_PROBE:  # steps 48, 368, 688, ...
            st.probe_left = PROBE_STEPS
        if st.probe_left > 0:
            st.probe_left -= 1
            choice = not best
        else:
            choice = best
        self._planned[step_id] = (b, choice, self.clock())
        while len(self._planned) > MAX_PLANNED:  # plans never committed (a failed step) are not kept for ever
            self._planned.pop(next(iter(self._planned)))
        self.steps_off += not choice
        self.last = choice
        return choice

    def observe(self, step_id: int, tokens: int) -> None:
        """Step `step_id` committed `tokens` tokens (now)."""
        now = self.clock()
        planned = self._planned.pop(step_id, None)
        last, self._last_commit = self._last_commit, now
        if planned is None:
            return
        b, choice, planned_at = planned
        # Idle before the plan (no step in flight) is not the step's time.
        dt = now - (planned_at if last is None else max(last, planned_at))
        run = self._run
        if run is None or run.key != (b, choice):
            run = self._run = _Run((b, choice))
        run.steps += 1
        if run.steps <= SETTLE_STEPS:
            return
        run.tokens += tokens
        run.seconds += dt
        if (run.steps - SETTLE_STEPS) % WINDOW_STEPS == 0:
            if run.seconds > 0.0 and run.tokens > 0:
                rates = self.buckets[b].rate
                sample = run.tokens / run.seconds
                rates[choice] = sample if choice not in rates else rates[choice] + SMOOTHING * (sample - rates[choice])
            run.tokens, run.seconds = 0, 0.0
