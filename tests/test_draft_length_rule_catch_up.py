"""The draft length rule (engine/speculation/draft_length_rule.py) around k = 0, where the draft's catch-up on the
tokens it missed is part of what leaving k = 0 costs: probes priced with it, rechecks from k = 0 paid for, a move
from k = 0 that must pay it back, and a step in which no request drafted booked as the k = 0 step it ran as. On a
simulated clock, with the helpers of tests/test_draft_length_rule.py.
"""

from __future__ import annotations

import random

import pytest
from test_draft_length_rule import Clock, K, drive, step_seconds

from engine.speculation import draft_length_rule as rule_mod
from engine.speculation.draft_cost_model import Acceptance, BucketCosts, expected_tokens
from engine.speculation.draft_length_rule import DraftLengthRule

pytestmark = pytest.mark.usefixtures("one_thread")


def draws(rng: random.Random, batch: int, k: int, accept: float) -> list[tuple[str, int, int]]:
    """(request id, k, accepted) of each request of a batch whose drafts are each accepted with chance `accept`."""
    out = []
    for r in range(batch):
        n = 0
        while n < k and rng.random() < accept:
            n += 1
        out.append((f"r{r}", k, n))
    return out


def test_probes_pay_for_the_drafts_catch_up():
    """A probe of k > 0 after steps at k = 0 costs the draft's catch-up on every token it missed, which grows with
    the time at k = 0: the rule measures that cost and waits until its credit covers it, so probing stays within
    its share of the time however long the catch-up."""
    clock = Clock()
    rule = DraftLengthRule(K, clock=clock)
    batch, draft, per_token = 8, 0.75, 0.05  # a caught-up token costs 1/20 of a target step
    missed, probe_time, total = 0, 0.0, 0.0
    for i in range(4000):
        k = rule.choose(batch, missed)
        probed = rule._probing
        rule.planned(i, k, timed=True)
        dt = step_seconds(batch, k, draft) + (missed * per_token if k else 0.0)
        missed = missed + batch if k == 0 else 0
        clock.t += dt
        rule.observe(i, [(f"r{r}", k, 0) for r in range(batch)] if k else [], k * draft if k else None)
        total += dt
        probe_time += dt if probed else 0.0
    assert rule.catch_up_token_seconds == pytest.approx(per_token, rel=0.05)
    first = 2 * rule_mod.PROBE_STEPS * step_seconds(batch, K, draft) + 32 * batch * per_token * 4
    assert probe_time <= rule_mod.PROBE_SHARE * total + first, (probe_time / total)
    assert rule.steps_at_zero >= 0.9 * 4000


def test_a_recheck_from_k_zero_is_paid_for():
    """The rule leaves k = 3 for k = 0 when k = 3's steps slow down (here for good), and a k it leaves is measured
    again later. From k = 0 that recheck costs the draft's catch-up on every token the batch missed: it is bought
    from the credit like any probe, else dropped. Forced (as it once was), each leave cost a catch-up of 16 steps of
    64 requests, 51 target steps' time here (two unpaid moves from k = 0, 5300 tokens of catch-up each, cost an
    H200 Qwen3-8B + 0.6B batch of 64 about 10% of a run)."""
    clock = Clock()
    rule = DraftLengthRule(K, clock=clock)
    batch, per_token, rng = 64, 0.05, random.Random(0)

    def seconds(k: int, slow: bool) -> float:
        return 1.0 if k == 0 else (1.2 if not slow else 4.0) + 0.1 * k

    missed, left, lost = 0, False, 0.0
    for i in range(1200):
        slow = i >= 300
        k = rule.choose(batch, missed)
        paid = rule._probing and not rule._forced
        left = left or (slow and k == 0 and not rule._probing)
        rule.planned(i, k, timed=True)
        dt = seconds(k, slow) + (missed * per_token if k else 0.0)
        missed = missed + batch if k == 0 else 0
        clock.t += dt
        verifies = draws(rng, batch, k, 0.8)
        rule.observe(i, verifies if k else [], 0.1 * k if k else None)
        if left and k and not paid:
            lost += dt
    assert rule.last_k == 0
    assert lost == 0.0, lost  # past the leave, no step at k > 0 but those the credit bought


def settled_figures(gains: dict[int, float], steps: int) -> tuple[DraftLengthRule, int, BucketCosts]:
    """A rule with k = 3 the longest (no line beyond it) whose bucket of 64 requests holds nine steps of each k,
    taken at its step 0: k = 0 one token a request in 1.0 s, each k > 0 `gains[k]` times k = 0's tokens a second at
    a settled acceptance (4000 verifies of 3 drafts, one in five rejecting at the second). Its step count: `steps`."""
    rule = DraftLengthRule(3)
    b = rule_mod.bucket_of(64)
    st = rule.buckets[b] = BucketCosts()
    for i in range(4000):
        rule.acceptance.record(3, 3 if i % 5 else 1)
    rates = rule.acceptance.rates(3)
    for _ in range(9):
        st.observe(0, 1.0, None)
        for k, gain in gains.items():
            st.observe(k, expected_tokens(rates, k) / gain, 0.1 * k)
    st.steps = steps
    return rule, b, st


@pytest.mark.parametrize("missed, moves", [(0, True), (640, False)])
def test_leaving_k_zero_pays_back_the_catch_up(missed, moves):
    """At k = 0 with a fresh figure of k = 3 that promises 3% more (a near tie), the move is made only if it still
    wins once the draft's catch-up on what it missed (here 10 steps of 64 requests, 0.01 s a token) is spread over
    MOVE_HORIZON steps of k = 3."""
    rule, b, st = settled_figures({1: 0.9, 2: 0.9, 3: 1.03}, steps=100)
    for m in st.step.values():
        m.at = st.steps
    rule._current[b] = 0
    rule.catch_up_token_seconds = 0.01
    rule._last_probe[b] = st.steps  # no probe due: the choice alone
    assert (rule.choose(64, missed) == 3) == moves


def test_a_step_where_no_request_drafted_is_booked_at_k_zero():
    """The last step of requests one token from max_tokens: the step's k is 3 but every request's shrank to 0, so the
    draft sat it out. Booked at k = 3 with the draft's catch-up count, its short time read as a free catch-up (the
    per-token figure cut by SMOOTHING each time) and as a fast k = 3 step; it is booked as the k = 0 step it was."""
    clock = Clock()
    rule = DraftLengthRule(K, clock=clock)
    drive(rule, clock, 200, 8, 0.0, draft=0.75)  # a draft that accepts nothing: the rule settles at k = 0
    b = rule_mod.bucket_of(8)
    rule.catch_up_token_seconds = 0.01
    k3 = list(rule.buckets[b].step[3].recent) if 3 in rule.buckets[b].step else []
    zero_samples = rule.buckets[b].step[0].samples
    for i in range(200, 205):
        rule.choose(8, 80)
        rule.pin(3)
        rule.planned(i, 3, timed=True)
        clock.t += step_seconds(8, 0, 0.75)
        rule.observe(i, [], None, drafted=False)
    assert rule.catch_up_token_seconds == 0.01
    assert (list(rule.buckets[b].step[3].recent) if 3 in rule.buckets[b].step else []) == k3
    assert rule.buckets[b].step[0].samples > zero_samples


def test_credit_earned_at_one_load_is_not_spent_at_another():
    """Probes at a load are paid by the steps at that load: a long run at batch 16 with a draft that accepts nothing
    (k = 0 wins and its probes are dear: the credit grows) buys nothing at batch 64, where k = 0 wins by 5% over a
    near tie whose probe pays the draft's catch-up. One shared credit, banked over a benchmark's earlier rows, spent
    there in catch-ups cost an H200 Qwen3-8B + 0.6B batch of 64 5-8% of its row (here 1.9% of 600 steps)."""
    clock = Clock()
    rule = DraftLengthRule(K, clock=clock)
    drive(rule, clock, 3000, 16, 0.0, draft=0.75)
    assert rule.last_k == 0 and rule.buckets[rule_mod.bucket_of(16)].credit > 5.0
    batch, per_token, missed, rng = 64, 0.002, 0, random.Random(0)

    def seconds(k: int) -> float:  # every k > 0 commits 5% fewer tokens a second than k = 0 (1 token in 1.0)
        return 1.0 if k == 0 else expected_tokens([0.8] * K, k) / 0.95

    total, lost = 0.0, 0.0
    for i in range(3000, 3600):
        k = rule.choose(batch, missed)
        paid = rule._probing and not rule._forced
        rule.planned(i, k, timed=True)
        dt = seconds(k) + (missed * per_token if k else 0.0)
        missed = missed + batch if k == 0 else 0
        clock.t += dt
        verifies = draws(rng, batch, k, 0.8)
        rule.observe(i, verifies if k else [], 0.2 * k if k else None)
        total += dt
        if paid:  # what the step lost against k = 0 committing the same tokens
            lost += dt - seconds(0) * (1 + sum(n for _, _, n in verifies) / batch)
    assert lost <= rule_mod.PROBE_SHARE * total, (lost, total)


def test_k_zero_is_left_when_speculation_wins_again_whatever_the_catch_up():
    """At batch 32 a draft that accepts nothing holds the rule at k = 0 while the draft misses 32 tokens a step. When
    the acceptance rises (as measured at other loads: new traffic) k = 3 promises twice k = 0's rate there, and the
    move pays back its catch-up well within MOVE_HORIZON steps; the probe before it pays its steps' loss, not the
    catch-up. Charged the catch-up, which grows faster than the credit earns, that probe was never bought and the
    rule held k = 0 (an H100 Qwen3-8B + 0.6B pair at batch 32, where k = 3 ran 26% faster)."""
    clock = Clock()
    rule = DraftLengthRule(K, clock=clock)
    batch, per_token, missed = 32, 0.002, 0

    def run(steps: int, start: int, accept: float) -> list[int]:
        nonlocal missed
        rng, ks = random.Random(start), []
        for i in range(start, start + steps):
            k = rule.choose(batch, missed)
            rule.planned(i, k, timed=True)
            dt = 1.0 + 0.25 * k + (missed * per_token if k else 0.0)  # bound by the weights at this batch
            missed = missed + batch if k == 0 else 0
            clock.t += dt
            verifies = draws(rng, batch, k, accept)
            rule.observe(i, verifies if k else [], 0.25 * k if k else None)
            ks.append(k)
        return ks

    assert run(600, 0, 0.0)[-100:] == [0] * 100
    rule.acceptance = Acceptance()
    for i in range(400):
        rule.acceptance.record(K, K if i % 10 else 2)
    ks = run(300, 600, 0.9)
    assert ks.index(next(k for k in ks if k)) <= rule_mod.MIN_PROBE_GAP + rule_mod.PROBE_STEPS
    assert all(k >= 2 for k in ks[-100:]), ks[-100:]


def test_at_k_zero_a_near_tie_stays_at_k_zero():
    """At k = 0 with figures by which k = 3 promises 1.6% more (within MARGIN, a near tie; its figure older than
    FRESH_STEPS), the rule stays at k = 0 and wants no probe of k = 3. The preference for k > 0 in a near tie (k = 0
    must beat the best k > 0 by a standard deviation of it) guards a move to k = 0; applied at k = 0 too, it sent an
    H100 Qwen3-8B + 0.6B batch of 64 to probe k = 4 every 32 steps, each probe paying a catch-up (0.912x the best)."""
    rule, b, st = settled_figures({1: 0.98, 2: 0.98, 3: 1.016}, steps=200)
    st.step[0].at = st.steps
    rule._current[b] = 0
    assert rule._best(b, st) == (0, None)
    rule._current[b] = 3  # from k = 3 the same figures keep k = 3 (a move to k = 0 needs a clear win)
    assert rule._best(b, st) == (3, None)


def test_a_small_catch_up_does_not_price_probes_out():
    """Batch 1 on an H100's Gemma 3 1B + 270M step times, an unlucky start (four verifies at k = 4 reading low, so
    k = 0 looks best). The first catch-up is 4 tokens, whose extra time (the k = 1 step against a figure from the line
    through k = 0 and 4) is mostly the step's own error. Read alone as 0.17 ms a token, it priced every later probe
    (the draft missing a token a step) out of a credit that kept growing: the rule sat at k = 0 with no probe at all
    (the H100 held k = 0 for 250 of 254 steps where k = 3 ran 15% faster). Divided by at least MIN_CATCH_UP_TOKENS,
    the figure stays near the true cost and the probes run."""
    clock = Clock()
    rule = DraftLengthRule(K, clock=clock)
    seconds = {0: 1.95e-3, 1: 3.43e-3, 2: 3.99e-3, 3: 4.56e-3, 4: 5.12e-3}
    per_token, rng, missed = 3e-6, random.Random(0), 0
    start = [(4, 0), (4, 1), (4, 0), (4, 3), (0, 0), (0, 0), (0, 0), (0, 0)]
    for i in range(1200):
        k = rule.choose(1, missed)
        if i < len(start):
            k, n = start[i]
            rule.pin(k)
        rule.planned(i, k, timed=True)
        dt = seconds[k] + (missed * per_token if k else 0.0)
        missed = missed + 1 if k == 0 else 0
        if i >= len(start):
            n = 0
            while n < k and rng.random() < 0.7:
                n += 1
        clock.t += dt
        rule.observe(i, [("r0", k, n)] if k else [], 0.6e-3 * k if k else None)
    assert rule.catch_up_token_seconds < 3 * per_token, rule.catch_up_token_seconds
    assert rule.probe_steps >= 3 * rule_mod.PROBE_STEPS, rule.probe_steps
