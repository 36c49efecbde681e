"""The pieces of routing over engine replicas that need no cluster: prefix hashing and the prefix table, and the
merge of every replica's metrics into one exposition with a `replica` label. The routing itself runs in Serve in
tests/test_engine_replicas.py."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from serving.metrics import EngineMetrics, merge_replica_expositions
from serving.router.replica_router import PrefixTable, prefix_hashes


def test_prefix_hashes_name_whole_block_prefixes() -> None:
    a = prefix_hashes(list(range(20)), 8)
    b = prefix_hashes(list(range(16)) + [99, 98, 97, 96], 8)
    assert len(a) == 2 and a == b  # the partial last block is not hashed: same two whole blocks
    c = prefix_hashes([1000] + list(range(1, 20)), 8)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later prefix's hash
    assert prefix_hashes(list(range(7)), 8) == []


def test_prefix_table_longest_live_match_and_lru() -> None:
    table = PrefixTable(max_entries=4)
    long = prefix_hashes(list(range(32)), 8)  # 4 blocks
    table.record(long[:2], "r1")
    table.record(long, "r2")  # the longer prompt, on another replica, owns every block now
    assert table.longest_match(long, {"r1", "r2"}) == ("r2", 4)
    assert table.longest_match(long, {"r1"}) == (None, 0)  # r2 is gone: no live owner
    other = prefix_hashes(list(range(100, 116)), 8)
    table.record(other, "r1")  # 2 more entries past max_entries=4: the 2 least recently used go
    assert len(table) == 4
    # Evicted: long's first two blocks (least recently used). Its 4-block hash still names the whole prefix, but a
    # prompt sharing only the first two blocks no longer finds an owner.
    assert table.longest_match(long, {"r1", "r2"}) == ("r2", 4)
    assert table.longest_match(long[:2] + prefix_hashes(list(range(16)) + [7] * 16, 8)[2:], {"r2"}) == (None, 0)
    assert table.longest_match(other, {"r1"}) == ("r1", 2)
    table.forget("r1")
    assert table.longest_match(other, {"r1"}) == (None, 0)


def test_merged_exposition_labels_each_replica_once_per_family() -> None:
    a, b = EngineMetrics(), EngineMetrics()
    a.on_tokens(3, None)
    b.on_tokens(5, None)
    b.kv_usage.labels(model="target", kv_group="0").set(0.25)
    text = merge_replica_expositions([("b", b.exposition()), ("a", a.exposition())])
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # one family each, as a scrape requires
    tokens = {s.labels["replica"]: s.value for f in families for s in f.samples
              if s.name == "specserve_generation_tokens_total"}
    assert tokens == {"a": 3.0, "b": 5.0}
    kv = [s for f in families for s in f.samples if s.name == "specserve_kv_cache_usage_perc"]
    assert [(s.labels, s.value) for s in kv] == [({"model": "target", "kv_group": "0", "replica": "b"}, 0.25)]
    assert all("replica" in s.labels for f in families for s in f.samples)
