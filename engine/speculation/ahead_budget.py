"""How many windows speculation ahead drafts per request, step by step: as many as fit in the target's verify.

A draft on GPUs of its own drafts the next windows (engine/speculation/speculation_ahead.py) while the target verifies
the current ones. More windows per request (EngineConfig.speculation_ahead_branches) raise the hit rate, but they are
more rows of one draft-loop run, and a run that outlasts the verify holds the next step up: the draft is still busy
when the target's result asks it for the next proposal (on two H200s, four windows a request made the step 30%
slower than one). Whether they fit depends on the pair and the machine, and on the batch. So the engine caps the
fan-out of each step at the largest count whose run, as measured, fits in the verify's shadow, up to the
configured count; the plan carries the cap (StepPlan.ahead_branches), so every rank of a tensor-parallel draft
drafts the same windows.

What is measured:
- the draft's run ahead: (rows, seconds) of the last one, from the draft side (StepResult.predraft_window); a running
  mean per row count, since a run's cost grows with its rows (the draft loop's batch);
- the shadow: what the step spends between the proposal leaving the draft and the result reaching it, of which
  the phases show the handoff, the verify and the sample; a running mean.

The choice for a step of n speculating requests: the largest b <= the configured count whose n x b rows ran in
at most the shadow. A row count never measured (or whose figure is older than RETRY_STEPS steps) is tried once
when the count below it fits with room to spare (its run under HEADROOM x the shadow), so the budget climbs to
what fits and comes back down when a run grows past the shadow (a longer context, a slower verify).

Exactness does not depend on the count: a window is what the next proposal would draft after its outcome, for
any number of windows (engine/speculation/speculation_ahead.py); the cap changes only which outcomes have one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.step.phases import HANDOFF, SAMPLE, VERIFY

SMOOTHING = 0.2  # weight of a new measurement in a running mean
HEADROOM = 0.85  # a fitting run shorter than this share of the shadow makes the next row count worth a try
RETRY_STEPS = 256  # steps after which a row count's figure is stale and may be tried again


@dataclass
class _Mean:
    value: float
    step: int  # when last updated

    def add(self, x: float, step: int) -> None:
        self.value += SMOOTHING * (x - self.value)
        self.step = step


@dataclass
class AheadBudget:
    """The per-step fan-out of speculation ahead (see the module docstring). `max_branches` is the configured
    count; with `adaptive` False every step takes it (a draft that shares the target's GPU runs its windows after
    the verify, so no shadow exists to fit them in: the configured count is what the user asked for)."""

    max_branches: int
    adaptive: bool = True
    shadow: _Mean | None = None  # seconds between a proposal leaving the draft and the result reaching it
    windows: dict[int, _Mean] = field(default_factory=dict)  # rows of a run ahead -> its seconds
    step: int = 0
    last: int = 1  # the count of the last plan (reported as a gauge)

    def observe(self, phase_seconds: dict[str, float], window: tuple[int, float] | None) -> None:
        """One step's result: its phases, and the draft's last run ahead as (rows, seconds), if it drafted one."""
        self.step += 1
        shadow = sum(phase_seconds.get(p, 0.0) for p in (HANDOFF, VERIFY, SAMPLE))
        if phase_seconds.get(VERIFY, 0.0) > 0.0:
            if self.shadow is None:
                self.shadow = _Mean(shadow, self.step)
            else:
                self.shadow.add(shadow, self.step)
        if window is not None and window[0] > 0:
            rows, seconds = window
            if rows in self.windows and self.step - self.windows[rows].step <= RETRY_STEPS:
                self.windows[rows].add(seconds, self.step)
            else:
                self.windows[rows] = _Mean(seconds, self.step)

    def branches(self, num_requests: int) -> int:
        """The fan-out for a step of `num_requests` speculating requests."""
        self.last = self._choose(num_requests)
        return self.last

    def _choose(self, n: int) -> int:
        if not self.adaptive or self.max_branches <= 1:
            return self.max_branches
        if self.shadow is None or n <= 0:
            return 1
        shadow = self.shadow.value
        best = 1
        for b in range(2, self.max_branches + 1):
            seen = self.windows.get(n * b)
            if seen is not None and self.step - seen.step <= RETRY_STEPS:
                if seen.value > shadow:
                    break
                best = b
                continue
            # Not measured (or stale): worth a try only when the count below fits with room to spare.
            below = self.windows.get(n * (b - 1))
            if below is not None and below.value <= HEADROOM * shadow:
                best = b
            break
        return best
