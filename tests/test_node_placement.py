"""Placement of worker groups by node: the options are checked with a clear error, refused where no worker actors
exist, and a group asked onto a node by its labels or a custom resource lands there (real Ray, several raylets)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster

from deploy.config import ServeConfig
from serving.engine_builders import build_local_engine
from serving.workers.node_placement import actor_node_ids
from serving.workers.placement import actor_options, create_group_placement, make_bundle


@pytest.mark.parametrize(("field", "value", "message"), [
    ("target_resources", {"specserve_target": "one"}, "target_resources must map resource names to numbers"),
    ("draft_resources", {"specserve_draft": -1}, "draft_resources must map resource names to numbers >= 0"),
    ("draft_resources", ["specserve_draft"], "draft_resources: cannot use"),
    ("target_node_labels", {"pool": 1}, "target_node_labels must map label names to non-empty strings"),
    ("draft_node_labels", {}, "draft_node_labels must map"),
])
def test_bad_placement_options_are_refused_naming_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeConfig.from_dict({"model": "m", "draft_model": "none", field: value}).validate()


def test_placement_options_reach_the_engine_builder() -> None:
    cfg = ServeConfig.from_dict({"model": "m", "draft_model": "none", "target_resources": {"t": 1},
                                 "draft_node_labels": {"pool": "draft"}})
    cfg.validate()
    args = cfg.engine_args()
    assert args["target_resources"] == {"t": 1} and args["draft_node_labels"] == {"pool": "draft"}
    assert "draft_resources" not in args and "target_node_labels" not in args  # unset: not passed


def test_the_local_engine_refuses_node_placement() -> None:
    with pytest.raises(ValueError, match="draft_resources place worker actors on Ray nodes"):
        build_local_engine(model="m", draft_resources={"specserve_draft": 1})


@pytest.fixture(scope="module")
def three_nodes() -> Iterator[dict[str, str]]:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        ids = {"labelled": c.add_node(num_cpus=1, labels={"specserve/pool": "draft"}).node_id,
               "resourced": c.add_node(num_cpus=1, resources={"specserve_target": 1}).node_id}
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        yield ids
    finally:
        ray.shutdown()
        c.shutdown()


@ray.remote
class _Probe:
    def ping(self) -> bool:
        return True


@pytest.mark.parametrize(("where", "resources", "labels"), [
    ("labelled", None, {"specserve/pool": "draft"}),
    ("resourced", {"specserve_target": 1}, None),
])
def test_a_group_lands_on_the_node_asked_for(three_nodes: dict[str, str], where: str, resources, labels) -> None:
    bundle = make_bundle("cpu", resources)
    pg = create_group_placement(f"test-{where}", 1, bundle, 60.0, labels)
    try:
        actor = _Probe.options(**actor_options(pg, 0, bundle)).remote()
        assert actor_node_ids([actor]) == [three_nodes[where]]
        ray.kill(actor)
    finally:
        ray.util.remove_placement_group(pg)


def test_no_such_node_is_a_clear_error(three_nodes: dict[str, str]) -> None:
    with pytest.raises(RuntimeError, match="labelled {'specserve/pool': 'nowhere'}"):
        create_group_placement("test-nowhere", 1, make_bundle("cpu", None), 3.0, {"specserve/pool": "nowhere"})
