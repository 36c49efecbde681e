"""The draft length rule (engine/speculation/draft_length_rule.py) in the engine's step loop: it gives the scheduler
each step's k and each request's, is told of each plan (timed only where every request decodes) and learns from each
committed step's verifies.

A seeded request at temperature > 0 pins the steps it may run in at num_speculative_tokens: its samples depend on the
k's it is verified at, and a seed promises the same output however the load (and so the rule's choices) goes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from engine.request import Request
from engine.scheduler import ScheduledRequest, Scheduler
from engine.speculation.draft_length_rule import DraftLengthRule
from engine.step.phases import PROPOSE
from engine.step.plan import StepResult


class DraftLengthControl:
    """Owns the engine's DraftLengthRule (`rule`) and sets the scheduler's k of a step and of a request to its
    choices. has_draft_kv: whether the engine has the draft's KV cache now (none while the draft is detached)."""

    def __init__(self, max_k: int, scheduler: Scheduler, max_num_seqs: int, has_draft_kv: Callable[[], bool]) -> None:
        self.rule = DraftLengthRule(max_k)
        self.scheduler = scheduler
        self.max_num_seqs = max_num_seqs
        self.has_draft_kv = has_draft_kv
        scheduler.draft_length_fn = self.draft_length
        scheduler.request_draft_length = self.request_draft_length

    def draft_length(self, batch_size: int) -> int:
        """The draft length rule's k for the next step; num_speculative_tokens while a seeded request at temperature
        > 0 may run: its samples depend on the k's it is verified at, and a seed promises the same output however
        the load (and so the rule's choices) goes."""
        rule = self.rule
        sched = self.scheduler
        # What the draft missed (while k was 0), for the cost of a probe of k > 0: one catch-up forward. Counted only
        # where the rule needs it (a batch's count at every step cost about what the choice does).
        def missed() -> int:
            return sum(max(r.num_tokens - 1 - r.num_draft_computed_tokens, 0) for r in sched.running)

        k = rule.choose(batch_size, missed if self.has_draft_kv() and rule.last_k == 0 else 0)
        candidates = itertools.chain(sched.running, itertools.islice(sched.waiting, self.max_num_seqs))
        if any(_seeded(r) for r in candidates):
            return rule.pin(rule.max_k)
        return k

    def request_draft_length(self, request: Request, k: int) -> int:
        return k if _seeded(request) else self.rule.request_k(request.request_id, k)

    def planned(self, step_id: int, scheduled: list[ScheduledRequest]) -> None:
        """Step `step_id` was planned from `scheduled`, at the scheduler's k of the step."""
        # Timed only where every request decodes: a prefill chunk's cost is not the draft length's.
        timed = all(s.samples and s.num_new_tokens == 1 + s.num_draft_tokens for s in scheduled)
        self.rule.planned(step_id, self.scheduler.step_draft_length, timed)

    def observe(self, scheduled: list[ScheduledRequest], result: StepResult) -> None:
        """Feed the draft length rule a committed step: each verify's k and accepted drafts, the propose phase."""
        verifies = []
        drafted = False
        for n, (s, tokens, accepted) in enumerate(zip(scheduled, result.sampled, result.num_accepted)):
            k = result.num_draft_tokens[n] if result.num_draft_tokens is not None else s.num_draft_tokens
            drafted = drafted or k > 0
            if tokens is not None and k and not s.request.status.finished:
                verifies.append((s.request.request_id, k, accepted))
        self.rule.observe(result.step_id, verifies, result.phase_seconds.get(PROPOSE), drafted)


def _seeded(request: Request) -> bool:
    """A request whose output a seed fixes (sampled, with a seed): its k must not follow the load."""
    return request.params.seed is not None and request.params.temperature > 0.0
