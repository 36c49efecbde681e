"""The layout grammar of benchmarks/serve_layouts.py: what each name stands for, the engine settings it runs with,
and the names it refuses (a benchmark that silently ran another layout than the one named would report the wrong
figures); and how repeats of one concurrency's run become its row."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from layout_report import median_run  # noqa: E402
from layouts import Layout, serve_config  # noqa: E402
from sweep_models import Pair  # noqa: E402


def _args(**over: object) -> argparse.Namespace:
    base = {"concurrency": [1, 16], "smoke": False, "device": "cuda", "eager": False, "bonus_agreement": None,
            "k": 4, "max_model_len": 1024, "dtype": None}
    return argparse.Namespace(**{**base, **over})


PAIR = Pair("synthetic pair", "target-dir", "draft-dir", "synthetic", 0.8)


def test_layout_names_parse_to_their_settings() -> None:
    lay = Layout.parse("t1+d1/predraft/b4")
    assert (lay.target_tp, lay.draft_tp, lay.speculation_ahead, lay.branches, lay.num_gpus) == (1, 1, True, 4, 2)
    assert not lay.is_reference  # a branch budget changes how the draft runs, so it is compared, not referred to
    kwargs = serve_config(PAIR, lay, _args())["engine_kwargs"]
    assert kwargs["speculation_ahead"] is True and kwargs["speculation_ahead_branches"] == 4
    assert kwargs["draft_placement"] == "separate"
    assert "speculation_ahead_adaptive" not in kwargs  # the engine's default: fan-out cut to what fits
    fixed = Layout.parse("t1+d1/b4/fixed")
    assert fixed.fixed and fixed.branches == 4
    assert serve_config(PAIR, fixed, _args())["engine_kwargs"]["speculation_ahead_adaptive"] is False

    plain = Layout.parse("t1+d1")
    assert plain.branches is None and plain.is_reference
    assert "speculation_ahead_branches" not in serve_config(PAIR, plain, _args())["engine_kwargs"]

    offline = Layout.parse("offline+d/b2")  # a branch budget turns speculation ahead on where it is off by default
    assert offline.offline and offline.branches == 2 and offline.speculation_ahead is True and offline.num_gpus == 1
    assert serve_config(PAIR, offline, _args())["engine_kwargs"]["speculation_ahead"] is True
    assert Layout.parse("t1+d1/shared/b4").speculation_ahead is True
    shared = Layout.parse("t2+d1/shared")
    assert shared.num_gpus == 2 and serve_config(PAIR, shared, _args())["engine_kwargs"]["draft_resources"] == {
        "GPU": 0.25}
    ingress = Layout.parse("t1/i4")
    assert ingress.ingress == 4 and not ingress.is_reference and serve_config(PAIR, ingress, _args())[
        "ingress_replicas"] == 4
    assert "ingress_replicas" not in serve_config(PAIR, Layout.parse("t1"), _args())
    for name, want in (("t1/hap", "haproxy"), ("t1+d1/shared/sp", "serve")):
        proxied = Layout.parse(name)
        assert proxied.proxy == want and not proxied.is_reference
        assert serve_config(PAIR, proxied, _args())["http_proxy"] == want
    assert "http_proxy" not in serve_config(PAIR, Layout.parse("t1"), _args())
    direct = Layout.parse("t1+d1/colocated/ds")
    assert direct.direct and not direct.is_reference and serve_config(PAIR, direct, _args())["direct_streaming"]
    assert "direct_streaming" not in serve_config(PAIR, Layout.parse("t1"), _args())
    colocated = Layout.parse("t2+d2/colocated")
    assert colocated.num_gpus == 2
    assert serve_config(PAIR, colocated, _args())["engine_kwargs"]["draft_placement"] == "colocated"


@pytest.mark.parametrize(("name", "gpus", "fields"), [
    # tree mode: speculation ahead on, the fan-out in the engine's options; one pair of GPUs
    ("t1+d1/f4", 2, {"speculation_ahead": True, "speculation_ahead_tree_fanout": 4}),
    ("t2+d1/f4/fixed", 3, {"speculation_ahead_tree_fanout": 4, "speculation_ahead_adaptive": False}),
    ("offline+d/f2", 1, {"speculation_ahead": True, "speculation_ahead_tree_fanout": 2}),
    # engine replicas: each takes the layout's GPUs (the draft's too, unless on the target's)
    ("t1+d1/r2", 4, {"num_replicas": 2}),
    ("t1+d1/colocated/r4", 4, {"num_replicas": 4, "draft_placement": "colocated"}),
    ("t2+d1/shared/r2", 4, {"num_replicas": 2, "draft_resources": {"GPU": 0.25}}),
    ("t1/r3", 3, {"num_replicas": 3}),
    # a draft pool: the targets' GPUs, and the pool's draft replicas' D GPUs each, not a draft per target
    ("t1+d1/r3/p1", 4, {"num_replicas": 3, "draft_replicas": 1}),
    ("t2+d2/r4/p2", 12, {"num_replicas": 4, "draft_replicas": 2}),
    ("t1+d1/p1", 2, {"draft_replicas": 1}),
    # ... drafting ahead, as a draft group of one target does
    ("t1+d1/r3/p1/predraft", 4, {"num_replicas": 3, "draft_replicas": 1, "speculation_ahead": True}),
    ("t1+d1/r3/p1/f4/fixed", 4, {"num_replicas": 3, "draft_replicas": 1, "speculation_ahead_tree_fanout": 4,
                                 "speculation_ahead_adaptive": False}),
])
def test_tree_replica_and_pool_layouts(name: str, gpus: int, fields: dict[str, object]) -> None:
    lay = Layout.parse(name)
    assert lay.num_gpus == gpus and not lay.is_reference
    cfg = serve_config(PAIR, lay, _args())
    flat = {**cfg, **cfg["engine_kwargs"]}  # Serve's fields at the top, the engine's in engine_kwargs
    assert {k: flat.get(k) for k in fields} == fields
    for serve_field in ("num_replicas", "draft_replicas"):
        assert serve_field not in cfg["engine_kwargs"]
        if serve_field not in fields:
            assert serve_field not in cfg
    # The pool drafts ahead as asked only.
    if lay.pool is not None and lay.speculation_ahead is None and lay.fanout is None:
        assert not {"speculation_ahead", "speculation_ahead_tree_fanout"} & set(cfg["engine_kwargs"])
    assert lay.target_replicas == fields.get("num_replicas", 1)


def test_saguaro_layouts_need_probabilistic_rejection() -> None:
    lay = Layout.parse("t1+d1/f4/sg0.5")
    assert (lay.fanout, lay.saguaro, lay.speculation_ahead) == (4, 0.5, True)
    assert Layout.parse("offline+d/b3/sg0.25").saguaro == 0.25
    real = Pair("real pair", "target", "draft", "probabilistic")
    assert serve_config(real, lay, _args())["engine_kwargs"]["speculation_ahead_saguaro"] == 0.5
    with pytest.raises(ValueError, match="only probabilistic rejection reads"):
        serve_config(PAIR, lay, _args())  # the synthetic pair


def test_an_agreement_profile_reaches_synthetic_drafts_only(tmp_path: Path) -> None:
    """--agreement-profile (benchmark-only): the profile's T=0 table becomes the engine's synthetic_top_f_agreement
    for layouts with a draft of a synthetic pair, and nothing anywhere else."""
    import json

    table = [[0.3, 0.4], [0.3, 0.5], [0.75, 0.85]]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"profiles": [{"T": 0.7, "top_f_agreement": [[0.1, 0.2]] * 3},
                                             {"T": 0.0, "top_f_agreement": table}]}))
    args = _args(agreement_profile=str(path))
    assert serve_config(PAIR, Layout.parse("t1+d1/f2"), args)["engine_kwargs"]["synthetic_top_f_agreement"] == table
    assert "synthetic_top_f_agreement" not in serve_config(PAIR, Layout.parse("t1"), args)["engine_kwargs"]
    real = Pair("real pair", "target", "draft", "probabilistic")
    assert "synthetic_top_f_agreement" not in serve_config(real, Layout.parse("t1+d1"), args)["engine_kwargs"]
    assert "synthetic_top_f_agreement" not in serve_config(PAIR, Layout.parse("t1+d1"), _args())["engine_kwargs"]
    # the bundled profile of the SmolLM2 pair is one the engine takes: k + 1 = 5 outcomes, the bonus the likeliest hit
    from agreement_profile import BUNDLED, load_agreement

    from engine.agreement_profile import AgreementProfile

    bundled = AgreementProfile.from_table(load_agreement(BUNDLED))
    assert len(bundled.top_f) == 5 and all(bundled.row(4, 4)[0] > bundled.row(a, 4)[0] for a in range(4))


def test_served_configs_of_the_new_options_pass_the_serve_config_checks() -> None:
    """What serve_config writes for r<N>, p<M> and f<N> is what `specserve serve` accepts (its own checks,
    deploy/config.py, and the engine's option checks), not just names that look right."""
    import torch

    from deploy.config import ServeConfig
    from engine.config import EngineConfig

    real = Pair("real pair", "target", "draft", "probabilistic")
    for name in ("t1+d1/r3/p1", "t1+d1/colocated/r4", "t1+d1/f4/sg0.5/r2", "t2+d1/shared/r2", "t1+d1/r3/p1/f4/sg0.5"):
        cfg = serve_config(real, Layout.parse(name), _args())
        config = ServeConfig.from_dict({k: v for k, v in cfg.items() if k != "engine_kwargs"})
        config.validate()
        kwargs = cfg["engine_kwargs"]
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        EngineConfig(device=torch.device("cpu"), dtype=torch.float32, max_model_len=1024, num_speculative_tokens=4,
                     **{k: v for k, v in kwargs.items() if k in known}).validate()
        # the pool's own check, with speculation ahead's settings as the layout would give them
        if config.draft_replicas is not None:
            ServeConfig.from_dict({**{k: v for k, v in cfg.items() if k != "engine_kwargs"},
                                   **{k: v for k, v in kwargs.items() if k in ServeConfig.field_names()}}).validate()


@pytest.mark.parametrize(("name", "words"), [
    ("t1/b4", "need a draft"),
    ("offline/b2", "need a draft"),
    ("t1+d1/b0", "N >= 1"),
    ("t1+d1/b2/b4", "one b<N>"),
    ("t1+d1/predraft/fixed", "give b<N> or f<N>"),
    ("t1+d1/b2/nopredraft", "nopredraft"),
    ("t1+d1/predraft/nopredraft", "not both"),
    ("t1+d2/colocated", "colocated needs"),
    ("offline/i2", "the offline engine has none"),
    ("t1/i0", "N >= 1"),
    ("t1/i2/i4", "one i<N>"),
    ("offline+d/hap", "the offline engine has none"),
    ("t1/hap/sp", "hap or sp, not both"),
    ("offline/ds", "the offline engine has none"),
    ("offline+d/r2", "the offline engine has none"),
    ("offline+d/p1", "the offline engine has none"),
    ("t1+d1/b2/f4", "give one"),
    ("t1+d1/f4/nopredraft", "nopredraft"),
    ("t1/f4", "need a draft"),
    ("offline/f2", "need a draft"),
    ("t1+d1/f0", "N >= 1"),
    ("t1+d1/f65", "at most 64"),
    ("t1+d1/sg0.5", "needs f<N> or b<N> with N >= 2"),
    ("t1+d1/b1/sg0.5", "needs f<N> or b<N> with N >= 2"),
    ("t1+d1/f4/sg1", "0 < C < 1"),
    ("t1+d1/f4/sg0.2/sg0.3", "one sg<C>"),
    ("t1+d1/r0", "N >= 1"),
    ("t1+d1/r2/r3", "one r<N>"),
    ("t1/r2/p1", "need a draft"),
    ("t1+d1/r2/p3", "more draft replicas than the 2 engine replicas"),
    ("t1+d1/p2", "more draft replicas than the 1 engine replicas"),
    ("t1+d1/colocated/r2/p1", "p<M> takes none of colocated"),
    ("t2+d1/shared/r2/p1", "p<M> takes none of shared"),
    ("t1+d1/r2/p1/ds", "p<M> takes none of ds"),
    ("t1/i2/ds", "neither the offline engine nor i<N>"),
    ("t1+d1/fast", "unknown options"),
    ("x1+d1", "is not t<T>"),
])
def test_bad_layout_names_are_refused_with_the_reason(name: str, words: str) -> None:
    with pytest.raises(ValueError, match="layout") as err:
        Layout.parse(name)
    assert words in str(err.value)


def _run(tok_s: float, tpot: float | None, ttft: float) -> dict[str, object]:
    return {"concurrency": 16, "output_tok_s": tok_s, "median_tpot_ms": tpot, "median_ttft_ms": ttft,
            "phases_ms": {"verify": tpot}}


def test_repeats_give_the_median_tpot_run_with_the_spread() -> None:
    runs = [_run(2400.0, 4.7, 210.0), _run(2950.0, 4.1, 134.0), _run(2700.0, 4.3, 160.0)]
    row = median_run(runs)
    # every field from the one repeat whose TPOT is the median, not a mix of runs
    assert (row["output_tok_s"], row["median_tpot_ms"], row["median_ttft_ms"]) == (2700.0, 4.3, 160.0)
    assert row["phases_ms"] == {"verify": 4.3}
    assert [r["median_tpot_ms"] for r in row["repeats"]] == [4.7, 4.1, 4.3]
    assert median_run(runs[:2])["median_tpot_ms"] == 4.1  # an even count takes the lower median
    assert median_run([_run(1.0, None, 1.0), _run(2.0, 5.0, 1.0)])["median_tpot_ms"] == 5.0  # no TPOT ranks last
    assert "repeats" not in median_run(runs[:1])
    with pytest.raises(ValueError, match="at least one run"):
        median_run([])


def test_router_ttft_is_the_mean_between_two_scrapes() -> None:
    """The router's own TTFT (arrival at the router to first token) over the requests between two /metrics
    scrapes; none without scrapes or without new first tokens."""
    from layout_report import router_ttft_mean_ms

    name = "specserve_time_to_first_token_seconds_"
    before = {name + "sum": 1.0, name + "count": 10.0}
    after = {name + "sum": 1.5, name + "count": 14.0}
    assert router_ttft_mean_ms(before, after) == pytest.approx(125.0)  # 0.5 s over 4 requests
    assert router_ttft_mean_ms(before, before) is None
    assert router_ttft_mean_ms(None, after) is None


def test_speculation_ahead_counters_reach_metrics_and_the_report() -> None:
    """The engine's running totals (lookups, hits, drafted, unused, skipped branches) become Prometheus counter
    increases, restart with a new draft group, and come back from a scrape as the layout report's summary,
    skipped branches included (a fan-out cut short by max_num_seqs shows there)."""
    from layout_report import ahead_from_metrics, ahead_summary
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from engine.speculation.ahead.totals import NUM_TOTALS
    from serving.metrics import EngineMetrics

    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)

    def scrape() -> dict[str, float]:
        text = generate_latest(registry).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    before = ahead_from_metrics(scrape())
    assert before == (0.0, 0.0, 0.0, 0.0, 0.0)
    def totals(*first: int, trees: tuple[int, int] = (0, 0), by_outcome: tuple[int, ...] = ()) -> tuple[int, ...]:
        return (*first, *trees, *by_outcome) + (0,) * (NUM_TOTALS - 7 - len(by_outcome))

    metrics.on_speculation_ahead(totals(10, 4, 40, 24, 3, trees=(5, 60), by_outcome=(1, 0, 3)))
    metrics.on_speculation_ahead(totals(20, 9, 80, 44, 5, trees=(9, 100), by_outcome=(2, 0, 7)))
    # A new draft group counts from 0: all of it is new.
    metrics.on_speculation_ahead(totals(2, 1, 8, 4, 1, trees=(1, 10), by_outcome=(0, 1)))
    after = ahead_from_metrics(scrape())
    assert after == (22.0, 10.0, 88.0, 48.0, 6.0)
    summary = ahead_summary(before, after)
    assert summary == {"hit_rate": 10 / 22, "unused_share": 48 / 88, "lookups": 22.0, "skipped_branches": 6.0,
                       "drafted_per_lookup": 88 / 22}
    scraped = scrape()
    assert scraped["specserve_speculation_ahead_trees_total"] == 10
    assert scraped["specserve_speculation_ahead_tree_nodes_total"] == 110
    outcome_hits = {s.labels["accepted"]: s.value for f in text_string_to_metric_families(generate_latest(
        registry).decode()) for s in f.samples if s.name == "specserve_speculation_ahead_outcome_hits_total"}
    assert outcome_hits == {"0": 2.0, "1": 1.0, "2": 7.0}  # an outcome's series appears with its first hit
    assert ahead_summary(before, before) is None  # nothing drafted ahead
    with pytest.raises(ValueError, match=f"{NUM_TOTALS} speculation-ahead totals, got 4"):
        metrics.on_speculation_ahead((1, 1, 1, 1))  # an engine that leaves a counter out is a bug, not a zero
    assert ahead_from_metrics(scrape()) == after  # and it changed nothing
