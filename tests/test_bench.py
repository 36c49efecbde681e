"""`specserve bench` against a real local server: Ray + Serve on 127.0.0.1 serving tiny byte-level models with a
draft (tests/serve_support.py), with load-adaptive speculation (k=3 at batch 1, off above batch 2).

The command runs as users run it (deploy.cli.main); its table, JSON and PNGs are checked against what was sent
(counts, exact token lengths: prompts go as token ids and --ignore-eos fixes the output lengths) and against the
server's own Prometheus counters, which the benchmark does not read when responses carry `spec_decode`.
"""

from __future__ import annotations

import json

import httpx
import pytest
from byte_models import make_byte_models
from PIL import Image
from serve_support import running_server, serve_config

from deploy.bench.plots import read_plot_values
from deploy.bench.runner import parse_prometheus
from deploy.cli import main

NUM, IN_LEN, OUT_LEN = 8, 16, 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_byte_models(tmp_path_factory.mktemp("bench-models"))


@pytest.fixture(scope="module")
def server(models):
    target, draft = models
    cfg = serve_config(target, draft, engine_builder="serving.engine_builders:build_local_engine",
                       draft_length_schedule="1:3", spec_disable_above_batch_size=2)
    with running_server(cfg, num_cpus=4) as srv:
        yield srv


def _spec_counters(base: str) -> dict[str, float]:
    samples = parse_prometheus(httpx.get(base + "/metrics", timeout=30).text)
    return {k: v for k, v in samples.items() if k.startswith("specserve_spec_decode")}


def _bench(server, models, *extra: str) -> int:
    return main(["bench", "--base-url", server.base, "--tokenizer", models[0], "--disable-tqdm", *extra])


def _assert_png(path, expected_values: dict) -> dict:
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100
    values = read_plot_values(path)
    for key, want in expected_values.items():
        assert values[key] == pytest.approx(want), key
    return values


def test_bench_random_table_json_and_plots(server, models, tmp_path, capsys):
    before = _spec_counters(server.base)
    rc = _bench(server, models, "--dataset-name", "random", "--num-prompts", str(NUM), "--random-input-len",
                str(IN_LEN), "--random-output-len", str(OUT_LEN), "--ignore-eos", "--max-concurrency", "1",
                "--label", "tiny-adaptive", "--save-json", str(tmp_path / "bench.json"), "--plot",
                str(tmp_path / "plots"))
    after = _spec_counters(server.base)
    assert rc == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["benchmark"] == "specserve bench" and doc["args"]["model"] == server.model
    (run,) = doc["runs"]

    # Counts: what was sent, token for token (the server's usage agrees with the dataset's exact lengths).
    assert (run["completed"], run["failed"], run["num_prompts"]) == (NUM, 0, NUM)
    assert run["per_request"]["prompt_lens"] == [IN_LEN] * NUM
    assert run["per_request"]["output_lens"] == [OUT_LEN] * NUM
    assert run["total_input_tokens"] == NUM * IN_LEN and run["total_output_tokens"] == NUM * OUT_LEN
    assert run["output_throughput"] == pytest.approx(NUM * OUT_LEN / run["duration_s"])
    assert run["request_throughput"] == pytest.approx(NUM / run["duration_s"])
    assert run["total_token_throughput"] == pytest.approx(NUM * (IN_LEN + OUT_LEN) / run["duration_s"])
    # Latencies: ordered as they must be; E2E covers every request's TTFT.
    assert 0 < run["median_ttft_ms"] <= run["p99_ttft_ms"]
    assert run["mean_e2el_ms"] > run["mean_ttft_ms"] > 0 and run["mean_tpot_ms"] > 0
    assert all(e >= t for e, t in zip(run["per_request"]["e2els_ms"], run["per_request"]["ttfts_ms"]))
    assert run["duration_s"] * 1e3 >= max(run["per_request"]["e2els_ms"])
    # Concurrency 1 = batch 1: speculation runs (k=3); every chunk after the first is one ITL sample.
    spec = run["spec_decode"]
    assert spec["source"] == "responses" and spec["num_drafts"] > 0
    assert spec["mean_draft_length"] == pytest.approx(spec["num_draft_tokens"] / spec["num_drafts"])
    assert spec["mean_draft_length"] <= 3 and len(spec["accepted_per_position"]) == 3
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(spec["num_accepted_tokens"] / spec["num_draft_tokens"])
    # ... and the server's Prometheus counters moved by exactly the responses' totals.
    assert after["specserve_spec_decode_num_drafts_total"] - before.get("specserve_spec_decode_num_drafts_total",
                                                                        0) == spec["num_drafts"]
    assert after["specserve_spec_decode_num_accepted_tokens_total"] - before.get(
        "specserve_spec_decode_num_accepted_tokens_total", 0) == spec["num_accepted_tokens"]

    # The table shows the same figures.
    assert "Serving Benchmark Result (tiny-adaptive)" in out
    assert f"{'Successful requests:':<40} {NUM}" in out
    assert f"{'Total generated tokens:':<40} {NUM * OUT_LEN}" in out
    assert f"{'Output token throughput (tok/s):':<40} {run['output_throughput']:.2f}" in out
    assert f"{'Acceptance length:':<40} {spec['acceptance_length']:.2f}" in out
    assert f"{'Median TTFT (ms):':<40} {run['median_ttft_ms']:.2f}" in out

    # The plots exist, are PNGs and carry the JSON's values.
    lat = _assert_png(tmp_path / "plots" / "latency.png", {})
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert lat[name]["mean"] == pytest.approx(run[f"mean_{name}_ms"])
        assert lat[name]["p99"] == pytest.approx(run[f"p99_{name}_ms"])
    assert lat["ttft"]["count"] == NUM and lat["itl"]["count"] == len(run["per_request"]["itls_ms"])
    _assert_png(tmp_path / "plots" / "acceptance.png",
                {"acceptance_by_position": spec["acceptance_by_position"],
                 "acceptance_length": spec["acceptance_length"]})


def test_bench_sweep_with_jsonl_shows_speculation_off_under_load(server, models, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"question {i}: what is {i} + {i}?"}) for i in range(6)))
    rc = _bench(server, models, "--dataset-name", "jsonl", "--dataset-path", str(prompts), "--num-prompts", "8",
                "--output-len", "10", "--ignore-eos", "--sweep-concurrency", "1,4", "--save-json",
                str(tmp_path / "sweep.json"), "--plot", str(tmp_path / "plots"))
    assert rc == 0
    runs = json.loads((tmp_path / "sweep.json").read_text())["runs"]
    assert [r["max_concurrency"] for r in runs] == [1, 4]
    assert all(r["completed"] == 8 and r["total_output_tokens"] == 80 for r in runs)
    # Same prompts in both runs; the server counted their tokens (the file's prompts repeat after 6).
    assert runs[0]["per_request"]["prompt_lens"] == runs[1]["per_request"]["prompt_lens"]
    # Batch 1 speculates at every decode step; batch 4 > 2 only once the last requests drain.
    c1, c4 = runs[0]["spec_decode"], runs[1]["spec_decode"]
    assert c1["num_drafts"] > 0
    assert c4["num_drafts"] < c1["num_drafts"]
    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 2 and "concurrency" in out and "out tok/s" in out
    values = _assert_png(tmp_path / "plots" / "throughput_vs_concurrency.png", {})
    (series,) = values.values()
    assert series == [{"max_concurrency": r["max_concurrency"], "output_throughput": pytest.approx(
        r["output_throughput"])} for r in runs]
    for c in (1, 4):
        assert (tmp_path / "plots" / f"latency_c{c}.png").is_file()
    # The server shows the draft length it used last: the last step of the last run had a batch of 1 or 2.
    gauge = parse_prometheus(httpx.get(server.base + "/metrics", timeout=30).text)
    assert gauge["specserve_spec_decode_draft_length"] in (0.0, 3.0)


def test_bench_chat_sharegpt(server, models, tmp_path):
    data = [{"id": str(i), "conversations": [{"from": "human", "value": f"Tell me about the number {i} please."},
                                             {"from": "gpt", "value": "It is a number that comes after " * 2}]}
            for i in range(4)]
    data.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}]})  # no reply: skipped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    rc = _bench(server, models, "--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt",
                "--dataset-path", str(path), "--num-prompts", "4", "--max-concurrency", "2", "--ignore-eos",
                "--save-json", str(tmp_path / "chat.json"))
    assert rc == 0
    (run,) = json.loads((tmp_path / "chat.json").read_text())["runs"]
    assert run["completed"] == 4 and run["failed"] == 0
    # The reply's token count is each request's max_tokens (byte tokenizer: one token per byte).
    reply = len("It is a number that comes after " * 2)
    assert run["per_request"]["output_lens"] == [reply] * 4
    assert run["mean_ttft_ms"] > 0 and run["spec_decode"]["num_drafts"] > 0


def test_bench_counts_failed_requests(server, models, tmp_path, capsys):
    # 300-token prompts do not fit max_model_len=128: every request fails with the server's 400.
    rc = _bench(server, models, "--num-prompts", "2", "--random-input-len", "300", "--random-output-len", "4",
                "--save-json", str(tmp_path / "fail.json"))
    assert rc == 1
    (run,) = json.loads((tmp_path / "fail.json").read_text())["runs"]
    assert (run["completed"], run["failed"]) == (0, 2)
    assert all(e.startswith("HTTP 400") and "max_model_len" in e for e in run["per_request"]["errors"])
    assert "failed" in capsys.readouterr().err


def test_draft_length_gauge_follows_load(server):
    """specserve_spec_decode_draft_length is the k of the last step: 0 while 4 requests run (batch 4 > 2), 3 once
    one request runs alone."""
    import threading

    def gauge() -> float:
        return parse_prometheus(httpx.get(server.base + "/metrics", timeout=30).text)[
            "specserve_spec_decode_draft_length"]

    body = {"model": server.model, "prompt": [5 + i for i in range(8)], "max_tokens": 110, "temperature": 0,
            "ignore_eos": True, "stream": True}
    started = threading.Barrier(5)
    errors: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # running: it has its first token
            started.wait(timeout=30)
            errors.extend(line for line in lines if '"error"' in line)

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait(timeout=30)
    under_load = gauge()
    for t in threads:
        t.join(timeout=60)
    assert not errors and under_load == 0.0
    r = httpx.post(server.base + "/v1/completions", json={**body, "stream": False, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200 and r.json()["spec_decode"]["num_drafts"] > 0
    assert gauge() == 3.0
