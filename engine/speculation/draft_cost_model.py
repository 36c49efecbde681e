"""What a step costs at each draft length k and what it commits: the figures the draft length rule
(engine/speculation/draft_length_rule.py) chooses k from.

Cost, per load bucket (the requests that want to run, by powers of two, as the speculation-ahead gate buckets):
- the step's seconds at each k measured (the median of its last RECENT_STEPS steps' wall time from the commit
  before each to its own commit: what the engine's throughput is made of, whatever of it the draft, the verify or
  the host spend). A median, not a running mean: a k the rule does not run is measured only in probes of three
  steps, and one slow step among them (a garbage collection, a host hiccup) held a running mean at 1.6x the step's
  time until the next probe (gemma-3-1b + 270m at batch 32 on a GPU: k = 0 at 3.9 ms for steps of 2.4, enough to
  make speculation at 0.74x the target alone look as good). Three new steps of five outvote two old ones, so a
  change of load shows within one probe;
- the draft's seconds a forward (the step's propose phase over its k), so that the verify's share of a step is
  what is left;
- for a k not measured in the bucket, a straight line between the measured k's either side of it, or beyond them
  the line through all measured ones: a step at k runs k draft forwards and verifies k + 1 tokens a request, so its time
  grows about linearly
  in k at a given batch.

Catch-up: the seconds a token of the draft's catch-up (after steps at k = 0) adds to a step (CatchUpCost).

Gain: the acceptance at each draft position i, conditional on the drafts before it being accepted (a running,
decayed count of attempts and accepts; every position ages at each step, attempted or not, so an old reading of a
position only a probe reaches fades toward the position before it), over every request and per request. A request
at k commits 1 + sum_{i <= k} prod_{j <= i} a_j tokens on average
(the accepted drafts and the bonus or recovered token).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from math import prod

SMOOTHING = 0.3  # weight of a new sample in a running mean (a draft forward's seconds, a catch-up token's)
# A k's step time is the median of its last this many timed steps: a burst of up to four slow steps in a row (a
# collection, a host stall) leaves it where it was. With five, three slow k = 0 steps of a gemma-3-1b + 270m batch
# of 8 on an H200 (3.1, 3.1, 2.1 ms against 1.45) moved it, and the rule ran ten steps at k > 0 for them.
RECENT_STEPS = 9
DECAY = 0.995  # every position's counts shrink by this at each step with drafts: the acceptance follows the text
PRIOR_ACCEPTANCE = 0.5  # a position never attempted (and none before it either)
PRIOR_ATTEMPTS = 2.0  # pseudo-attempts a position's estimate starts from, at the position before it's figure


@dataclass
class Mean:
    """A running mean (SMOOTHING the weight of a new sample)."""

    value: float
    samples: int = 1
    at: int = 0  # the bucket's step count when last updated

    def add(self, x: float, at: int) -> None:
        self.value += SMOOTHING * (x - self.value)
        self.samples += 1
        self.at = at


@dataclass
class RecentMedian:
    """The median of the last RECENT_STEPS samples: one outlier among them does not move it."""

    recent: deque[float]  # [<= RECENT_STEPS] the last samples, oldest first
    samples: int = 1
    at: int = 0  # the bucket's step count when last updated
    restarting: bool = False  # the next sample starts the window afresh
    _median: float | None = None  # the window's median, kept until it changes (the rule reads it many times a step)

    @classmethod
    def of(cls, x: float, at: int) -> RecentMedian:
        return cls(deque([x], maxlen=RECENT_STEPS), 1, at)

    @property
    def value(self) -> float:
        if self._median is None:
            self._median = statistics.median(self.recent)
        return self._median

    def restart(self) -> None:
        """A measurement again (a recheck): the samples from its next on replace the window, which keeps its value
        until then."""
        self.restarting = True

    def add(self, x: float, at: int) -> None:
        if self.restarting:
            self.recent.clear()
            self.restarting = False
        self.recent.append(x)
        self._median = None
        self.samples += 1
        self.at = at


@dataclass
class BucketCosts:
    """One load bucket's figures."""

    step: dict[int, RecentMedian] = field(default_factory=dict)  # k -> seconds a step
    draft_forward: Mean | None = None  # seconds one draft forward takes (propose / k)
    steps: int = 0  # steps planned in this bucket
    credit: float = 0.0  # seconds of probe loss this bucket's steps earned, less its probes' (the rule's Probes)

    def observe(self, k: int, seconds: float, propose_seconds: float | None) -> None:
        m = self.step.get(k)
        if m is None:
            self.step[k] = RecentMedian.of(seconds, self.steps)
        else:
            m.add(seconds, self.steps)
        if k > 0 and propose_seconds is not None and propose_seconds > 0.0:
            x = propose_seconds / k
            if self.draft_forward is None:
                self.draft_forward = Mean(x, 1, self.steps)
            else:
                self.draft_forward.add(x, self.steps)

    def line(self) -> tuple[float, float] | None:
        """(a, s): a least-squares line seconds = a + s * k through the measured k's; None below two of them."""
        pts = [(k, m.value) for k, m in self.step.items()]
        if len(pts) < 2:
            return None
        n = len(pts)
        mk = sum(k for k, _ in pts) / n
        mt = sum(t for _, t in pts) / n
        var = sum((k - mk) ** 2 for k, _ in pts)
        s = sum((k - mk) * (t - mt) for k, t in pts) / var
        return mt - s * mk, max(s, 0.0)

    def seconds(self, k: int) -> float | None:
        """The step's seconds at k: measured, else between the measured k's either side of it (a straight line
        between them), else from the line through all of them (None: fewer than two measured)."""
        m = self.step.get(k)
        if m is not None:
            return m.value
        below = [j for j in self.step if j < k]
        above = [j for j in self.step if j > k]
        if below and above:
            lo, hi = max(below), min(above)
            t0, t1 = self.step[lo].value, self.step[hi].value
            return t0 + (t1 - t0) * (k - lo) / (hi - lo)
        line = self.line()
        if line is None:
            return None
        return max(line[0] + line[1] * k, 1e-9)

    def slope(self) -> float | None:
        """Seconds one more k adds to a step (the line's slope)."""
        line = self.line()
        return None if line is None else line[1]

    def verify_slope(self) -> float | None:
        """The verify's share of the slope: what one more draft a request costs the target, the draft forwards
        aside (their count is the step's k, whatever one request's)."""
        s = self.slope()
        if s is None:
            return None
        d = self.draft_forward.value if self.draft_forward is not None else 0.0
        return max(s - d, 0.0)


MIN_CATCH_UP_TOKENS = 64  # the per-token catch-up figure divides by at least this many tokens


@dataclass
class CatchUpCost:
    """Seconds a token of the draft's catch-up adds to the first step at k > 0 after k = 0: the recent catch-ups'
    extra seconds over their tokens (both decayed by SMOOTHING a catch-up), divided by at least MIN_CATCH_UP_TOKENS
    tokens. A small catch-up's extra time is mostly the step's own noise: read alone (0.7 ms over 4 tokens on an H100
    at batch 1) it priced every later probe out of the draft length rule's credit."""

    seconds: float = 0.0
    tokens: float = 0.0

    def add(self, extra_seconds: float, tokens: int) -> float:
        """One catch-up of `tokens` whose step took `extra_seconds` more than its k's figure; returns the figure."""
        keep = 1.0 - SMOOTHING
        self.seconds = keep * self.seconds + extra_seconds
        self.tokens = keep * self.tokens + tokens
        return self.seconds / max(self.tokens, MIN_CATCH_UP_TOKENS)


@dataclass
class Acceptance:
    """Conditional acceptance per draft position: attempts and accepts, decayed."""

    attempts: list[float] = field(default_factory=list)
    accepts: list[float] = field(default_factory=list)
    drafts: int = 0  # verifies recorded

    def record(self, k: int, accepted: int, decay: bool = True) -> None:
        """A verify of k drafts that accepted `accepted` of them: positions 1..accepted + 1 (up to k) were
        attempted, 1..accepted accepted. decay: shrink the older counts first (False: a step's verifies after
        its first, so that the counts decay by step, not by request: a large batch's figure covers as many steps
        as a small one's, from far more verifies)."""
        if k <= 0:
            return
        self.drafts += 1
        while len(self.attempts) < k:
            self.attempts.append(0.0)
            self.accepts.append(0.0)
        if decay:
            # Every position ages, attempted or not: a deep position runs only in probes while a smaller k wins,
            # and a few unlucky readings of it must fade back toward the position before it, not hold for ever.
            for i in range(len(self.attempts)):
                self.attempts[i] *= DECAY
                self.accepts[i] *= DECAY
        for i in range(min(accepted + 1, k)):
            self.attempts[i] += 1.0
            self.accepts[i] += 1.0 if i < accepted else 0.0

    def variances(self, k: int) -> list[float]:
        """The variance of each of a_1..a_k's estimates: a Beta posterior's over its decayed counts (uniform
        prior), so a position with few attempts (or none: 1/12) is uncertain and one at 0 or 1 is not exactly so."""
        out = []
        for i in range(k):
            n = self.attempts[i] if i < len(self.attempts) else 0.0
            s = self.accepts[i] if i < len(self.accepts) else 0.0
            out.append((s + 1.0) * (n - s + 1.0) / ((n + 2.0) ** 2 * (n + 3.0)))
        return out

    def rates(self, k: int, fallback: list[float] | None = None) -> list[float]:
        """a_1..a_k: each position's counts shrunk toward a centre by PRIOR_ATTEMPTS pseudo-attempts (a Beta
        prior's mean): `fallback`'s figure for the position where given, else the position before it's, else
        PRIOR_ACCEPTANCE. A position never attempted takes the centre itself.

        Why shrink: a deep position is attempted only when every draft before it was accepted, so early in a run it
        has one or two attempts. Read raw, one rejection there put it at 0, its k could not pay, and the rule never
        ran that k again until a probe, which at batch 1 comes every few hundred steps (a Qwen3-8B + 0.6B pair at
        acceptance 0.8 held k = 3 where k = 4 was 9% faster). Shrunk toward the position before it (drafts' conditional
        acceptance changes slowly along a draft), the same rejection leaves it at 0.53 and k = 4 keeps running,
        where its own attempts soon outweigh the prior."""
        out: list[float] = []
        for i in range(k):
            if fallback is not None and i < len(fallback):
                centre = fallback[i]
            else:
                centre = out[-1] if out else PRIOR_ACCEPTANCE
            n = self.attempts[i] if i < len(self.attempts) else 0.0
            s = self.accepts[i] if i < len(self.accepts) else 0.0
            out.append((s + PRIOR_ATTEMPTS * centre) / (n + PRIOR_ATTEMPTS))
        return out


def reach(rates: list[float]) -> list[float]:
    """c_i = prod_{j <= i} a_j: the chance that draft i is accepted (every one before it was)."""
    out, c = [], 1.0
    for a in rates:
        c *= a
        out.append(c)
    return out


def expected_tokens(rates: list[float], k: int) -> float:
    """Tokens a request commits on average at k: 1 + the expected accepted drafts."""
    return 1.0 + sum(reach(rates[:k]))


def expected_tokens_std(rates: list[float], variances: list[float], k: int) -> float:
    """The standard deviation of expected_tokens(rates, k) from its positions' estimates (first order: the
    positions' estimates independent, d c_i / d a_j the product of the other a's up to i)."""
    var = 0.0
    for j in range(k):
        d = 0.0
        for i in range(j, k):
            d += prod(a for m, a in enumerate(rates[:i + 1]) if m != j)
        var += d * d * variances[j]
    return var ** 0.5
