"""Prometheus series of the draft length rule (engine/speculation/draft_length_rule.py): the k chosen each step, the
steps it stopped speculating, and the figures it chose from.

The histogram is fed by the router's per-step hook (one observation a step of an engine with a draft); the counter
and the gauges are pulled at scrape time from the rule's running totals and estimates
(EngineCore.draft_rule_stats), so the step loop carries nothing more for them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# One bucket per k up to num_speculative_tokens' usual range, then coarser up to its maximum (16).
K_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16)


class DraftLengthMetrics:
    def __init__(self, registry: CollectorRegistry, prefix: str = "specserve_") -> None:
        p, r = prefix, registry
        self.chosen = Histogram(p + "spec_decode_draft_length_chosen",
                                "Draft length k of each step of an engine with a draft (0: no speculation)",
                                buckets=K_BUCKETS, registry=r)
        self.zero_steps = Counter(p + "spec_decode_rule_zero_steps",
                                  "Steps the draft length rule ran at k = 0 (speculation measured slower)",
                                  registry=r)
        self._zero_seen = 0  # the engine's total at the last sync
        self.step_seconds = Gauge(p + "spec_decode_rule_step_seconds",
                                  "The rule's estimate of a step's seconds at k, at the last step's load", ["k"],
                                  registry=r)
        self.tokens_per_second = Gauge(p + "spec_decode_rule_tokens_per_second",
                                       "The rule's estimate of the tokens a second a request commits at k, at the "
                                       "last step's load", ["k"], registry=r)
        self.acceptance = Gauge(p + "spec_decode_rule_acceptance",
                                "The rule's running acceptance at each draft position (1-based), given the drafts "
                                "before it accepted", ["position"], registry=r)
        self.draft_forward_seconds = Gauge(p + "spec_decode_rule_draft_forward_seconds",
                                           "The rule's estimate of one draft forward's seconds, at the last step's "
                                           "load", registry=r)

    def on_step(self, draft_length: int) -> None:
        self.chosen.observe(draft_length)

    def on_rule(self, stats: tuple[int, int, dict[str, dict[int, float]]] | None) -> None:
        """Bring the series up to the rule's (steps, steps at k = 0, estimates); None: the rule is off."""
        if stats is None:
            return
        _, zero, est = stats
        seen = 0 if zero < self._zero_seen else self._zero_seen  # below the last total: a new rule counts anew
        if zero > seen:
            self.zero_steps.inc(zero - seen)
        self._zero_seen = zero
        for k, v in est.get("step_seconds", {}).items():
            self.step_seconds.labels(k=str(k)).set(v)
        for k, v in est.get("tokens_per_second", {}).items():
            self.tokens_per_second.labels(k=str(k)).set(v)
        for pos, v in est.get("acceptance", {}).items():
            self.acceptance.labels(position=str(pos)).set(v)
        for v in est.get("draft_forward_seconds", {}).values():
            self.draft_forward_seconds.set(v)
