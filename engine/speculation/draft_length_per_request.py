"""Per request draft lengths: a request whose own acceptance does not pay for the step's last drafts drafts fewer.

Why: the rule's k is the batch's; one request whose drafts are rejected far more often than the batch's (another
language, a prompt the draft knows poorly) costs its verify rows for nothing. A request's own acceptance (from
MIN_REQUEST_DRAFTS verifies) cuts its k where a draft position's reach falls below what that position's row of the
verify costs: E(k) x (v / B) / T(k), v the verify's seconds for one more k across a batch of B (v / B one request's
row), T(k) the step's seconds (the rule's figures, engine/speculation/draft_length_rule.py). Priced at v, a whole
batch's row, the cut took drafts from requests whose few verifies read low by chance. A request's k is only ever
cut, never raised past the step's (ScheduledRequest's num_draft_tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from engine.speculation.draft_cost_model import Acceptance, reach

MIN_REQUEST_DRAFTS = 8  # a request's own acceptance counts from this many of its verifies
MAX_REQUESTS = 4096  # per-request acceptance kept for at most this many requests (oldest dropped)

# k -> (the reach a request's last draft at k must have, None without the figures; the batch's rates a_1..a_k)
Threshold = Callable[[int], tuple[float | None, list[float]]]


class RequestDraftLengths:
    """Each running request's own acceptance, and the cut of a step's k it makes (see the module docstring)."""

    def __init__(self) -> None:
        self.requests: OrderedDict[str, Acceptance] = OrderedDict()
        # (k, threshold, the batch's rates) of this step: worked out once a step (per request, they cost a batch of
        # 32 up to a millisecond of host time a step); the figures change only at a commit.
        self._cut: tuple[int, float | None, list[float]] | None = None

    def new_figures(self) -> None:
        """The rule's figures changed (a commit) or a new step is chosen: the cut is worked out again."""
        self._cut = None

    def record(self, request_id: str, k: int, accepted: int) -> None:
        mine = self.requests.get(request_id)
        if mine is None:
            mine = self.requests[request_id] = Acceptance()
            while len(self.requests) > MAX_REQUESTS:
                self.requests.popitem(last=False)
        mine.record(k, accepted)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def k(self, request_id: str, k: int, threshold: Threshold) -> int:
        """The k of one request in a step of k: less where its own acceptance does not pay for the last drafts."""
        mine = self.requests.get(request_id)
        if k <= 0 or mine is None or mine.drafts < MIN_REQUEST_DRAFTS:
            return k
        if self._cut is None or self._cut[0] != k:
            self._cut = (k, *threshold(k))
        _, cut, batch_rates = self._cut
        if cut is None:
            return k
        own = reach(mine.rates(k, fallback=batch_rates))
        while k > 0 and own[k - 1] < cut:
            k -= 1
        return k
