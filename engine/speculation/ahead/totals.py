"""The layout of speculation ahead's running totals (AheadStats.as_tuple, StepResult.speculation_ahead_totals), kept
free of torch so that the metrics side can read it without loading the engine."""

from __future__ import annotations

# The counters, in order; then hits by outcome (tree mode), one entry per a = 0..MAX_OUTCOMES - 1.
COUNTERS = ("lookups", "hits", "drafted_tokens", "unused_tokens", "skipped_branches", "trees", "tree_nodes")
MAX_OUTCOMES = 17  # outcomes of a verify of num_speculative_tokens <= 16 drafts: 0..16 accepted
NUM_TOTALS = len(COUNTERS) + MAX_OUTCOMES
