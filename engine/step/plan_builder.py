"""A scheduled step as the plan the model sides run (engine/step/plan.py): per request the tokens to feed (or none,
for an open input the sides fill in), its block tables per KV-cache group of each model, and its sampling settings:
those two as far as the sides do not know them yet (engine/step/plan_deltas.py)."""

from __future__ import annotations

from engine.config import SpeculativeConfig
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from engine.scheduler import ScheduledRequest
from engine.step.plan import PlannedRequest, SamplingSettings, StepPlan
from engine.step.plan_deltas import SentState


def build_plan(step_id: int, scheduled: list[ScheduledRequest], target_kv: KVCacheManager,
               draft_kv: KVCacheManager | None, max_model_len: int, spec: SpeculativeConfig | None,
               finished_ids: list[str], sent: SentState | None = None) -> StepPlan:
    """finished_ids: requests that ended (or were preempted) since the last plan: the sides forget them.
    sent: what the sides were sent before; entries then carry settings once and block tables as tails, and `sent`
    learns what this plan sends. None: every entry whole."""
    if sent is not None:
        sent.forget(finished_ids)  # the sides drop them before they read this plan's entries
    planned = []
    for s in scheduled:
        r = s.request
        frontier = s.frontier
        rid = r.request_id
        p = PlannedRequest(
            request_id=rid, token_ids=None if s.open_input else _tokens(r, s.start, frontier),
            start_pos=s.start, num_draft_tokens=s.num_draft_tokens, sample=s.samples, block_tables=[],
            num_output_tokens=r.num_output_tokens, draft_start_pos=s.draft_start,
            # Where the request must end: the sides shrink an open entry's k by it, and draft ahead no further.
            token_limit=min(r.num_prompt_tokens + r.params.max_tokens, max_model_len),
            # The history a logits processor reads; an open entry's sides append what its step in flight added.
            output_token_ids=list(r.output_token_ids)
            if r.logits_params is not None and r.logits_params.needs_output_history else None)
        if r.params.prompt_logprobs is not None and not s.open_input:
            p.prompt_targets = _prompt_targets(r, s.start, frontier)
        tables = [target_kv.block_table(rid, g) for g in range(target_kv.num_groups)]
        draft_tables = None
        if s.draft_runs:  # else the draft sits this step out (speculation off at this load) and lags
            assert draft_kv is not None
            p.draft_runs = True
            if not s.open_input:
                p.draft_token_ids = _tokens(r, s.draft_start, frontier)
            draft_tables = [draft_kv.block_table(rid, g) for g in range(draft_kv.num_groups)]
        if sent is None:
            p.sampling = sampling_settings(r)
            p.block_tables = [list(t) for t in tables]
            if draft_tables is not None:
                p.draft_block_tables = [list(t) for t in draft_tables]
        elif sent.encode(p, tables, draft_tables):
            p.sampling = sampling_settings(r)
        planned.append(p)
    return StepPlan(step_id, planned, spec.rejection_sampling if spec else None,
                    spec.synthetic_acceptance_rate if spec else None, finished_ids=finished_ids)


def sampling_settings(r: Request) -> SamplingSettings:
    return SamplingSettings(temperature=r.params.temperature, top_p=r.params.top_p, top_k=r.params.top_k,
                            seed=r.params.seed, logprobs=r.params.logprobs,
                            prompt_logprobs=r.params.prompt_logprobs, logits_params=r.logits_params)


def _prompt_targets(r: Request, start: int, end: int) -> list[int] | None:
    """The prompt tokens that positions start..end-1 predict (PlannedRequest.prompt_targets); None once the chunk
    is past the prompt, or where the request has them all already (a recompute after preemption)."""
    n = r.num_prompt_tokens
    if start >= n - 1 or len(r.prompt_logprobs) >= min(end, n - 1):
        return None
    return r.prompt_token_ids[start + 1:min(end + 1, n)]


def _tokens(r: Request, start: int, end: int) -> list[int]:
    """r.all_token_ids[start:end], without joining prompt and output first (a decode feeds one token)."""
    n = r.num_prompt_tokens
    if start >= n:
        return r.output_token_ids[start - n:end - n]
    return r.prompt_token_ids[start:end] + r.output_token_ids[:max(0, end - n)]
