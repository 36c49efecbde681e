"""How many windows speculation ahead drafts per request, step by step: as many as fit in the target's verify.

A draft on GPUs of its own drafts the next windows (engine/speculation/ahead/proposer.py) while the target verifies
the current ones. More windows per request (EngineConfig.speculation_ahead_branches) raise the hit rate, but they are
more rows of one draft-loop run, and a run that outlasts the verify holds the next step up: the draft is still busy
when the target's result asks it for the next proposal (on two H200s, four windows a request made the step 30%
slower than one). Whether they fit depends on the pair and the machine, and on the batch. So the engine caps the
fan-out of each step at the largest count whose run, as measured, fits in the verify's shadow, up to the
configured count; the plan carries the cap (StepPlan.ahead_branches), so every rank of a tensor-parallel draft
drafts the same windows.

What is measured:
- the draft's run ahead: (rows, seconds) of the last one, from the draft side (StepResult.speculation_ahead_window); a
  running mean per row count, since a run's cost grows with its rows (the draft loop's batch);
- the shadow: what the step spends between the proposal leaving the draft and the result reaching it, of which
  the phases show the handoff, the verify and the sample; a running mean.

The choice for a step of n speculating requests: the largest b <= the configured count whose n x b rows ran in
at most the shadow. A row count never measured (or whose figure is older than RETRY_STEPS steps) is tried once
when the count below it fits with room to spare (its run under HEADROOM x the shadow), so the budget climbs to
what fits and comes back down when a run grows past the shadow (a longer context, a slower verify).

Tree mode (EngineConfig.speculation_ahead_tree_fanout > 0, engine/speculation/ahead/tree.py): the draft drafts one
tree a request, k + 1 forwards (the chain [c, d_1..d_k], then one forward per depth over every branch), and reports
(nodes, seconds) of each pre-draft, nodes being the rows those forwards fed. The budget keeps a running mean of the
seconds a node and caps the next step's nodes (StepPlan.ahead_tree_nodes) at what that rate fits in the shadow; the
draft turns the cap into a branch budget a request (TreeSchedule.fanout's `budget`), so a tree that would outlast
the verify is cut from its unlikeliest outcomes' last candidates, down to the single likeliest outcome a request.
The rate is linear through the origin: a forward's cost grows less than its rows (fixed costs), so a rate measured
on a smaller tree overstates a larger one's, and the cap climbs to what fits over a few steps rather than overshooting;
a tree that outlasted the shadow brings the cap down at once. When even one branch a request does not fit, the step
drafts no tree (counted: `skipped_tree_steps`, and the draft's skipped branches), and the smallest tree is tried again
once the rate is RETRY_STEPS steps old; each retry that does not fit either doubles that wait (up to
MAX_TREE_RETRY_STEPS), because a retry is a tree the next step waits for: on two H200s with eager trees that never
fit, retries every 256 steps showed as 80 ms stalls (ITL p99 86 against 10 ms without speculation ahead). Before any
measurement the smallest tree is drafted, to measure it.

Exactness does not depend on the count: a window is what the next proposal would draft after its outcome, for
any number of windows (engine/speculation/ahead/proposer.py); the cap changes only which outcomes have one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.step.phases import HANDOFF, SAMPLE, VERIFY

SMOOTHING = 0.2  # weight of a new measurement in a running mean
HEADROOM = 0.85  # a fitting run shorter than this share of the shadow makes the next row count worth a try
RETRY_STEPS = 256  # steps after which a row count's figure is stale and may be tried again
MAX_TREE_RETRY_STEPS = 16 * RETRY_STEPS  # the longest wait between retries of a tree that did not fit


def drafts_ahead(samples: bool, processes_logits: bool, tree: bool) -> bool:
    """Whether a speculating request is drafted ahead at all (one rule for the draft, which drafts, and the engine,
    whose budget counts): it must sample this step; windows (not tree mode) leave out requests with logits
    processing (penalties, biases, masks, grammars), whose processors would read a history extended by guesses;
    tree mode drafts every kind (engine/speculation/ahead/tree.py)."""
    return samples and (tree or not processes_logits)


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
    tree: bool = False  # tree mode: the draft reports (nodes, seconds) and the cap is `tree_nodes`
    shadow: _Mean | None = None  # seconds between a proposal leaving the draft and the result reaching it
    windows: dict[int, _Mean] = field(default_factory=dict)  # rows of a run ahead -> its seconds
    step: int = 0
    last: int = 1  # the count of the last plan (reported as a gauge)
    node_seconds: _Mean | None = None  # tree mode: seconds a node of a tree pre-draft
    last_tree_nodes: int | None = None  # tree mode: the last plan's cap (None: the draft's own)
    skipped_tree_steps: int = 0  # tree mode: steps whose smallest tree did not fit, so drafted none
    tree_retry_steps: int = RETRY_STEPS  # tree mode: the age at which a rate that did not fit is measured again
    _failed_rate_step: int | None = None  # tree mode: the step of the rate the last skip was judged on

    def observe(self, phase_seconds: dict[str, float], window: tuple[int, float] | None) -> None:
        """One step's result: its phases, and the draft's last run ahead as (rows, seconds), if it drafted one."""
        self.step += 1
        shadow = sum(phase_seconds.get(p, 0.0) for p in (HANDOFF, VERIFY, SAMPLE))
        if phase_seconds.get(VERIFY, 0.0) > 0.0:
            if self.shadow is None:
                self.shadow = _Mean(shadow, self.step)
            else:
                self.shadow.add(shadow, self.step)
        if window is not None and window[0] > 0 and self.tree:
            nodes, seconds = window
            if self.node_seconds is None or self.step - self.node_seconds.step > self.tree_retry_steps:
                self.node_seconds = _Mean(seconds / nodes, self.step)
            else:
                self.node_seconds.add(seconds / nodes, self.step)
        elif window is not None and window[0] > 0:
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

    def tree_nodes(self, draft_counts: list[int]) -> int | None:
        """Tree mode: the cap on the nodes of the step's trees, for speculating requests of these k (their
        num_draft_tokens); None: the draft's own cap (not adaptive), 0: no tree this step."""
        self.last_tree_nodes = self._choose_nodes([k for k in draft_counts if k > 0])
        return self.last_tree_nodes

    def _choose_nodes(self, ks: list[int]) -> int | None:
        if not self.adaptive or not ks:
            return None
        # The smallest tree: every request's chain (k + 1 nodes) and one branch as deep as the step's k.
        smallest = sum(k + 1 for k in ks) + len(ks) * max(ks)
        rate = self.node_seconds
        if self.shadow is None or rate is None or self.step - rate.step > self.tree_retry_steps:
            return smallest  # nothing (recent) measured: draft the smallest tree, to measure it
        fit = int(self.shadow.value / rate.value) if rate.value > 0 else smallest
        if fit < smallest:
            if rate.step != self._failed_rate_step:  # a new measurement, and it does not fit
                if self._failed_rate_step is not None:  # a retry that failed as well: wait twice as long
                    self.tree_retry_steps = min(2 * self.tree_retry_steps, MAX_TREE_RETRY_STEPS)
                self._failed_rate_step = rate.step
            self.skipped_tree_steps += 1
            return 0
        self.tree_retry_steps, self._failed_rate_step = RETRY_STEPS, None
        return fit
