"""Serving on the target alone while the draft group is down, and putting a rebuilt draft group back.

Speculation is lossless: the target decides every token, so an engine that stops speculating mid-request
produces exactly what it would have produced with the draft (greedy: the same tokens; sampled: the same
distribution). That lets the router (serving/router.py, `continue_without_draft`) keep its requests in
flight when a draft rank dies instead of failing them. The failed step committed nothing, so the target's
KV and every request's progress are intact; only the draft's side is dropped:

    detach_draft(engine)   executor runs target-only steps; no draft KV manager; scheduler k = 0
    ... serve ...          executor.start_draft_group() loads new draft ranks meanwhile (off the lock)
    attach_draft(engine)   between steps: the graph gets the new draft ranks, a fresh draft KV manager,
                           and every request's draft progress restarts at 0, so the draft catches up on
                           the tokens it has not seen (one chunk) at the request's next speculative step
"""

from __future__ import annotations

from typing import Any


def detach_draft(engine: Any) -> Any:
    """Switch `engine` (an EngineCore on a RayExecutor) to target-only steps; returns its SpeculativeConfig,
    for `attach_draft`. Raises if the executor cannot (a target rank is dead too)."""
    spec = engine.spec_config
    if spec is None:
        raise RuntimeError("the engine does not speculate: there is no draft to detach")
    engine.executor.detach_draft()
    engine.spec_config = None
    engine.draft_kv = None
    sched = engine.scheduler
    sched.kv_managers = [engine.target_kv]
    sched.num_speculative_tokens = 0
    for req in sched.requests.values():
        req.num_draft_computed_tokens = 0
    return spec


def attach_draft(engine: Any, spec: Any) -> None:
    """Put the draft group that `engine.executor.start_draft_group()` started into the step; call between
    steps. The draft's KV starts empty: each request's draft progress restarts at 0."""
    from engine.kv_cache.manager import KVCacheManager

    ex = engine.executor
    ex.attach_draft()
    engine.draft_kv = KVCacheManager(ex.draft_kv_groups, ex.draft_num_blocks, engine.config.block_size,
                                     engine.config.enable_prefix_caching)
    sched = engine.scheduler
    for req in sched.requests.values():
        req.num_draft_computed_tokens = 0
    sched.kv_managers = [engine.target_kv, engine.draft_kv]
    sched.num_speculative_tokens = spec.num_speculative_tokens
    engine.spec_config = spec
