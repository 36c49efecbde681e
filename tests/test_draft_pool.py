"""A draft pool (draft_replicas): two engine replicas share one draft replica, on a real local Ray + Serve.

The share arithmetic first (no Ray); then one application serves the tests below, in order: both replicas
speculate through the one draft group and stay exact (greedy equal to the target alone, offline), /health counts
both kinds of replicas, bad input is a 400, an overload is refused with 429 and loses nothing of the admitted
requests, a draft group killed mid-stream loses no request and no token, a draft replica that comes up takes a
target (which moves while requests stream) and hands it back when it stops, and a killed engine replica's share of
the draft is freed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from byte_models import byte_body, greedy_oracle, make_byte_models
from serve_support import Server, assert_error, engine_broadcast, engine_replica_actors, running_server, serve_config

from serving.draft_pool.shares import BlockShare, blocks_per_slot, check_share_fits

MAX_MODEL_LEN = 128
MAX_SEQS = 4
MAX_QUEUED = 4  # as many as the other tests send at once (Serve's own queue is bounded by it too)
PROMPTS = ["hello", "The sea is", "def f(x):", "0123456789"]


# --- block shares --------------------------------------------------------------------------------------------
def test_block_shares_are_disjoint_and_cover_the_pool() -> None:
    num_blocks, slots = 23, 3  # 22 usable: 7 each, one left over
    per = blocks_per_slot(num_blocks, slots)
    assert per == 7
    ranges = [BlockShare(s, per).to_global(list(range(1, per + 1))) for s in range(slots)]
    ids = [b for r in ranges for b in r]
    assert len(ids) == len(set(ids)) == slots * per and min(ids) == 1 and max(ids) < num_blocks
    share = BlockShare(2, per)
    assert share.num_blocks == per + 1
    assert share.to_global([0, 3, 0, 7]) == [0, 17, 0, 21]  # the null block stays null (sliding windows, padding)


def test_a_share_too_small_for_max_model_len_is_refused_with_its_numbers() -> None:
    assert check_share_fits(65, 2, 4, 128) == 32
    with pytest.raises(ValueError, match=r"leaves 31 blocks each.*max_model_len=128 needs 32"):
        check_share_fits(64, 2, 4, 128)
    with pytest.raises(ValueError, match="at least one target slot"):
        blocks_per_slot(64, 0)


# --- served: two targets, one draft --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_byte_models(tmp_path_factory.mktemp("byte"))


def _config(models: tuple[str, str]) -> dict[str, Any]:
    target, draft = models
    # Per engine replica four running and four waiting (and four in Serve's queue): past that, a request gets 429.
    # The pool drafts ahead for its targets (serving/draft_pool/ahead.py; one window a request, no scratch blocks):
    # every test below, faults and moves included, runs with it.
    return serve_config(target, draft, max_model_len=MAX_MODEL_LEN, num_replicas=2, draft_replicas=1,
                        draft_tenant_timeout_s=30.0, drain_timeout_s=1.0, max_queued_requests=MAX_QUEUED,
                        speculation_ahead=True, engine_kwargs={"num_kv_blocks": 64, "max_num_seqs": MAX_SEQS},
                        adaptive_draft_length=False)  # drafts every step: each response's drafts are counted


@pytest.fixture(scope="module")
def server(models: tuple[str, str]) -> Iterator[Server]:
    with running_server(_config(models), num_cpus=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def oracle(models: tuple[str, str]):
    return greedy_oracle(models[0], MAX_MODEL_LEN)


def pool_ranks() -> list[tuple[str, Any]]:
    import ray

    from serving.draft_pool.pool import POOL_PREFIX

    return sorted((a["name"], ray.get_actor(a["name"], namespace=a["namespace"]))
                  for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(POOL_PREFIX))


def pool_stats() -> dict[str, Any]:
    import ray

    ranks = pool_ranks()
    assert len(ranks) == 1, ranks
    return ray.get(ranks[0][1].pool_stats.remote(), timeout=30)


def wait_for(cond, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = cond()
        except Exception:  # noqa: BLE001 - a replica or group being replaced
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _run_all(server: Server, n: int, meanwhile: Any = None) -> dict[str, dict]:
    """Every prompt at once, `n` tokens each; `meanwhile()` runs while they stream."""
    out: dict[str, dict] = {}
    with server.http(timeout=120) as c:
        def one(p: str) -> None:
            out[p] = c.post("/v1/completions", json=byte_body(p, n)).json()

        threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        if meanwhile is not None:
            meanwhile()
        for t in threads:
            t.join()
    return out


def test_two_targets_share_one_draft_and_stay_exact(server: Server, oracle) -> None:
    stats = pool_stats()
    assert stats["tenants"] == 2 and stats["slots"] == 2 and stats["blocks_per_slot"] == 63
    assert sorted(t["slot"] for t in stats["by_tenant"].values()) == [0, 1]
    for _ in range(2):  # enough requests that both engine replicas serve some
        out = _run_all(server, 24)
        for p, body in out.items():
            assert body["choices"][0]["text"] == oracle(p, 24)[1], (p, body)
            assert body["spec_decode"]["num_drafts"] > 0
    steps = [t["steps"] for t in pool_stats()["by_tenant"].values()]
    assert len(steps) == 2 and all(s > 0 for s in steps), steps  # both targets drafted through the one group
    with server.http() as c:
        health = c.get("/health").json()
    assert health["engine_replicas"] == health["engine_replicas_serving"] == 2, health
    assert health["draft_replicas"] == health["draft_replicas_serving"] == 1, health
    assert health["speculation"] is True
    # The draft's metrics per draft replica and target: one draft replica, two targets, both drafting.
    from prometheus_client.parser import text_string_to_metric_families

    with server.http() as c:
        text = c.get("/metrics").text
    drafts = [s for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "specserve_spec_decode_num_drafts_total"]
    assert {s.labels["draft_replica"] for s in drafts} == {pool_ranks()[0][0].rsplit(":", 1)[1]}, drafts
    assert len({s.labels["replica"] for s in drafts if s.value > 0}) == 2, drafts
    # Speculation ahead's series, each target's own lookups, labelled alike.
    lookups = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "specserve_speculation_ahead_lookups_total"]
    assert {s.labels["draft_replica"] for s in lookups} == {pool_ranks()[0][0].rsplit(":", 1)[1]}, lookups
    assert len({s.labels["replica"] for s in lookups if s.value > 0}) == 2, lookups
    assert pool_stats()["speculation_ahead"]["passes"] > 0


def test_bad_input_is_a_400(server: Server) -> None:
    with server.http() as c:
        err = assert_error(c.post("/v1/completions", json={**byte_body("hi", 4), "max_tokens": -1}), 400)
        assert "max_tokens" in err["message"]
        assert_error(c.post("/v1/completions", json={**byte_body("hi", 4), "prompt": [10**7]}), 400)


def test_overload_gets_429_and_the_admitted_stay_exact(server: Server, oracle) -> None:
    """More requests at once than both engine replicas run and queue: the rest are refused with 429 at once, the
    admitted ones get their exact output; the draft replica's batch histogram is on /metrics, per draft replica."""
    from prometheus_client.parser import text_string_to_metric_families

    n = 32
    results: list = [None] * n
    with server.http(timeout=120) as c:
        def one(i: int) -> None:
            r = c.post("/v1/completions", json=byte_body(PROMPTS[i % len(PROMPTS)], 24))
            results[i] = (r.status_code, r.json())

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429} and 429 in statuses and statuses.count(200) >= 2 * MAX_SEQS, statuses
    for i, (status, body) in enumerate(results):
        if status == 429:
            assert body["error"]["code"] == "rate_limit_exceeded" and "max_queued_requests" in body["error"]["message"]
        else:
            assert body["choices"][0]["text"] == oracle(PROMPTS[i % len(PROMPTS)], 24)[1], body
    with server.http() as c:
        text = c.get("/metrics").text
    counts = [s for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "specserve_draft_pool_batch_tenants_count"]
    assert [s.labels["draft_replica"] for s in counts] == [pool_ranks()[0][0].rsplit(":", 1)[1]], counts
    batch = pool_stats()["batch_tenants"]
    assert counts[0].value == sum(batch.values()) > 0, (counts, batch)


def test_draft_group_killed_mid_stream_loses_no_request(server: Server, oracle) -> None:
    import ray

    name, rank0 = pool_ranks()[0]
    results: dict[str, dict] = {}
    with server.http(timeout=300) as c:
        def one(p: str) -> None:
            results[p] = c.post("/v1/completions", json=byte_body(p, 100)).json()

        threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        time.sleep(1.0)
        ray.kill(rank0, no_restart=True)
        for t in threads:
            t.join()
    for p in PROMPTS:
        assert "choices" in results[p], results[p]
        assert results[p]["choices"][0]["text"] == oracle(p, 100)[1], results[p]
    # Serve replaces the draft replica (its health check fails); both targets attach to the new group.
    wait_for(lambda: pool_ranks() and pool_ranks()[0][0] != name and pool_stats()["tenants"] == 2, 120,
             "both targets attached to a new draft group")
    wait_for(lambda: all(h["speculation"] for h in engine_broadcast("health")), 60, "speculation back on")
    out = _run_all(server, 16)
    for p, body in out.items():
        assert body["choices"][0]["text"] == oracle(p, 16)[1]


def test_a_new_draft_replica_takes_a_target_and_a_stopping_one_hands_it_back(server: Server, models, oracle) -> None:
    """The replicas' side of scaling the pool (draft_autoscaling_config): a draft replica that comes up takes one
    target of the replica holding both (the pool balances; the target moves between two of its steps while requests
    stream), and one that stops drains (its target moves back before its group is released, so it never fails
    over); every request stays exact. The new replica is built here, in the test's process, where Serve's
    autoscaler would start one; it reports its load as Serve's autoscaler reads it."""
    import asyncio

    import ray

    from deploy.config import ServeConfig
    from serving.draft_pool.autoscaling import DRAFT_BUSY, DRAFT_TENANTS
    from serving.draft_pool.pool import DraftPoolReplica

    wait_for(lambda: len(pool_ranks()) == 1 and pool_stats()["tenants"] == 2, 60, "both targets on the one replica")
    (name, _), = pool_ranks()
    engine_args = {**ServeConfig.from_dict(_config(models)).engine_args(), "device": "cpu"}
    extra = DraftPoolReplica.func_or_class(engine_args, name.split(":")[1], 2, 30.0, 30.0)
    try:
        asyncio.run(extra.record_autoscaling_stats())  # the busy meter's first reading

        def tenants() -> list[int]:
            return sorted(ray.get(h.pool_load.remote(), timeout=10)["tenants"] for _, h in pool_ranks())

        out = _run_all(server, 48, lambda: wait_for(lambda: tenants() == [1, 1], 60, "a target on the new replica"))
        for p, body in out.items():
            assert body["choices"][0]["text"] == oracle(p, 48)[1], (p, body)
        assert any("its target detached" in e for e in pool_stats_of(name)["evicted"])  # moved, not failed over
        out = _run_all(server, 12)  # both targets busy: the moved one drafts on the new replica
        for p, body in out.items():
            assert body["choices"][0]["text"] == oracle(p, 12)[1], (p, body)
        load = asyncio.run(extra.record_autoscaling_stats())
        assert load[DRAFT_TENANTS] == 1 and 0 < load[DRAFT_BUSY] <= 1, load
        drained: list[bool] = []
        out = _run_all(server, 48, lambda: drained.append(extra.drain_and_release()))
        assert drained == [True]  # its target left before the group went
        for p, body in out.items():
            assert body["choices"][0]["text"] == oracle(p, 48)[1], (p, body)
        assert [n for n, _ in pool_ranks()] == [name] and pool_stats()["tenants"] == 2
        assert all(h["speculation"] for h in engine_broadcast("health"))
    finally:
        extra.drain_and_release()  # nothing left to do once drained


def pool_stats_of(name: str) -> dict[str, Any]:
    import ray

    return ray.get(dict(pool_ranks())[name].pool_stats.remote(), timeout=30)


def test_a_killed_target_frees_its_share(server: Server) -> None:
    import ray

    before = pool_stats()
    assert before["tenants"] == 2
    replica, actor = sorted(engine_replica_actors().items())[0]
    ray.kill(actor, no_restart=True)
    stats = wait_for(lambda: (s := pool_stats())["tenants"] < 2 and s, 60, "the dead target's share freed")
    assert any("its router died" in e for e in stats["evicted"]), stats["evicted"]
    freed = set(before["by_tenant"]) - set(stats["by_tenant"])
    assert len(freed) == 1
