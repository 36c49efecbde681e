"""A benchmark run's figures (vLLM `bench serve` definitions), its table, and its JSON.

Throughput counts completed requests only, over the whole run (first send to last response). Latencies are
in milliseconds: TTFT, TPOT (per request: (E2E - TTFT) / (output tokens - 1)), ITL (every gap between streamed
chunks) and E2E, each as mean, median and p99. Speculation: acceptance rate = accepted / drafted tokens,
acceptance length = 1 + accepted / verify steps, and per position the accepted fraction of verify steps that
drafted there (docs/ARCHITECTURE.md's definitions), from the responses' `spec_decode` objects, or else from the
difference of the server's Prometheus counters before and after the run.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from deploy.bench.runner import RunResult

LATENCIES = ("ttft", "tpot", "itl", "e2el")
LATENCY_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
# Prometheus counters of speculation, by server: specserve (also with Ray's `ray_` prefix) and vLLM.
_SPEC_COUNTERS = {
    "num_drafts": ("specserve_spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total"),
    "num_draft_tokens": ("specserve_spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
    "num_accepted_tokens": ("specserve_spec_decode_num_accepted_tokens_total",
                            "vllm:spec_decode_num_accepted_tokens_total"),
}
_PER_POS = ("specserve_spec_decode_num_accepted_tokens_per_pos_total",
            "vllm:spec_decode_num_accepted_tokens_per_pos_total")


def summarize(run: RunResult, label: str | None = None) -> dict[str, Any]:
    """The run's figures as one JSON-able dict (also what the table and the plots read)."""
    ok = [r for r in run.results if r.success]
    failed = [r for r in run.results if not r.success]
    dur = run.duration_s
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    cfg = run.config
    per_request = {
        "prompt_lens": [r.prompt_len for r in ok], "output_lens": [r.output_len for r in ok],
        "ttfts_ms": [r.ttft * 1e3 for r in ok], "tpots_ms": [r.tpot * 1e3 for r in ok if r.tpot is not None],
        "itls_ms": [x * 1e3 for r in ok for x in r.itl], "e2els_ms": [r.latency * 1e3 for r in ok],
        "errors": [r.error for r in failed],
    }
    summary: dict[str, Any] = {
        "label": label, "model": cfg.model, "endpoint": cfg.endpoint,
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency, "temperature": cfg.temperature,
        "num_prompts": len(run.results), "duration_s": dur, "completed": len(ok), "failed": len(failed),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur if dur > 0 else 0.0,
        "output_throughput": out_tokens / dur if dur > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / dur if dur > 0 else 0.0,
    }
    for name, values in (("ttft", per_request["ttfts_ms"]), ("tpot", per_request["tpots_ms"]),
                         ("itl", per_request["itls_ms"]), ("e2el", per_request["e2els_ms"])):
        summary.update(_stats(name, values))
    summary["spec_decode"] = spec_summary(run)
    summary["spec_steps"] = speculation_steps(run)
    summary["per_request"] = per_request
    return summary


def load_point(summary: dict[str, Any]) -> dict[str, Any]:
    """A load sweep's row of one run (benchmarks/load_sweep.py): the offered load (concurrency cap and/or Poisson
    rate), throughput, TTFT/TPOT percentiles, ITL p99, acceptance length and the share of engine steps that
    speculated, under the names its JSON, table and plots use."""
    spec = summary.get("spec_decode") or {}
    steps = summary.get("spec_steps") or {}
    rate = summary["request_rate"]
    c = summary["max_concurrency"]
    return {"load": (f"c={c}" if c else "") + ("" if rate == "inf" else f"{' ' if c else ''}rate={rate:g}"),
            "concurrency": c, "request_rate": None if rate == "inf" else rate,
            "requests": summary["completed"], "failed": summary["failed"], "duration_s": summary["duration_s"],
            "output_tok_s": summary["output_throughput"], "req_s": summary["request_throughput"],
            "ttft_p50_ms": summary["median_ttft_ms"], "ttft_p99_ms": summary["p99_ttft_ms"],
            "tpot_p50_ms": summary["median_tpot_ms"], "tpot_p99_ms": summary["p99_tpot_ms"],
            "itl_p99_ms": summary["p99_itl_ms"], "acceptance_length": spec.get("acceptance_length"),
            "spec_step_share": steps.get("share"), "spec_steps": steps.get("speculating"),
            "plain_steps": steps.get("not_speculating")}


def _stats(name: str, values_ms: list[float]) -> dict[str, float | None]:
    if not values_ms:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    a = np.asarray(values_ms, dtype=np.float64)
    return {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
            f"p99_{name}_ms": float(np.percentile(a, 99))}


def spec_summary(run: RunResult) -> dict[str, Any] | None:
    """Speculation statistics of the run, or None when the server reported none (no speculation)."""
    specs = [r.spec for r in run.results if r.success and r.spec]
    if specs:
        drafts = sum(s["num_drafts"] for s in specs)
        drafted = sum(s["num_draft_tokens"] for s in specs)
        accepted = sum(s["num_accepted_tokens"] for s in specs)
        n = max((len(s["accepted_per_position"]) for s in specs), default=0)
        per_pos = [sum(s["accepted_per_position"][i] for s in specs if i < len(s["accepted_per_position"]))
                   for i in range(n)]
        source = "responses"
    else:
        diff = _metrics_diff(run.metrics_before, run.metrics_after)
        if diff is None:
            return None
        drafts, drafted, accepted, per_pos = diff
        source = "metrics"
    if not drafts:
        return None if source == "metrics" else _spec_dict(source, 0, 0, 0, [])
    return _spec_dict(source, drafts, drafted, accepted, per_pos)


_SPEC_STEPS = "specserve_spec_decode_steps_total"


def speculation_steps(run: RunResult) -> dict[str, Any] | None:
    """Engine steps of the run that speculated (drafted tokens to verify) and that did not, and the share that
    did: from the in-process driver's own count, else from the server's `specserve_spec_decode_steps_total`
    before and after the run (a server of several replicas: summed over them); None where neither is known."""
    if run.step_counts is not None:
        on, off = run.step_counts
    else:
        if run.metrics_before is None or run.metrics_after is None:
            return None
        counts = []
        for value in ("true", "false"):
            key = f'{_SPEC_STEPS}{{speculating="{value}"}}'
            key = key if key in run.metrics_after else "ray_" + key
            if key not in run.metrics_after:
                return None
            counts.append(int(round(run.metrics_after[key] - run.metrics_before.get(key, 0.0))))
        on, off = counts
    return {"speculating": on, "not_speculating": off, "share": on / (on + off) if on + off else None}


def _spec_dict(source: str, drafts: int, drafted: int, accepted: int, per_pos: list[int]) -> dict[str, Any]:
    return {"source": source, "num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
            "mean_draft_length": drafted / drafts if drafts else 0.0,
            "accepted_per_position": per_pos,
            "acceptance_by_position": [c / drafts for c in per_pos] if drafts else []}


def _metrics_diff(before: dict[str, float] | None, after: dict[str, float] | None
                  ) -> tuple[int, int, int, list[int]] | None:
    if before is None or after is None:
        return None

    def delta(names: tuple[str, ...]) -> float | None:
        for name in names:
            for key in (name, "ray_" + name):
                if key in after:
                    return after[key] - before.get(key, 0.0)
        return None

    vals = {k: delta(names) for k, names in _SPEC_COUNTERS.items()}
    if any(v is None for v in vals.values()):
        return None
    per_pos: dict[int, float] = {}
    for key, value in after.items():
        base = key.split("{", 1)[0].removeprefix("ray_")
        m = re.search(r'position="(\d+)"', key)
        if base in _PER_POS and m:
            per_pos[int(m.group(1))] = value - before.get(key, 0.0)
    counts = [int(round(per_pos.get(i, 0.0))) for i in range(max(per_pos) + 1)] if per_pos else []
    return (int(round(vals["num_drafts"])), int(round(vals["num_draft_tokens"])),  # type: ignore[arg-type]
            int(round(vals["num_accepted_tokens"])), counts)  # type: ignore[arg-type]


def format_table(s: dict[str, Any]) -> str:
    """vLLM-style result table of one summary."""
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result " + (f"({s['label']}) " if s.get("label") else ""),
                                  n=w, c="=")]

    def row(name: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        text = "n/a" if value is None else (fmt.format(value) if not isinstance(value, str) else value)
        lines.append("{:<40} {}".format(name + ":", text))

    row("Maximum request concurrency", s["max_concurrency"] if s["max_concurrency"] else "none", "{:<10}")
    row("Request rate (req/s)", str(s["request_rate"]), "{:<10}")
    row("Successful requests", s["completed"], "{:<10}")
    row("Failed requests", s["failed"], "{:<10}")
    row("Benchmark duration (s)", s["duration_s"])
    row("Total input tokens", s["total_input_tokens"], "{:<10}")
    row("Total generated tokens", s["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s)", s["request_throughput"])
    row("Output token throughput (tok/s)", s["output_throughput"])
    row("Total token throughput (tok/s)", s["total_token_throughput"])
    for name in LATENCIES:
        lines.append("{s:{c}^{n}}".format(s=" " + LATENCY_NAMES[name] + " ", n=w, c="-"))
        row(f"Mean {name.upper()} (ms)", s[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms)", s[f"median_{name}_ms"])
        row(f"P99 {name.upper()} (ms)", s[f"p99_{name}_ms"])
    spec = s.get("spec_decode")
    lines.append("{s:{c}^{n}}".format(s=" Speculative Decoding ", n=w, c="-"))
    if not spec:
        lines.append("(no speculation reported by the server)")
    elif not spec["num_drafts"]:
        lines.append("(no drafts: speculation was off at this load)")
    else:
        row("Acceptance rate (%)", spec["acceptance_rate"] * 100)
        row("Acceptance length", spec["acceptance_length"])
        row("Mean draft length", spec["mean_draft_length"])
        row("Drafts", spec["num_drafts"], "{:<10}")
        row("Draft tokens", spec["num_draft_tokens"], "{:<10}")
        row("Accepted tokens", spec["num_accepted_tokens"], "{:<10}")
        if spec["acceptance_by_position"]:
            row("Per-position acceptance (%)",
                ", ".join(f"{100 * a:.1f}" for a in spec["acceptance_by_position"]), "{}")
        row("Statistics from", spec["source"], "{}")
    lines.append("=" * w)
    return "\n".join(lines)


def format_sweep_table(summaries: list[dict[str, Any]]) -> str:
    """One line per run of a concurrency sweep."""
    head = f"{'concurrency':>11} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TPOT p50':>9} {'E2E p50':>9} " \
           f"{'accept':>7} {'acc len':>7} {'ok/fail':>8}"
    lines = [head, "-" * len(head)]
    for s in summaries:
        spec = s.get("spec_decode") or {}
        acc = f"{spec['acceptance_rate']:.2f}" if spec else "-"
        alen = f"{spec['acceptance_length']:.2f}" if spec else "-"
        lines.append(f"{s['max_concurrency'] or 'none':>11} {s['request_throughput']:>8.2f} "
                     f"{s['output_throughput']:>10.1f} {_ms(s['median_ttft_ms']):>9} {_ms(s['median_tpot_ms']):>9} "
                     f"{_ms(s['median_e2el_ms']):>9} {acc:>7} {alen:>7} {s['completed']:>4}/{s['failed']:<3}")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def bench_json(summaries: list[dict[str, Any]], args: dict[str, Any]) -> dict[str, Any]:
    """The --save-json document: the arguments and one summary per run (one run, or one per concurrency)."""
    return {"benchmark": "specserve bench", "args": args, "runs": summaries}


def save_json(path: str | Path, doc: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=1, default=_default))


def _default(o: Any) -> Any:
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    if isinstance(o, float) and math.isinf(o):
        return "inf"
    return str(o)
