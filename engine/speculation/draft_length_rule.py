"""The draft length k of each step, chosen from measured costs: as many committed tokens a second as the figures
promise.

Why: speculation pays only while the draft's k forwards plus a verify of k + 1 tokens a request cost less than the
tokens they commit, and that depends on the pair, the batch, the acceptance and the device. A draft that accepts
nothing and costs 3/4 of a target step made a batch of 8 run at 0.18x the target alone with a fixed k = 4; the
same pair at batch 1 on a GPU whose step is bound by reading the weights gains. No fixed k fits both, so the
engine measures (engine/speculation/draft_cost_model.py) and chooses, every step, the k in 0..num_speculative_tokens
that maximizes E(k) / T(k): E(k) the tokens a request commits on average at k (from the acceptance per position),
T(k) the step's seconds at k at the current load. k = 0 stops speculating: the draft does not run, and it catches up
on the tokens it missed in one batched prefill (from its prefix cache where it has one) at the next step with k > 0.
k = 0 measures no acceptance, so an estimate that put it first by bad luck would hold there until a probe: the rule
takes k = 0 only where it also beats the best k > 0 by UNCERTAINTY standard deviations of that k's estimate (from
the acceptance counts' own spread, draft_cost_model.expected_tokens_std). A near tie (a pair whose best k gains 6%,
about the spread of an estimate from a few dozen verifies) stays speculating; a draft that loses clearly stops.

Probes: the figures of the k's not chosen go stale as load and acceptance change (and the acceptance is only
measured while drafting), so the rule runs PROBE_STEPS steps at another k now and then: first one that may beat the
best on its acceptance's uncertainty (UNCERTAINTY standard deviations added: a deep position is attempted only when
every draft before it was accepted, so one unlucky early reading of it held a batch-1 pair at k = 3 where k = 4 was
6-9% faster), then one never measured (the likeliest winner), then the one whose figure is oldest. At most one
probe starts every MIN_PROBE_GAP steps of a bucket, and only while the bucket's credit covers its expected loss:
the credit grows by PROBE_SHARE of every other step's time in the bucket and pays each probe's real loss, its time
less the time the best k takes to commit the same tokens (a catch-up after k = 0 is all loss), priced on the
hopeful side of k's acceptance (UNCERTAINTY standard deviations up): a figure from a few unlucky verifies is cheap to
check, a settled one is not. So probes cost about PROBE_SHARE of the throughput at each load: a near tie's
runner-up, which loses almost nothing, is probed as often as the gap allows, a draft that accepts nothing rarely
(priced at their whole time, probes of k = 4 from k = 3 came every 140 steps at batch 1).
Forced probes, the line's second point (the other end of 0..K, as soon as the first k has a figure) and the
rechecks, run whatever the credit and are not paid from it: their own rules bound them, and paying for a bucket's
warm-up left the credit in debt for hundreds of steps.

Rechecks: a burst of slow steps (a garbage collection, a host stall) lifts the figure of the k running through it,
or falls on a k's first probe, and such a figure would hold the rule off that k until a probe (an H100 gemma pair
ran k = 1-2 for the rest of a run after one burst, where k = 0 ran at the target alone's speed). So a k the rule
leaves, and a k measured once and not chosen, is measured again RECHECK_STEPS steps later, once per leave or first
figure; the recheck's steps replace the k's figure (its RECENT_STEPS window would otherwise still hold the burst's).
From k = 0 a recheck of k > 0 costs the draft's catch-up, so the credit buys it like a probe, else it is dropped.

Leaving k = 0 costs the draft's catch-up on every token it missed: the destination must still win with that catch-up
spread over MOVE_HORIZON steps of it, on a figure from the bucket's last FRESH_STEPS steps, else a probe of it comes
first (a slowdown of every k shows first in the k that runs, and reads as a win against an old figure of another).
That probe pays from the credit its steps' loss only: the catch-up is the move's, which the figures say pays back.

Per request: a request whose own acceptance does not pay for the step's last drafts drafts fewer (engine/
speculation/draft_length_per_request.py). A seeded request at temperature > 0 keeps num_speculative_tokens
(draft_length_control.py pins its steps): its samples depend on the k's it is verified at, and its seed promises one
output whatever the load.

Exactness does not depend on the rule: k is chosen from what earlier steps committed, before the step's drafts
exist, and every k verifies losslessly. The clock is injectable: tests drive the rule with simulated step times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.speculation.draft_cost_model import (
    Acceptance,
    BucketCosts,
    CatchUpCost,
    expected_tokens,
    expected_tokens_std,
)
from engine.speculation.draft_length_per_request import RequestDraftLengths

SETTLE_STEPS = 1  # steps after a switch of k or bucket not timed (a catch-up, or the step before still in flight)
WINDOW_STEPS = 3  # timed steps a probe runs
PROBE_STEPS = SETTLE_STEPS + WINDOW_STEPS
MIN_PROBE_GAP = 32  # steps of a bucket between the starts of two probes, at least
RECHECK_STEPS = 16  # steps of a bucket after which a k left or measured once is measured again (see Rechecks)
REPRICE_STEPS = 8  # steps of a bucket after which a probe the credit could not buy is priced again
MOVE_HORIZON = 32  # steps of a k > 0 over which a move there from k = 0 must pay back the draft's catch-up
FRESH_STEPS = 32  # a k's figure taken within this many steps of its bucket may move the rule there from k = 0
PROBE_SHARE = 0.01  # share of the engine's time probes may lose (against the best k)
MARGIN = 0.02  # the current k is kept unless another promises this share more tokens a second
UNCERTAINTY = 1.0  # standard deviations of a k > 0's acceptance-driven estimate by which k = 0 must beat it
MAX_PLANNED = 64  # plans awaiting their commit kept at most


def bucket_of(num_requests: int) -> int:
    """1 -> 0, 2-3 -> 1, 4-7 -> 2, ...: the load buckets (those of the speculation-ahead gate)."""
    return max(num_requests, 1).bit_length() - 1


@dataclass
class _Planned:
    bucket: int
    k: int
    at: float
    timed: bool  # every request of the step decodes (prefill chunks would make its time another step's)
    probe: bool  # a probe paid from the credit
    catch_up: int  # tokens the draft catches up on in this step
    batch: int  # requests in the step
    best_rate: float | None  # a paid probe's: tokens a second a request commits at the best k (its loss's measure)


class DraftLengthRule:
    """See the module docstring. `max_k`: num_speculative_tokens."""

    def __init__(self, max_k: int, clock=time.perf_counter) -> None:  # noqa: ANN001 - a () -> float
        self.max_k = max_k
        self.clock = clock
        self.buckets: dict[int, BucketCosts] = {}
        self.acceptance = Acceptance()
        self.per_request = RequestDraftLengths()
        self._planned: dict[int, _Planned] = {}
        self._current: dict[int, int] = {}  # bucket -> the k it runs outside probes
        self._probe: dict[int, tuple[int, int, bool, float | None]] = {}  # bucket -> (k, steps left, forced, rate)
        self._last_probe: dict[int, int] = {}  # bucket -> its step count at its last probe's start
        self._recheck: dict[int, dict[int, int]] = {}  # bucket -> {k to measure again: the bucket's step count then}
        self._run: tuple[int, int] | None = None  # (bucket, k) of the steps committed since the last switch
        self._run_steps = 0  # and how many
        self._last_commit: float | None = None
        self.last_k, self.last_bucket, self.last_batch = max_k, 0, 1  # the last step's k, bucket and requests
        self.steps_at_zero = 0  # steps chosen with k = 0
        self.probe_steps = 0  # steps run as probes
        self.steps = 0  # steps chosen
        self._probing = False  # the last choice was a probe
        self._forced = False  # the last choice was a forced probe (see Probes): not paid from the credit
        self._paid_rate: float | None = None  # a paid probe's: the best k's tokens a second a request (its loss)
        self._short: dict[int, tuple[float, int]] = {}  # bucket -> (credit its last priced probe needed, step then)
        self._rates: dict[int, float] = {}  # the last choice's tokens a second a request by k (see `rates`)
        # What the draft missed, as of the last choice: a count, or a function counting it, called only where a probe
        # is priced (a count over a batch of 64 at every step cost as much host time as the rule's choice).
        self._catch_up_tokens: int | Callable[[], int] = 0
        # Seconds a token of the draft's catch-up adds to the first step at k > 0 after k = 0 (part of a probe's cost).
        self.catch_up_token_seconds: float | None = None
        self.catch_up_cost = CatchUpCost()  # where that figure comes from

    # --- choosing --------------------------------------------------------------------------------------
    def choose(self, batch_size: int, catch_up_tokens: int | Callable[[], int] = 0) -> int:
        """k for the next step, whose load is `batch_size` requests; catch_up_tokens: what the draft would have to
        catch up on at a step with k > 0 (the tokens it missed while k was 0), a probe's cost beyond its steps (or a
        function that counts them, called only where needed)."""
        self._catch_up_tokens = catch_up_tokens
        self.per_request.new_figures()
        b = bucket_of(batch_size)
        st = self.buckets.setdefault(b, BucketCosts())
        st.steps += 1
        k, probing = self._choose(b, st)
        self.last_k, self.last_bucket, self.last_batch = k, b, max(batch_size, 1)
        self.steps += 1
        self.steps_at_zero += k == 0
        self.probe_steps += probing
        self._probing = probing
        return k

    def pin(self, k: int) -> int:
        """Override the last choice with `k` (a step whose k must not follow the measurements); returns k. The step
        is booked at k, not as a probe."""
        self.steps_at_zero += (k == 0) - (self.last_k == 0)
        self.probe_steps -= self._probing
        self.last_k, self._probing = k, False
        return k

    def _choose(self, b: int, st: BucketCosts) -> tuple[int, bool]:
        probe = self._probe.get(b)
        if probe is not None:
            k, left, self._forced, self._paid_rate = probe
            if left > 1:
                self._probe[b] = (k, left - 1, self._forced, self._paid_rate)
            else:
                del self._probe[b]
            return k, True
        self._forced, self._paid_rate = False, None
        measured = [k for k, m in st.step.items() if m.samples >= WINDOW_STEPS]
        if not st.step:
            return self.max_k, False  # nothing measured here: the configured k, to measure it
        if len(st.step) < 2:
            only = next(iter(st.step))
            if not measured:
                return only, False
            return self._start_probe(b, st, self.max_k if only == 0 else 0, forced=True), True  # the line's 2nd point
        best, wanted = self._best(b, st)
        due = self._recheck.get(b, {})
        due.pop(best, None)  # the k that runs is measured as it runs
        k = min((k for k, at in due.items() if st.steps - at >= RECHECK_STEPS), key=due.get, default=None)
        if k is not None:
            del due[k]
            # From k = 0 a recheck of k > 0 costs the draft's catch-up on every token it missed: paid from the credit
            # like any probe, else dropped (the paid probes measure k again when they can afford it).
            paid = best == 0 and k > 0 and self.catch_up_token_seconds is not None
            if paid and st.credit < self._probe_cost(st, k):
                return best, False
            if k in st.step:
                st.step[k].restart()  # measured again: the burst's samples go
            return self._start_probe(b, st, k, forced=not paid, rate=self._best_rate() if paid else None), True
        # A probe's target and price read every k's figures: only past the gap, and again only once the credit reaches
        # what the last priced probe needed or REPRICE_STEPS later (the figures move; another target may be cheaper).
        short, at = self._short.get(b, (0.0, 0))
        if (st.steps - self._last_probe.get(b, 0) >= MIN_PROBE_GAP
                and (st.credit >= short or st.steps - at >= REPRICE_STEPS)):
            target = wanted if wanted is not None else self._probe_target(st, best)
            if target is not None:
                # Before a move out of k = 0, not the catch-up (see Leaving k = 0): charged it, a probe where the draft
                # misses more a step than the credit earns was never bought (an H100 Qwen3-8B + 0.6B pair held k = 0
                # at batch 32 where k = 3 ran 26% faster).
                cost = self._probe_cost(st, target, catch_up=target != wanted)
                if st.credit >= cost:
                    self._short.pop(b, None)
                    return self._start_probe(b, st, target, rate=self._best_rate()), True
                self._short[b] = (cost, st.steps)
        return best, False

    def _probe_cost(self, st: BucketCosts, k: int, catch_up: bool = True) -> float:
        """A probe of k's expected loss: its steps' time less the time the best k takes to commit the tokens they
        are expected to, and the draft's catch-up on what it missed (counted only once the steps alone fit the
        credit: the count walks the running requests)."""
        t = st.seconds(k) or 0.0
        best_rate = self._best_rate()
        lost = t
        if best_rate:
            # Priced on the hopeful side of k's acceptance (UNCERTAINTY standard deviations up): what a probe buys
            # is that estimate's truth, so one read from a few unlucky verifies is cheap to check, a settled one not.
            rates = self.acceptance.rates(k)
            hopeful = expected_tokens(rates, k) + UNCERTAINTY * expected_tokens_std(
                rates, self.acceptance.variances(k), k)
            lost = max(t - hopeful / best_rate, 0.0)
        cost = PROBE_STEPS * lost
        if catch_up and st.credit >= cost and k > 0 and self.catch_up_token_seconds is not None:
            cost += self._missed() * self.catch_up_token_seconds
        return cost

    def _best_rate(self) -> float | None:
        """The last choice's best tokens a second a request (what a paid probe's loss is measured against)."""
        return max(self._rates.values(), default=None)

    def _missed(self) -> int:
        """The last choice's catch-up tokens (counted once, where given as a function)."""
        if callable(self._catch_up_tokens):
            self._catch_up_tokens = int(self._catch_up_tokens())
        return self._catch_up_tokens

    def _start_probe(self, b: int, st: BucketCosts, k: int, forced: bool = False, rate: float | None = None) -> int:
        """Start a probe of k: forced (not paid from the credit), or paid and priced against `rate`, the best k's
        tokens a second a request."""
        self._forced, self._paid_rate = forced, rate
        self._last_probe[b] = st.steps
        if PROBE_STEPS > 1:
            self._probe[b] = (k, PROBE_STEPS - 1, forced, rate)
        return k

    def _probe_target(self, st: BucketCosts, best: int) -> int | None:
        """The k to probe, other than `best` (see Probes): one that may beat it, the likeliest first; then one never
        measured, the likeliest winner among them; then the one whose figure is oldest."""
        others = [k for k in range(self.max_k + 1) if k != best]
        if not others:
            return None
        rates = self._rates
        if best in rates:
            hopeful = {k: rates[k] + UNCERTAINTY * self._spread(st, k) for k in others if k > 0 and k in rates}
            hopeful = {k: r for k, r in hopeful.items() if r >= rates[best]}
            if hopeful:
                return max(hopeful, key=lambda k: (hopeful[k], -k))
        new = [k for k in others if k not in st.step]
        if new:
            return max(new, key=lambda k: (rates.get(k, 0.0), -k))
        return min(others, key=lambda k: (st.step[k].at, k))

    def _spread(self, st: BucketCosts, k: int) -> float:
        """The standard deviation of k's tokens a second from its acceptance estimates (0 without a figure)."""
        t = st.seconds(k)
        if not t:
            return 0.0
        return expected_tokens_std(self.acceptance.rates(k), self.acceptance.variances(k), k) / t

    def rates(self, st: BucketCosts) -> dict[int, float]:
        """k -> the tokens a second a request is expected to commit at k (only k's with a time figure)."""
        a = self.acceptance.rates(self.max_k)
        out = {}
        for k in range(self.max_k + 1):
            t = st.seconds(k)
            if t is not None and t > 0.0:
                out[k] = expected_tokens(a, k) / t
        return out

    def _best(self, b: int, st: BucketCosts) -> tuple[int, int | None]:
        """(the k to run, a k > 0 to probe first before leaving k = 0 for it, or None)."""
        rates = self._rates = self.rates(st)  # the choice's figures, read again by a probe's target and price
        best = max(rates, key=lambda k: (rates[k], -k))  # ties: the smaller k (less work)
        cur = self._current.get(b)
        if cur is not None and cur in rates and rates[cur] >= (1.0 - MARGIN) * rates[best]:
            best = cur
        if best == 0 and cur != 0:
            # k = 0 measures no acceptance, so a move there on an unlucky estimate would stick until a probe: it
            # takes k = 0 beating the best k > 0's estimate by UNCERTAINTY standard deviations of it as well. Not
            # at k = 0 already: there a near tie sent the rule to probe k > 0, paying a catch-up, every 32 steps.
            drafting = [k for k in rates if k > 0]
            if drafting:
                kb = max(drafting, key=lambda k: (rates[k], -k))
                if rates[kb] + UNCERTAINTY * self._spread(st, kb) >= (1.0 - MARGIN) * rates[0]:
                    best = kb
        wanted = None
        if cur == 0 and best > 0 and 0 in rates and self.catch_up_token_seconds is not None:
            # The move pays the draft's catch-up first: it must still win over MOVE_HORIZON steps of the new k.
            horizon = MOVE_HORIZON * (st.seconds(best) or 0.0)
            catch_up = self._missed() * self.catch_up_token_seconds
            if rates[best] * horizon < rates[0] * (horizon + catch_up):
                best = 0
        if cur == 0 and best > 0 and ((m := st.step.get(best)) is None or st.steps - m.at > FRESH_STEPS):
            # Leaving k = 0 needs the destination's figure from now (see Leaving k = 0: an H100 gemma pair at batch
            # 64 moved to k = 1 on a figure hundreds of steps old and paid a 95 ms catch-up): probed first, the rule
            # staying at k = 0 until then.
            wanted, best = best, 0
        if cur is not None and cur != best:
            self._recheck.setdefault(b, {})[cur] = st.steps  # left: measured again later (see Rechecks)
        self._current[b] = best
        return best, wanted

    def request_k(self, request_id: str, k: int) -> int:
        """The k of one request in a step of k: less where its own acceptance does not pay for the last drafts."""
        return self.per_request.k(request_id, k, self._threshold)

    def _threshold(self, k: int) -> tuple[float | None, list[float]]:
        """(the reach a request's last draft at k must have to pay for its row of the verify: E(k) x (v / B) / T(k),
        from the figures of the last choice's bucket, None without them; the batch's rates a_1..a_k)."""
        rates = self.acceptance.rates(k)
        st = self.buckets.get(self.last_bucket)
        if st is not None:
            t, v = st.seconds(k), st.verify_slope()
            if t is not None and v is not None and t > 0.0:
                return expected_tokens(rates, k) * v / (self.last_batch * t), rates
        return None, rates

    # --- measuring -------------------------------------------------------------------------------------
    def planned(self, step_id: int, k: int, timed: bool) -> None:
        """Step `step_id` was planned (now) at k, the k the last `choose` returned. timed: every request of it
        decodes."""
        catch_up = self._missed() if k > 0 else 0
        paid = self._probing and not self._forced
        self._planned[step_id] = _Planned(self.last_bucket, k, self.clock(), timed, paid, catch_up, self.last_batch,
                                          self._paid_rate if paid else None)
        while len(self._planned) > MAX_PLANNED:  # plans never committed (a failed step) are not kept for ever
            self._planned.pop(next(iter(self._planned)))

    def observe(self, step_id: int, verifies: list[tuple[str, int, int]], propose_seconds: float | None,
                drafted: bool = True) -> None:
        """Step `step_id` committed (now). verifies: (request id, k, accepted) of each request it verified drafts
        for; propose_seconds: its propose phase; drafted: whether any request of it drafted (False where every
        request's k shrank to 0, at max_tokens or max_model_len: the draft sat the step out, so it ran as k = 0)."""
        self.per_request.new_figures()  # the figures the cut reads change with this commit
        for n, (rid, k, accepted) in enumerate(verifies):
            self.acceptance.record(k, accepted, decay=n == 0)
            self.per_request.record(rid, k, accepted)
        now = self.clock()
        p = self._planned.pop(step_id, None)
        last, self._last_commit = self._last_commit, now
        if p is None:
            return
        if p.k > 0 and not drafted:
            p.k, p.catch_up = 0, 0  # booked as what ran: no draft forward, no catch-up
        # The engine's period from the last commit to this one: all a step costs, the host's share too (committing
        # and detokenizing the last step's tokens, scheduling this one), which in-process speculation runs between
        # a commit and the next plan. Timing from the plan instead left that out: 1-5 ms a step of a batch of 32 on
        # a GPU, enough to make a losing k look 1.6x faster than it ran. Idle time (no request running) ends in a
        # step with a prefill, which is never timed and earns no credit.
        dt = max(0.0, now - (p.at if last is None else last))
        st = self.buckets.setdefault(p.bucket, BucketCosts())
        if p.timed:
            # A probe pays its real time (a catch-up included) out of its bucket's credit; every other step earns its
            # share there. Per bucket, so that probes at a load are paid by steps at that load: a credit earned over a
            # quiet hour at batch 1 is not spent on catch-ups at batch 64, the load where throughput matters most
            # (one shared credit, banked over a benchmark's earlier rows, cost its batch-64 row 5-8%).
            if not p.probe:
                st.credit += PROBE_SHARE * dt
            else:  # its time less the time the best k takes to commit its tokens (one at k = 0)
                tokens = p.batch + sum(accepted for _, _, accepted in verifies)
                st.credit -= max(dt - tokens / (p.best_rate * p.batch), 0.0) if p.best_rate else dt
        if self._run != (p.bucket, p.k):
            self._run, self._run_steps = (p.bucket, p.k), 0
        self._run_steps += 1
        if p.catch_up > 0 and p.timed and (t := st.seconds(p.k)) is not None:
            self.catch_up_token_seconds = self.catch_up_cost.add(max(dt - t, 0.0), p.catch_up)
        if self._run_steps <= SETTLE_STEPS or not p.timed or dt <= 0.0:
            return
        if p.k not in st.step:
            self._recheck.setdefault(p.bucket, {})[p.k] = st.steps  # a first figure: confirmed later (Rechecks)
        st.observe(p.k, dt, propose_seconds if p.k else None)

    def forget(self, request_id: str) -> None:
        """A request ended: its own acceptance is no longer needed."""
        self.per_request.forget(request_id)

    # --- reporting -------------------------------------------------------------------------------------
    def estimates(self) -> dict[str, dict[int, float]]:
        """The figures of the last step's bucket, for gauges: "step_seconds" and "tokens_per_second" (a request's)
        by k, "acceptance" by draft position (1-based), "draft_forward_seconds" ({0: seconds})."""
        st = self.buckets.get(self.last_bucket)
        out: dict[str, dict[int, float]] = {"acceptance": dict(enumerate(self.acceptance.rates(self.max_k), 1))}
        if st is None:
            return out
        out["step_seconds"] = {k: t for k in range(self.max_k + 1) if (t := st.seconds(k)) is not None}
        out["tokens_per_second"] = self.rates(st)
        if st.draft_forward is not None:
            out["draft_forward_seconds"] = {0: st.draft_forward.value}
        return out
