"""Which engine a router drives, named as `package.module:function` so a Serve config can choose it.

Kept free of engine imports at module level: the router's module is pickled by value into the Serve controller,
which must not import torch just to create the actor.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# The engine the router drives: target and draft on Ray worker actors (each tensor-parallel, on its own
# placement group), stepped through a compiled graph. LOCAL_ENGINE_BUILDER runs both models inside the router's
# own process instead (no worker actors; tensor_parallel_size 1 only).
DEFAULT_ENGINE_BUILDER = "serving.engine_factory:build_ray_engine"
LOCAL_ENGINE_BUILDER = "serving.engine_builders:build_local_engine"

# Where the default builder runs the draft (RayExecutor's `draft_placement`): "separate" worker actors, "colocated"
# in the target's ranks, or "auto" (serving/workers/group.py, `resolve_draft_placement`).
DRAFT_PLACEMENTS = ("auto", "separate", "colocated")
DEFAULT_DRAFT_PLACEMENT = "auto"  # the builders' default and the serve option's
# The options that place the worker groups on Ray nodes (deploy/serve_options.py; serving/workers/placement.py).
NODE_PLACEMENT_OPTIONS = ("target_resources", "target_node_labels", "draft_resources", "draft_node_labels")


def build_local_engine(draft_placement: str = DEFAULT_DRAFT_PLACEMENT, **engine_args: Any) -> Any:
    """Target (and draft) in the router's own process, through the offline LLM's construction. Its draft is
    colocated by construction: "separate" is refused rather than ignored."""
    from engine.llm import LLM

    placed = [k for k in NODE_PLACEMENT_OPTIONS if engine_args.get(k) is not None]
    if placed:
        raise ValueError(f"{', '.join(placed)} place worker actors on Ray nodes: the local engine builder runs the "
                         "models in the router's own process")
    engine_args = {k: v for k, v in engine_args.items() if k not in NODE_PLACEMENT_OPTIONS}
    if draft_placement not in ("auto", "colocated"):
        raise ValueError(f"draft_placement {draft_placement!r} needs worker actors: the local engine builder runs "
                         "the draft in the router's own process ('auto' or 'colocated')")
    return LLM(**engine_args).engine


def import_builder(path: str) -> Callable[..., Any]:
    """The builder function a `package.module:function` path names."""
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"engine builder must look like 'package.module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)
