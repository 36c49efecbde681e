"""benchmarks/load_sweep.py and what it shares with `specserve bench`: the arrival schedule (Poisson at a fixed
seed, all at once at an infinite rate, a send deadline), the in-process driver's concurrency and arrival semantics,
long-tailed lengths, the statistics against a hand-computed run, and `--smoke` end to end (the served app and the
in-process engine under the same load points)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from serve_support import free_port

from deploy.bench.client import RequestResult
from deploy.bench.datasets import BenchRequest, lognormal_length, random_requests
from deploy.bench.plots import read_plot_values
from deploy.bench.report import load_point, summarize
from deploy.bench.runner import BenchConfig, RunResult, _arrivals, arrival_times

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))


# --------------------------------------------------------------------------------------------------------
# Arrivals
# --------------------------------------------------------------------------------------------------------

def test_poisson_arrivals_have_the_rate_and_repeat_with_the_seed() -> None:
    times = arrival_times(4000, rate=20.0, seed=7)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    # Exponential gaps: mean 1/rate (standard error 0.05/sqrt(4000) ~ 1.6%), coefficient of variation 1.
    assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.06)
    # Arrivals in the first 100 s: 2000 expected, Poisson spread sqrt(2000) ~ 45.
    assert abs(sum(t < 100.0 for t in times) - 2000) < 4 * 45
    assert arrival_times(4000, rate=20.0, seed=7) == times
    assert arrival_times(4000, rate=20.0, seed=8) != times
    # Burstiness 4 (gamma shape 4): the same mean gap, half the spread.
    smooth = arrival_times(4000, rate=20.0, burstiness=4.0, seed=7)
    sgaps = [b - a for a, b in zip(smooth, smooth[1:])]
    assert statistics.fmean(sgaps) == pytest.approx(1 / 20.0, rel=0.05)
    assert statistics.pstdev(sgaps) / statistics.fmean(sgaps) == pytest.approx(0.5, abs=0.05)
    assert arrival_times(5, rate=math.inf) == [0.0] * 5


def test_the_client_sends_at_the_arrival_times_and_none_after_the_deadline() -> None:
    reqs = [BenchRequest([3, 4], 2, 1) for _ in range(40)]
    want = arrival_times(40, rate=100.0, seed=1)

    async def collect(deadline_s: float | None) -> list[tuple[int, float]]:
        import time

        t0 = time.perf_counter()
        deadline = None if deadline_s is None else t0 + deadline_s
        return [(i, time.perf_counter() - t0) async for i, _ in _arrivals(reqs, 100.0, 1.0, 1, deadline)]

    sent = asyncio.run(collect(None))
    assert [i for i, _ in sent] == list(range(40))
    for (_, at), planned in zip(sent, want):
        assert planned - 1e-3 <= at <= planned + 0.25  # never early; late by a wake-up at most (a busy CI box)
    cut = asyncio.run(collect(0.1))
    assert [i for i, _ in cut] == [i for i, t in enumerate(want) if t <= 0.1]


# --------------------------------------------------------------------------------------------------------
# The in-process driver: the same arrivals, the same concurrency semantics as the client
# --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llm(tiny_models):
    from engine import LLM

    return LLM(tiny_models["llama"].path, block_size=4, max_model_len=64)


def _requests(lengths: list[int]) -> list[BenchRequest]:
    return [BenchRequest([5 + i, 6, 7, 8], 4, n) for i, n in enumerate(lengths)]


@pytest.mark.usefixtures("one_thread")
def test_in_process_concurrency_cap_passes_each_finished_slot_on(tiny_llm) -> None:
    from engine_driver import run_in_process

    cfg = BenchConfig(base_url="in-process", model="m", max_concurrency=2, ignore_eos=True)
    run = run_in_process(tiny_llm.engine, _requests([6, 2, 3, 5, 2, 4]), cfg, tiny_llm.tokenizer)
    res = run.results
    assert [r.output_len for r in res] == [6, 2, 3, 5, 2, 4] and all(r.success for r in res)
    ends = [r.start + r.latency for r in res]
    assert res[0].start == res[1].start  # both slots free at the start
    for i, r in enumerate(res[2:], 2):
        # A queued request's clock starts when a slot freed: the end of an earlier request, which it replaced.
        assert any(abs(r.start - e) < 1e-9 for e in ends[:i]), i
    for t in [r.start for r in res]:  # never more than 2 in flight
        assert sum(r.start <= t < e for r, e in zip(res, ends)) <= 2
    assert run.step_counts is not None and run.step_counts[0] == 0 and run.step_counts[1] > 0  # no draft


@pytest.mark.usefixtures("one_thread")
def test_in_process_requests_arrive_at_the_schedule_and_stop_at_the_deadline(tiny_llm) -> None:
    from engine_driver import run_in_process

    cfg = BenchConfig(base_url="in-process", model="m", request_rate=40.0, seed=3, ignore_eos=True)
    want = arrival_times(8, 40.0, seed=3)
    run = run_in_process(tiny_llm.engine, _requests([3] * 8), cfg, tiny_llm.tokenizer)
    starts = [r.start - run.results[0].start for r in run.results]
    # Not sent as a wave: each clock starts at its own arrival (no cap, so never later).
    assert starts == pytest.approx(want, abs=1e-6)
    assert all(r.ttft > 0 for r in run.results)
    cut = BenchConfig(base_url="in-process", model="m", request_rate=40.0, seed=3, ignore_eos=True,
                      max_duration_s=want[4] + 1e-4)
    assert len(run_in_process(tiny_llm.engine, _requests([3] * 8), cut, tiny_llm.tokenizer, tag="cut").results) == 5


# --------------------------------------------------------------------------------------------------------
# Lengths and statistics
# --------------------------------------------------------------------------------------------------------

def test_lognormal_lengths_are_long_tailed_and_clipped() -> None:
    rng = random.Random(0)
    draws = sorted(lognormal_length(rng, 100, 1.0, max_len=100_000) for _ in range(4000))
    assert statistics.median(draws) == pytest.approx(100, rel=0.06)
    assert 8 <= draws[int(0.99 * len(draws))] / 100 <= 13  # p99 = exp(2.33 sigma) ~ 10x the median
    clipped = [lognormal_length(rng, 100, 1.0) for _ in range(2000)]
    assert max(clipped) == 800 and min(clipped) >= 1  # 8 x the median by default
    reqs = random_requests(50, 20, 30, 0.0, seed=4, vocab_size=100, length_sigma=0.8, max_len=60)
    assert [len(r.prompt) for r in reqs] == [r.prompt_len for r in reqs]
    assert max(r.output_len for r in reqs) <= 60 and len({r.output_len for r in reqs}) > 10
    again = random_requests(50, 20, 30, 0.0, seed=4, vocab_size=100, length_sigma=0.8, max_len=60)
    assert [(r.prompt, r.output_len) for r in again] == [(r.prompt, r.output_len) for r in reqs]


def _result(ttft_ms: float, itl_ms: list[float], spec: dict | None = None) -> RequestResult:
    return RequestResult(success=True, prompt_len=4, output_len=len(itl_ms) + 1, ttft=ttft_ms / 1e3,
                         itl=[x / 1e3 for x in itl_ms], latency=(ttft_ms + sum(itl_ms)) / 1e3, spec=spec)


def _spec(drafts: int, drafted: int, accepted: int, per_pos: list[int]) -> dict:
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "accepted_per_position": per_pos}


def test_statistics_of_a_hand_computed_run() -> None:
    results = [
        _result(10, [10, 10, 10, 10], _spec(2, 8, 4, [2, 1, 1, 0])),  # TPOT 40 ms / 4 tokens = 10 ms
        _result(20, [20, 20]),  # TPOT 20
        _result(30, []),  # one token: no TPOT
        _result(40, [10] * 8, _spec(2, 8, 6, [2, 2, 1, 1])),  # TPOT 10
        RequestResult(success=False, error="HTTP 500: boom", output_len=7, ttft=9.0),  # counts nowhere
    ]
    cfg = BenchConfig(base_url="x", model="m", max_concurrency=4)
    s = summarize(RunResult(cfg, results, 2.0, None, None, step_counts=(30, 10)))
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (4, 1, 18)
    assert s["request_throughput"] == pytest.approx(4 / 2.0) and s["output_throughput"] == pytest.approx(18 / 2.0)
    # numpy's linear percentiles: TTFT [10, 20, 30, 40] -> p50 25, p99 at rank 2.97: 30 + 0.97 * 10
    assert (s["median_ttft_ms"], s["p99_ttft_ms"]) == pytest.approx((25.0, 39.7))
    # TPOT per request [10, 20, 10] -> p50 10, p99 at rank 1.98: 10 + 0.98 * 10
    assert (s["median_tpot_ms"], s["p99_tpot_ms"]) == pytest.approx((10.0, 19.8))
    # ITL per chunk, pooled: twelve 10s and two 20s -> p99 at rank 12.87 lies between two 20s
    assert (s["median_itl_ms"], s["p99_itl_ms"]) == pytest.approx((10.0, 20.0))
    assert s["spec_decode"]["acceptance_length"] == pytest.approx(1 + 10 / 4)
    row = load_point(s)
    assert row["load"] == "c=4" and row["concurrency"] == 4 and row["request_rate"] is None
    assert (row["req_s"], row["output_tok_s"], row["ttft_p99_ms"], row["tpot_p99_ms"], row["itl_p99_ms"]) == \
        pytest.approx((2.0, 9.0, 39.7, 19.8, 20.0))
    assert (row["spec_steps"], row["plain_steps"], row["spec_step_share"]) == (30, 10, 0.75)

    # Served: the step counts are the difference of the server's counter between the two scrapes.
    name = "specserve_spec_decode_steps_total"
    before = {f'{name}{{speculating="true"}}': 5.0, f'{name}{{speculating="false"}}': 1.0}
    after = {f'{name}{{speculating="true"}}': 8.0, f'{name}{{speculating="false"}}': 5.0}
    rate_cfg = BenchConfig(base_url="x", model="m", request_rate=4.0)
    served = load_point(summarize(RunResult(rate_cfg, results[:2], 1.0, before, after)))
    assert served["load"] == "rate=4" and served["request_rate"] == 4.0
    assert (served["spec_steps"], served["plain_steps"]) == (3, 4)
    assert served["spec_step_share"] == pytest.approx(3 / 7)
    assert load_point(summarize(RunResult(rate_cfg, results[:2], 1.0, None, None)))["spec_step_share"] is None


def test_the_steps_counter_splits_speculating_steps() -> None:
    from prometheus_client.exposition import generate_latest

    from deploy.bench.runner import parse_prometheus
    from serving.metrics import EngineMetrics

    metrics = EngineMetrics()
    for k in (4, 4, 0, 2, 0, 0):
        metrics.on_step({}, 1, 0, 0, {}, k)
    scrape = parse_prometheus(generate_latest(metrics.registry).decode())
    name = "specserve_spec_decode_steps_total"
    assert scrape[f'{name}{{speculating="true"}}'] == 3.0 and scrape[f'{name}{{speculating="false"}}'] == 3.0


def test_series_of_several_engine_and_draft_replicas_sum_to_one_total() -> None:
    """Behind a draft pool each engine's series also carry its draft replica: the totals the sweep reads (the
    steps that speculated) must sum over both labels, as they do over engine replicas alone."""
    from deploy.bench.runner import parse_prometheus

    name = "specserve_spec_decode_steps_total"
    text = "\n".join([
        "# TYPE specserve_spec_decode_steps_total counter",
        f'{name}{{draft_replica="d1",replica="e1",speculating="true"}} 8.0',
        f'{name}{{draft_replica="d1",replica="e1",speculating="false"}} 1.0',
        f'{name}{{draft_replica="d1",replica="e2",speculating="true"}} 5.0',
        f'{name}{{replica="e3",speculating="true"}} 2.0',
        'specserve_ttft_seconds_bucket{le="0.5",replica="e1"} 3.0',
        'specserve_ttft_seconds_bucket{le="0.5",replica="e2"} 4.0',
        'specserve_up{replica="e1"} 1.0'])
    scrape = parse_prometheus(text)
    assert scrape[f'{name}{{speculating="true"}}'] == 15.0 and scrape[f'{name}{{speculating="false"}}'] == 1.0
    assert scrape['specserve_ttft_seconds_bucket{le="0.5"}'] == 7.0 and scrape["specserve_up"] == 1.0
    assert scrape[f'{name}{{draft_replica="d1",replica="e2",speculating="true"}}'] == 5.0  # each series kept


# --------------------------------------------------------------------------------------------------------
# --smoke end to end
# --------------------------------------------------------------------------------------------------------

POINT_FIELDS = ("load", "requests", "req_s", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                "tpot_p99_ms", "itl_p99_ms", "acceptance_length", "spec_step_share")


def test_smoke_runs_served_and_in_process_under_the_same_load(tmp_path: Path) -> None:
    out = tmp_path / "sweep" / "load_sweep.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "load_sweep.py"), "--smoke", "--out", str(out),
                           "--work-dir", str(tmp_path / "work"), "--port", str(free_port())],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert list(doc["layouts"]) == ["offline+d", "t1+d1/colocated"]
    for name, res in doc["layouts"].items():
        assert "error" not in res, res
        assert [p["load"] for p in res["points"]] == ["c=2", "rate=8"]
        for p in res["points"]:
            assert all(p.get(f) is not None for f in POINT_FIELDS), (name, p)
            assert p["failed"] == 0 and 1 <= p["requests"] <= 6
            assert p["output_tok_s"] > 0 and p["req_s"] > 0
            assert 0 < p["ttft_p50_ms"] <= p["ttft_p99_ms"] and 0 < p["tpot_p50_ms"] <= p["tpot_p99_ms"]
            assert p["acceptance_length"] >= 1.0 and 0 < p["spec_step_share"] <= 1
    served = doc["layouts"]["t1+d1/colocated"]["points"]
    assert all(p["router_ttft_mean_ms"] > 0 for p in served)
    table = proc.stdout.strip().splitlines()
    assert table[-1].startswith("| t1+d1/colocated | rate=8 |")  # the table is printed last
    assert out.with_suffix(".md").read_text().strip().splitlines()[-4:] == table[-4:]
    tput = read_plot_values(out.with_name("load_sweep_throughput_vs_tpot.png"))
    assert set(tput) == set(doc["layouts"]) and all(len(v) == 2 for v in tput.values())
    ttft = read_plot_values(out.with_name("load_sweep_ttft_vs_load.png"))
    assert ttft["offline+d"]["concurrency"][0]["ttft_p99_ms"] == doc["layouts"]["offline+d"]["points"][0][
        "ttft_p99_ms"]


def test_sweeps_run_apart_merge_only_with_the_same_settings() -> None:
    from load_sweep import merged

    a = {"pair": "p", "settings": {"k": 4}, "command": "a", "env": {}, "layouts": {"offline": {"points": [1]}}}
    b = {"pair": "p", "settings": {"k": 4}, "command": "b", "env": {}, "layouts": {"t1": {"points": [2]}}}
    doc = merged([a, b])
    assert list(doc["layouts"]) == ["offline", "t1"] and doc["command"] == "a ; b"
    with pytest.raises(SystemExit, match="cannot merge"):
        merged([a, {**b, "settings": {"k": 2}}])


def test_per_target_loads_scale_with_the_engine_replicas() -> None:
    """--per-target: a layout of N engine replicas gets N times each given concurrency, rate and request count,
    and its rows keep the total, the per-target load, its GPUs and the throughput per GPU."""
    from layouts import Layout
    from load_sweep import load_points, parse_args, point_row, table

    argv = ["--concurrency", "1", "16", "--rates", "2", "--min-requests", "10"]
    per_target = parse_args([*argv, "--per-target"])
    pooled = Layout.parse("t1+d1/r3/p1")
    points = load_points(per_target, pooled.target_replicas)
    assert [(p.concurrency, p.rate, p.scale) for p in points] == [(3, math.inf, 3), (48, math.inf, 3), (None, 6.0, 3)]
    single = load_points(per_target, Layout.parse("offline+d").target_replicas)
    assert [(p.concurrency, p.rate) for p in single] == [(1, math.inf), (16, math.inf), (None, 2.0)]
    assert [p.seed for p in single] == [p.seed for p in points]  # the same requests' seeds whatever the replicas
    with pytest.raises(SystemExit):  # one way to set a synthetic draft's agreement at a time
        parse_args([*argv, "--agreement-profile", "p.json", "--bonus-agreement", "0.7"])
    total = load_points(parse_args(argv), 3)  # without --per-target the loads are the whole layout's
    assert [(p.concurrency, p.rate, p.targets) for p in total] == [(1, math.inf, 3), (16, math.inf, 3), (None, 2.0, 3)]

    results = [_result(10, [10] * 7), _result(20, [20] * 3)]  # 12 output tokens
    run = RunResult(BenchConfig(base_url="x", model="m", max_concurrency=48), results, 2.0, None, None)
    row = point_row(run, points[1], pooled, {})
    assert (row["concurrency"], row["concurrency_per_target"], row["targets"], row["gpus"]) == (48, 16, 3, 4)
    assert row["output_tok_s"] == pytest.approx(6.0) and row["output_tok_s_per_gpu"] == pytest.approx(6.0 / 4)
    assert row["load"] == "c=16 per target (x3)"
    rate_run = RunResult(BenchConfig(base_url="x", model="m", request_rate=6.0), results, 2.0, None, None)
    rate_row = point_row(rate_run, points[2], pooled, {})
    assert (rate_row["request_rate"], rate_row["request_rate_per_target"]) == (6.0, 2.0)
    assert rate_row["load"] == "rate=2 per target (x3)"
    sent = RunResult(BenchConfig(base_url="x", model="m", max_concurrency=16), results, 2.0, None, None)
    plain = point_row(sent, total[1], pooled, {})  # not per target: the load as sent, and its share per target
    assert plain["load"] == "c=16" and plain["concurrency_per_target"] == pytest.approx(16 / 3)

    doc = {"pair": "p", "command": "cmd", "env": {"device": "dev", "date": "today"},
           "settings": {**{k: getattr(per_target, k) for k in ("k", "input_len", "output_len", "length_sigma",
                                                               "min_seconds", "min_requests")}, "per_target": True},
           "layouts": {pooled.name: {"points": [row]}}}
    text = table(doc)
    assert "per target replica" in text
    header, _, line = text.strip().splitlines()[-3:]
    cells = dict(zip(*([c.strip() for c in r.strip("|").split("|")] for r in (header, line))))
    assert (cells["gpus"], cells["targets"], cells["output_tok_s_per_gpu"]) == ("4", "3", "1.5")
