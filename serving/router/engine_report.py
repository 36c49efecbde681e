"""What a router (serving/router/router.py) reports of the engine it drives: the one line it prints once the replica is
ready, what each model's weights hold, the engine's info, and its metrics' exposition with the engine's running totals
brought up at scrape time.

Engine imports stay out of this module, as out of the router's: it reads the engine it is given.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serving.metrics import EngineMetrics
    from serving.workers.node_placement import GroupNodes


def engine_summary(engine: Any, model: Any, weights: dict[str, dict[str, Any] | None]) -> str:
    """What the engine serves, in a line: models, speculation, device, context and KV blocks. model: the target as
    the engine's arguments name it; weights: `engine_weights`'s."""
    cfg, spec = engine.config, engine.spec_config
    draft = (f" + draft {spec.draft_model} (k={spec.num_speculative_tokens}, {spec.rejection_sampling})"
             if spec is not None else " (no draft)")
    kv = f"{engine.executor.target_num_blocks} target"
    if engine.draft_kv is not None:
        kv += f" / {engine.executor.draft_num_blocks} draft"
    held = ", ".join(f"{role} weights {w['format']} {w['bytes'] / 2**20:.1f} MiB"
                     for role, w in weights.items() if w is not None)
    return (f"{model}{draft} on {cfg.device} {str(cfg.dtype).removeprefix('torch.')}, "
            f"max_model_len {cfg.max_model_len}, max_num_seqs {cfg.max_num_seqs}, KV blocks {kv} of "
            f"{cfg.block_size} tokens" + (f", {held}" if held else ""))


def engine_weights(engine: Any) -> dict[str, dict[str, Any] | None]:
    """What each model's weights hold (a tensor-parallel model's: each rank's), {"bytes", "format"}; None where an
    engine builder's executor does not say."""
    ex = engine.executor
    return {"target": getattr(ex, "target_weights", None), "draft": getattr(ex, "draft_weights", None)}


def engine_info(engine: Any, model_name: str) -> dict[str, Any]:
    """The served model's name, context and vocabulary, and its speculation."""
    spec = engine.spec_config
    return {"model": model_name, "max_model_len": engine.config.max_model_len,
            "vocab_size": engine.vocab_size, "draft_model": spec.draft_model if spec else None,
            "num_speculative_tokens": spec.num_speculative_tokens if spec else 0,
            "rejection_sampling": spec.rejection_sampling if spec else None}


async def scraped_metrics(metrics: EngineMetrics, engine: Any, group_nodes: GroupNodes) -> str:
    """The metrics' exposition, with the engine's running totals brought up first (on the event loop, between or
    during steps: the engine's totals are read, never written)."""
    # Prefix-cache and speculation-ahead counters are pulled at scrape time: the engine keeps running totals,
    # so the step loop carries nothing for them.
    metrics.on_prefix_cache(engine.prefix_cache_stats())
    metrics.on_speculation_ahead(engine.speculation_ahead_stats())
    metrics.ahead_branches.set(engine.speculation_ahead_branches())
    metrics.on_ahead_off_steps(engine.speculation_ahead_off_steps())
    metrics.set_group_nodes(await asyncio.to_thread(group_nodes.of, engine.executor))
    metrics.draft_rule.on_rule(engine.draft_rule_stats())
    text = metrics.exposition()
    executor = engine.executor
    if getattr(executor, "draft_pool", None) is not None:  # the draft replica this engine is attached to
        from serving.metrics import label_draft_series

        draft = executor.draft.workers[0].replica if executor.draft is not None else "none"
        text = label_draft_series(text, draft)
    return text
