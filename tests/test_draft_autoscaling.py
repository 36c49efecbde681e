"""The draft pool's autoscaling (serving/draft_pool/autoscaling.py), without a cluster: the policy Serve's controller
runs on the replicas' reported busy fractions and targets (with Serve's own AutoscalingContext, and Serve's wrapper that
applies the config's bounds and delays, as the controller does), the config the draft deployment gets, and the
option's checks. The served side (a new replica taking targets, a stopping one draining) is in
tests/test_draft_pool.py."""

from __future__ import annotations

import pytest
from ray.serve._private.autoscaling_state import _apply_autoscaling_config
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deploy.config import ServeConfig
from serving.draft_pool.autoscaling import (
    DRAFT_BUSY,
    DRAFT_TENANTS,
    POLICY,
    BusyMeter,
    DraftBusyPolicy,
    draft_autoscaling_config,
    min_draft_replicas,
)


def _context(busy: list[float], tenants: list[float], target: int | None = None,
             config: dict | None = None) -> AutoscalingContext:
    dep = DeploymentID(name="SpecServeDraft", app_name="specserve")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(len(busy))]
    cfg = AutoscalingConfig(**draft_autoscaling_config(config or {"min_replicas": 1, "max_replicas": 4,
                                                                  "upscale_delay_s": 0, "downscale_delay_s": 0}))
    metrics = {DRAFT_BUSY: dict(zip(replicas, busy)), DRAFT_TENANTS: dict(zip(replicas, tenants))} if busy else {}
    return AutoscalingContext(
        deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name, current_num_replicas=len(busy),
        target_num_replicas=target if target is not None else len(busy), running_replicas=replicas,
        total_num_requests=0.0, total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics={},
        capacity_adjusted_min_replicas=cfg.min_replicas, capacity_adjusted_max_replicas=cfg.max_replicas,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=None, config=cfg)


def test_the_policy_scales_on_busy_time_up_to_one_replica_per_target() -> None:
    policy = DraftBusyPolicy(target_busy=0.5)
    assert policy(_context([0.9], [3]))[0] == pytest.approx(1.8)  # one draft, busy 90%: two at 45% each
    assert policy(_context([0.9, 0.8], [2, 2]))[0] == pytest.approx(3.4)
    assert policy(_context([1.0], [1]))[0] == 1  # one target: a second draft replica would have nothing to do
    assert policy(_context([0.1, 0.0], [2, 0]))[0] == pytest.approx(0.2)  # idle: fewer
    assert policy(_context([], [], target=2))[0] == 2  # nothing reported yet: keep the count
    # What the controller does with it: Serve's wrapper rounds up and applies the config's bounds and delays.
    wrapped = _apply_autoscaling_config(policy)
    assert wrapped(_context([0.9], [3]))[0] == 2
    assert wrapped(_context([0.1, 0.0], [2, 0]))[0] == 1
    slow = {"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 600}
    assert wrapped(_context([0.9], [3], config=slow))[0] == 1  # wants 2, but not for upscale_delay_s yet


def test_the_deployment_config_gets_the_policy_and_refuses_what_cannot_work() -> None:
    cfg = draft_autoscaling_config({"min_replicas": 2, "max_replicas": 3})
    assert cfg["policy"] == {"policy_function": POLICY}
    assert AutoscalingConfig(**cfg).policy.get_policy() is DraftBusyPolicy
    assert min_draft_replicas(cfg) == 2
    tuned = draft_autoscaling_config({"max_replicas": 3, "policy": {"policy_kwargs": {"target_busy": 0.8}}})
    assert tuned["policy"]["policy_kwargs"] == {"target_busy": 0.8}
    with pytest.raises(ValueError, match="target_busy must be in"):
        draft_autoscaling_config({"max_replicas": 3, "policy": {"policy_kwargs": {"target_busy": 1.5}}})
    with pytest.raises(ValueError, match="min_replicas must be >= 1"):
        draft_autoscaling_config({"min_replicas": 0, "max_replicas": 3})
    with pytest.raises(ValueError, match="max_replicas"):
        draft_autoscaling_config({"min_replicas": 3, "max_replicas": 2})


def test_the_option_turns_the_pool_on_and_excludes_draft_replicas() -> None:
    base = {"model": "m", "draft_model": "d", "device": "cpu"}
    cfg = ServeConfig.from_dict({**base, "draft_autoscaling_config": {"min_replicas": 1, "max_replicas": 2}})
    assert cfg.uses_draft_pool()
    with pytest.raises(ValueError, match="not both"):
        ServeConfig.from_dict({**base, "draft_replicas": 1,
                               "draft_autoscaling_config": {"max_replicas": 2}}).validate()
    with pytest.raises(ValueError, match="min_replicas must be >= 1"):
        ServeConfig.from_dict({**base, "draft_autoscaling_config": {"min_replicas": 0}}).validate()


def test_the_busy_fraction_is_of_the_time_between_two_readings() -> None:
    meter = BusyMeter()
    assert meter.read(5.0, now=100.0) == 0.0  # the first reading has nothing to compare with
    assert meter.read(6.5, now=102.0) == pytest.approx(0.75)
    assert meter.read(6.5, now=104.0) == 0.0
    assert meter.read(9.0, now=105.0) == 1.0  # rounding between two clocks never reports more than all the time
