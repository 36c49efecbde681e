"""Committing a step's result into its requests (the last of the step loop's phases, engine/engine_core.py): each
request's computed-token counts move past the KV the step made valid, its accepted and sampled tokens go to its
output, its full blocks enter the prefix cache, and a request that reached a stop ends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.detokenizer import OutputProcessor
from engine.request import Request, RequestStatus
from engine.scheduler import ScheduledRequest, Scheduler
from engine.step.plan import StepResult


def commit_result(scheduler: Scheduler, output: OutputProcessor, scheduled: list[ScheduledRequest],
                  result: StepResult, finish: Callable[[Request, RequestStatus], None]) -> list[Request]:
    """Apply `result` to the requests of `scheduled` (in the same order); `finish` ends a request that stopped.
    Returns the requests that got tokens or finished."""
    touched = []
    for n, (s, tokens, accepted) in enumerate(zip(scheduled, result.sampled, result.num_accepted)):
        r = s.request
        if r.status.finished:  # ended while this step was in flight: its tokens come after the end
            continue
        # The k the step verified: an open entry's was shrunk by the sides, from their exact counts.
        k = result.num_draft_tokens[n] if result.num_draft_tokens is not None else s.num_draft_tokens
        # An open input began where the step before it ended: the committed frontier now.
        frontier = r.num_tokens if s.open_input else s.frontier
        if s.draft_runs and not s.open_input:  # its draft input, explicit, reached every side
            r.draft_gap_unsent = False
        if result.prompt_logprobs is not None and result.prompt_logprobs[n]:
            _add_prompt_logprobs(r, s.start, result.prompt_logprobs[n])
        if tokens is None:  # a prefill chunk that did not reach the end of the prompt
            r.num_computed_tokens = frontier
            if s.draft_runs:
                r.num_draft_computed_tokens = frontier
            scheduler.cache_committed_blocks(r)
            continue
        # KV of the fed last token and of the accepted drafts is valid; rejected slots get overwritten.
        r.num_computed_tokens = frontier + accepted
        if s.draft_runs:
            r.num_draft_computed_tokens = frontier + min(accepted, max(k - 1, 0))
        if k:
            r.spec.record(k, accepted)
        kept = output.append(r, tokens)
        if result.logprobs is not None and result.logprobs[n] is not None:
            r.output_logprobs.extend(result.logprobs[n][:kept])  # none for tokens past a stop
        scheduler.cache_committed_blocks(r)  # before a finish frees the blocks
        touched.append(r)
        if r.status.finished:
            finish(r, r.status)
    return touched


def _add_prompt_logprobs(r: Request, start: int, entries: list[Any]) -> None:
    """Append a chunk's prompt logprobs (those of prompt tokens start + 1, start + 2, ...) where they extend what
    the request has: a chunk recomputed after a preemption brings some a second time."""
    have = len(r.prompt_logprobs)
    if start <= have:
        r.prompt_logprobs.extend(entries[have - start:])
