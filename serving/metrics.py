"""Prometheus metrics of one router (one engine), under the project's fixed metric names.

The router owns a private CollectorRegistry (not prometheus-client's global one), so two routers in one
process, or a router and a test, never collide, and an exposition shows exactly this engine's series. The
ingress's `/metrics` merges every engine replica's exposition, each series labelled with its `replica`
(merge_replica_expositions). prometheus-client appends `_total` to counters in the exposition, so counters are
named without it.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from engine.speculation.ahead.totals import NUM_TOTALS
from serving.draft_length_metrics import DraftLengthMetrics

# Latency buckets: from one CPU-free GPU step (ms) to a long CPU generation (minutes).
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048,
                 4.096, 8.192)
STEP_PHASES = ("propose", "verify", "sample")


class EngineMetrics:
    """Every series the router exports. The router calls the `on_*` hooks from its event loop."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # No `*_created` series: they double the exposition and no dashboard reads them (vLLM drops them too).
        # Process-wide, which is fine in the router's own process.
        disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "specserve_"
        # --- speculative decoding ----------------------------------------------------------------
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "Verify steps that checked draft tokens",
                                  registry=r)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft (0-based)",
                                        ["position"], registry=r)
        self.draft_length = Gauge(p + "spec_decode_draft_length",
                                  "Draft length (k) the last step used: load-adaptive, 0 while the batch is too "
                                  "large to speculate", registry=r)
        self.spec_steps = Counter(p + "spec_decode_steps", "Engine steps by whether they speculated (drafted tokens "
                                  "to verify): the share of steps load-adaptive speculation left on",
                                  ["speculating"], registry=r)
        self.draft_rule = DraftLengthMetrics(r, p)  # the draft length rule's k, k = 0 steps and estimates
        # --- tokens and requests -----------------------------------------------------------------
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of requests whose prefill finished",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated (output) tokens", registry=r)
        self.request_success = Counter(p + "request_success", "Requests that finished normally",
                                       ["finished_reason"], registry=r)
        self.request_aborted = Counter(p + "request_aborted", "Requests aborted (client gone or engine error)",
                                       registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Requests preempted to free KV-cache blocks", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        # Where each model's ranks run: 1 per (role, rank, node), the node's Ray id; a node lost takes its groups.
        self.group_node = Gauge(p + "worker_group_node_info", "1 for the Ray node each model worker rank runs on",
                                ["role", "rank", "node_id"], registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)",
                              ["model", "kv_group"], registry=r)
        # Prefix caching, in tokens as vLLM counts it: hits / queries is the model's hit rate.
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Tokens looked up in the prefix cache at admission",
                                      ["model"], registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Tokens of those lookups the model's prefix cache held",
                                   ["model"], registry=r)
        self._prefix_seen: dict[str, tuple[int, int]] = {}  # model -> the engine's totals at the last sync
        # Speculation ahead: hits / lookups is the share of proposals served from windows drafted ahead.
        self.ahead_lookups = Counter(p + "speculation_ahead_lookups",
                                     "Proposals looked up among the windows drafted ahead",
                                     registry=r)
        self.ahead_hits = Counter(p + "speculation_ahead_hits", "Proposals served from a window drafted ahead",
                                  registry=r)
        self.ahead_drafted = Counter(p + "speculation_ahead_drafted_tokens", "Draft tokens drafted ahead", registry=r)
        self.ahead_unused = Counter(p + "speculation_ahead_unused_tokens",
                                    "Draft tokens drafted ahead and dropped without being proposed", registry=r)
        self.ahead_skipped = Counter(p + "speculation_ahead_skipped_branches",
                                     "Windows chosen to draft ahead but not drafted: the draft loop's rows "
                                     "(max_num_seqs) or its scratch KV blocks were full", registry=r)
        # Tree mode (speculation_ahead_tree_fanout): trees drafted, their nodes (tree_nodes / trees: nodes per
        # tree), and hits by outcome (accepted = the drafts the target accepted before its token there).
        self.ahead_trees = Counter(p + "speculation_ahead_trees",
                                   "Trees drafted ahead (tree mode: one a request and step)",
                                   registry=r)
        self.ahead_tree_nodes = Counter(p + "speculation_ahead_tree_nodes",
                                        "Nodes of the trees drafted ahead (the rows their forwards fed)", registry=r)
        self.ahead_outcome_hits = Counter(p + "speculation_ahead_outcome_hits",
                                          "Proposals served from a tree branch, by the verify outcome it was for "
                                          "(accepted: drafts accepted before the target's token)", ["accepted"],
                                          registry=r)
        self._ahead_seen: tuple[int, ...] = (0,) * NUM_TOTALS  # the engine's totals at the last sync
        self.ahead_branches = Gauge(p + "speculation_ahead_branches",
                                    "Windows a request the last step asked the draft to draft ahead (the fan-out, "
                                    "cut to what fits in the verify where the draft has GPUs of its own; 0 while "
                                    "the gate has drafting ahead off)",
                                    registry=r)
        self.ahead_off_steps = Counter(p + "speculation_ahead_off_steps",
                                       "Steps planned without drafting ahead: the gate measured it slower than not "
                                       "drafting ahead at their load (speculation_ahead_adaptive)", registry=r)
        self._ahead_off_seen = 0  # the engine's total at the last sync
        # --- latencies ---------------------------------------------------------------------------
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival at the router to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "Time per output token after the first (a step's interval spread over its tokens)",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival at the router to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.step_duration = Histogram(p + "step_duration_seconds", "Engine step time by phase", ["phase"],
                                       buckets=_STEP_BUCKETS, registry=r)
        # Touch the labelled children that always exist, so a scrape before the first request already
        # shows every documented name (dashboards and alerts key on them).
        for phase in STEP_PHASES:
            self.step_duration.labels(phase=phase)
        for reason in ("stop", "length"):
            self.request_success.labels(finished_reason=reason)
        self.prefix_queries.labels(model="target")
        self.prefix_hits.labels(model="target")
        for speculating in ("true", "false"):
            self.spec_steps.labels(speculating=speculating)

    # --- hooks -------------------------------------------------------------------------------------
    def on_spec(self, num_drafts: int, num_draft_tokens: int, num_accepted: int, per_pos: list[int]) -> None:
        """Increments of one request's speculation counters over one step."""
        if num_drafts:
            self.num_drafts.inc(num_drafts)
            self.num_draft_tokens.inc(num_draft_tokens)
        if num_accepted:
            self.num_accepted_tokens.inc(num_accepted)
        for pos, n in enumerate(per_pos):
            if n:
                self.accepted_per_pos.labels(position=str(pos)).inc(n)

    def on_step(self, phase_seconds: dict[str, float], num_running: int, num_waiting: int, num_preempted: int,
                kv_usage: dict[tuple[str, int], float], draft_length: int, speculates: bool = False) -> None:
        """draft_length: the step's k (0: no speculation this step, or none at all on this engine); speculates:
        the engine has a draft (its steps' k go to the chosen-k histogram)."""
        for phase, seconds in phase_seconds.items():
            self.step_duration.labels(phase=phase).observe(seconds)
        self.set_queue(num_running, num_waiting)
        if num_preempted:
            self.preemptions.inc(num_preempted)
        for (model, group), usage in kv_usage.items():
            self.kv_usage.labels(model=model, kv_group=str(group)).set(usage)
        self.draft_length.set(draft_length)
        self.spec_steps.labels(speculating="true" if draft_length else "false").inc()
        if speculates:
            self.draft_rule.on_step(draft_length)

    def on_prefix_cache(self, totals: dict[str, tuple[int, int]]) -> None:
        """Bring the counters up to the engine's running totals per model, (queries, hits) in tokens. Totals
        below the last ones seen mean the model's KV manager was rebuilt (a new draft group): they count anew."""
        for model, (queries, hits) in totals.items():
            q0, h0 = self._prefix_seen.get(model, (0, 0))
            if queries < q0 or hits < h0:
                q0 = h0 = 0
            if queries > q0:
                self.prefix_queries.labels(model=model).inc(queries - q0)
            if hits > h0:
                self.prefix_hits.labels(model=model).inc(hits - h0)
            self._prefix_seen[model] = (queries, hits)

    def on_speculation_ahead(self, totals: tuple[int, ...]) -> None:
        """Bring the counters up to the engine's running totals (AheadStats.as_tuple: lookups, hits, drafted, unused,
        skipped branches, trees, tree nodes, hits by outcome 0..16); totals below the last ones mean a new draft
        group counts anew."""
        counters = (self.ahead_lookups, self.ahead_hits, self.ahead_drafted, self.ahead_unused, self.ahead_skipped,
                    self.ahead_trees, self.ahead_tree_nodes)
        if len(totals) != NUM_TOTALS:
            raise ValueError(f"expected {NUM_TOTALS} speculation-ahead totals, got {len(totals)}")
        seen = self._ahead_seen
        if any(t < s for t, s in zip(totals, seen)):
            seen = (0,) * len(seen)
        for n, (t, s) in enumerate(zip(totals, seen)):
            if t > s:  # an outcome's child appears with its first hit (no seventeen zero series per engine)
                counter = counters[n] if n < len(counters) else self.ahead_outcome_hits.labels(
                    accepted=str(n - len(counters)))
                counter.inc(t - s)
        self._ahead_seen = tuple(totals)

    def on_ahead_off_steps(self, total: int) -> None:
        """Bring the off-steps counter up to the engine's running total (below the last one: a new count)."""
        seen = 0 if total < self._ahead_off_seen else self._ahead_off_seen
        if total > seen:
            self.ahead_off_steps.inc(total - seen)
        self._ahead_off_seen = total

    def set_group_nodes(self, nodes: dict[str, list[str | None]]) -> None:
        """role -> each rank's node id (None: not answering); the series of replaced groups go."""
        self.group_node.clear()
        for role, ranks in nodes.items():
            for rank, node in enumerate(ranks):
                self.group_node.labels(role, str(rank), node or "unknown").set(1)

    def set_queue(self, num_running: int, num_waiting: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)

    def on_first_token(self, num_prompt_tokens: int, ttft: float) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.ttft.observe(ttft)

    def on_tokens(self, num_tokens: int, seconds_since_last: float | None) -> None:
        """`num_tokens` new output tokens; the interval since the request's previous tokens, if any."""
        self.generation_tokens.inc(num_tokens)
        if seconds_since_last is not None and num_tokens:
            per_token = seconds_since_last / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(per_token)

    def on_finished(self, finish_reason: str, e2e: float) -> None:
        if finish_reason == "abort":
            self.request_aborted.inc()
            return
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.e2e.observe(e2e)

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()


def merge_replica_expositions(parts: list[tuple[str, str]], label: str = "replica") -> str:
    """One exposition of several engines' (replica, exposition) pairs: every sample gets a `replica` label, and
    each metric family appears once (a scrape may not repeat a family). Totals are sums over the label."""
    from prometheus_client.core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for replica, text in sorted(parts):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type)
            for s in family.samples:
                merged.samples.append(s._replace(labels={**s.labels, label: replica}))

    return exposition(list(families.values()))


class _Families:
    """A collector of metric families built elsewhere (parsed and relabelled, or computed from running totals)."""

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> list[Any]:
        return self._families


def exposition(families: list[Any]) -> str:
    """The text exposition of `families`, through a registry of their own."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()


# Series that describe the draft's work: with a draft pool they carry the draft replica that did it.
_DRAFT_FAMILIES = ("spec_decode", "speculation_ahead")


def label_draft_series(text: str, draft_replica: str) -> str:
    """An engine's exposition with a `draft_replica` label on its draft's series (speculative decoding's counters
    and the draft model's KV usage), for an engine attached to a draft pool; the ingress then adds the engine's
    own `replica` label, so they read per draft replica and target."""
    from prometheus_client.core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families = []
    for family in text_string_to_metric_families(text):
        out = Metric(family.name, family.documentation, family.type)
        drafty = any(k in family.name for k in _DRAFT_FAMILIES)
        for s in family.samples:
            if drafty or s.labels.get("model") == "draft":
                s = s._replace(labels={**s.labels, "draft_replica": draft_replica})
            out.samples.append(s)
        families.append(out)
    return exposition(families)


# Tenants per draft forward of a pooled draft group (serving/draft_pool/batch.py): one target up to many.
DRAFT_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)


def draft_pool_exposition(batch_tenants: dict[int, int]) -> str:
    """A draft replica's series, from its rank 0's running totals: `specserve_draft_pool_batch_tenants`, the
    histogram of how many target engines each draft forward served ({tenants: forwards}). The ingress adds the
    `draft_replica` label."""
    from prometheus_client.core import HistogramMetricFamily

    counts = {int(k): int(v) for k, v in batch_tenants.items()}
    buckets = [(str(float(le)), sum(n for size, n in counts.items() if size <= le)) for le in DRAFT_BATCH_BUCKETS]
    buckets.append(("+Inf", sum(counts.values())))
    family = HistogramMetricFamily("specserve_draft_pool_batch_tenants",
                                   "Target engines whose draft steps one draft forward of the pool ran together",
                                   buckets=buckets, sum_value=sum(size * n for size, n in counts.items()))
    return exposition([family])
