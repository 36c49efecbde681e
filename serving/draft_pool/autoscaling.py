"""Autoscaling of a draft pool's replicas (`draft_autoscaling_config`) on the draft's own load.

Serve's default policy scales a deployment on its ongoing requests, counted by its handles and replicas. The targets
call a draft group's rank 0 with plain actor calls, never through Serve's router, so that count stays at zero for
the draft deployment. Each draft replica reports its own load to Serve's controller instead, with Serve's custom
autoscaling metrics (`record_autoscaling_stats`): `draft_busy`, the fraction of the last interval its draft group
spent in draft steps, and `draft_tenants`, the targets attached to it. `DraftBusyPolicy`, the pool's autoscaling
policy (a Serve custom policy), asks for as many replicas as keep the pool's mean busy fraction at `target_busy`, and
never more than there are targets to spread over them; Serve applies the config's bounds, delays and scaling factors
to what it asks, as it does for its own policy.

Scaling up helps only once targets use the new replica: targets attach to the least-loaded replica, and a replica
with two targets more than another asks one of them to move (serving/draft_pool/pool.py, serving/router/draft_moves.py).
Scaling down drains: the replica Serve stops asks its targets to move to the others first.
"""

from __future__ import annotations

import math
import time
from typing import Any

DRAFT_BUSY = "draft_busy"
DRAFT_TENANTS = "draft_tenants"
DEFAULT_TARGET_BUSY = 0.5
POLICY = "serving.draft_pool.autoscaling:DraftBusyPolicy"


class DraftBusyPolicy:
    """Serve's autoscaling policy for the draft deployment (a class policy: Serve builds it once, with the config's
    `policy_kwargs`). target_busy: the fraction of the time each draft group should spend drafting; a draft busier
    than that makes its targets wait for their proposals."""

    def __init__(self, target_busy: float = DEFAULT_TARGET_BUSY) -> None:
        if not 0.0 < float(target_busy) <= 1.0:
            raise ValueError(f"draft_autoscaling_config: policy_kwargs.target_busy must be in (0, 1], "
                             f"got {target_busy}")
        self.target_busy = float(target_busy)

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        """ctx: ray.serve.config.AutoscalingContext. The replicas wanted: the pool's busy time over the target, at
        most one per target attached (a draft replica no target uses is idle)."""
        if ctx.current_num_replicas == 0:
            return ctx.target_num_replicas, {}
        metrics = ctx.aggregated_metrics or {}
        busy = metrics.get(DRAFT_BUSY) or {}
        if not busy:  # no replica has reported yet (starting): keep the count
            return ctx.target_num_replicas, {}
        tenants = math.ceil(sum((metrics.get(DRAFT_TENANTS) or {}).values()))
        return min(sum(busy.values()) / self.target_busy, max(1, tenants)), {}


def draft_autoscaling_config(config: dict[str, Any]) -> dict[str, Any]:
    """The draft deployment's Serve autoscaling_config: the user's, with DraftBusyPolicy as its policy unless it
    names one. ValueError for what Serve would refuse, or min_replicas 0 (a pool with no replica reports no load,
    so it could never scale up, and its targets would never speculate)."""
    from ray.serve.config import AutoscalingConfig

    cfg = dict(config)
    policy = dict(cfg.get("policy") or {})
    policy.setdefault("policy_function", POLICY)
    if policy["policy_function"] == POLICY:
        DraftBusyPolicy(**policy.get("policy_kwargs", {}))  # its own checks, at build time
    cfg["policy"] = policy
    try:
        checked = AutoscalingConfig(**cfg)
    except Exception as e:  # noqa: BLE001 - pydantic's error names the field
        raise ValueError(f"draft_autoscaling_config: {e}") from e
    if checked.min_replicas < 1:
        raise ValueError("draft_autoscaling_config: min_replicas must be >= 1 (a draft pool of no replicas reports "
                         "no load to scale up on, and its engine replicas would never speculate)")
    return cfg


def min_draft_replicas(config: dict[str, Any]) -> int:
    """The fewest replicas the config lets the pool have: each must make room for its share of the targets then."""
    from ray.serve.config import AutoscalingConfig

    return max(1, AutoscalingConfig(**config).min_replicas)


class BusyMeter:
    """The fraction of the time between two readings that a draft group spent in draft steps, from its running
    total of busy seconds (serving.draft_pool.batch.BatchStats.busy_s)."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None  # (time.monotonic(), busy seconds) at the last reading

    def read(self, busy_s: float, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        last, self._last = self._last, (now, busy_s)
        if last is None or now <= last[0]:
            return 0.0
        return min(1.0, max(0.0, (busy_s - last[1]) / (now - last[0])))
