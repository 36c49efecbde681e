"""The numbers and report of benchmarks/serve_layouts.py: per-step phase means and speculation-ahead rates from
/metrics scrapes or in-process totals, one run's summary, the greedy check against each layout's reference, and
the markdown tables."""

from __future__ import annotations

import argparse
from typing import Any

from layouts import Layout

from deploy.bench.report import summarize

PHASES = ("schedule", "propose", "handoff", "prepare", "verify", "sample", "speculation_ahead", "between", "dispatch",
          "commit")
# The router's share of a step: its bookkeeping and the transport (handoff: the draft's proposal to the target).
ROUTER_PHASES = ("schedule", "dispatch", "handoff", "commit")
AHEAD_COUNTERS = ("lookups", "hits", "drafted_tokens", "unused_tokens", "skipped_branches")


def phase_means_ms(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """`phase_summary` of the steps between two /metrics scrapes."""
    if not before or not after:
        return {}
    totals: dict[str, list[float]] = {}
    for phase in PHASES:
        # The bench client's parser sums each series over the engine replicas under its unlabelled name.
        count, total = (f'specserve_step_duration_seconds_{s}{{phase="{phase}"}}' for s in ("count", "sum"))
        totals[phase] = [after.get(total, 0.0) - before.get(total, 0.0), after.get(count, 0.0) - before.get(count, 0.0)]
    return phase_summary(totals)


def router_ttft_mean_ms(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Mean time from a request's arrival at the router to its first token, over the requests that got their first
    token between two /metrics scrapes: the client's TTFT less this is what HTTP, the proxy, the ingress and the
    handle hops add."""
    if not before or not after:
        return None
    total, count = (after.get(f"specserve_time_to_first_token_seconds_{s}", 0.0)
                    - before.get(f"specserve_time_to_first_token_seconds_{s}", 0.0) for s in ("sum", "count"))
    return 1e3 * total / count if count > 0 else None


def phase_summary(totals: dict[str, list[float]]) -> dict[str, float]:
    """Mean milliseconds per step of each phase from [seconds, steps] totals (steps: those that had the phase),
    the router's share of a step and the step count."""
    out = {p: 1e3 * totals[p][0] / totals[p][1] for p in PHASES if p in totals and totals[p][1] > 0}
    if out:
        out["router"] = sum(out.get(p, 0.0) for p in ROUTER_PHASES)
        out["steps"] = max(totals[p][1] for p in PHASES if p in totals)
    return out


def ahead_from_metrics(metrics: dict[str, float] | None) -> tuple[float, ...] | None:
    """The speculation_ahead_* counters of a /metrics scrape, in StepResult.speculation_ahead_totals' order."""
    if not metrics:
        return None
    return tuple(metrics.get(f"specserve_speculation_ahead_{name}_total", 0.0) for name in AHEAD_COUNTERS)


def _ahead_cell(ahead: dict[str, float]) -> str:
    skipped = ahead.get("skipped_branches") or 0
    per_lookup = ahead.get("drafted_per_lookup")
    return f"{ahead['hit_rate']:.2f} ({ahead['unused_share']:.0%} unused" + (
        f", {per_lookup:.1f} tokens ahead a lookup" if per_lookup is not None else "") + (
        f", {skipped:.0f} branches skipped)" if skipped else ")")


def ahead_summary(before: tuple[float, ...] | None, after: tuple[float, ...] | None) -> dict[str, float] | None:
    """Speculation ahead over a run: hit rate (hits / lookups), the share of tokens drafted ahead that were never
    proposed and the branches chosen but not drafted (no rows or scratch blocks left); None where nothing was
    drafted ahead."""
    if before is None or after is None:
        return None
    # The first five totals (an engine's totals go on with tree mode's: engine/speculation/ahead/totals.py).
    lookups, hits, drafted, unused, skipped = (a - b for a, b in zip(after[:5], before[:5], strict=True))
    if not drafted:
        return None
    # Tokens drafted ahead a lookup: about k x the windows a request got (the fan-out the budget allowed).
    return {"hit_rate": hits / max(lookups, 1), "unused_share": unused / drafted, "lookups": lookups,
            "skipped_branches": skipped, "drafted_per_lookup": drafted / max(lookups, 1)}


def run_summary(run: Any, c: int, phases: dict[str, float], ahead: dict[str, float] | None = None,
                router_ttft_ms: float | None = None) -> dict[str, Any]:
    """One concurrency's row of a layout's JSON: throughput, latencies, acceptance, phases and speculation ahead."""
    s = summarize(run, f"c={c}")
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed at concurrency {c}: {s['per_request']['errors'][0]}")
    spec = s.get("spec_decode") or {}
    return {"concurrency": c, "output_tok_s": s["output_throughput"], "median_tpot_ms": s["median_tpot_ms"],
            "median_ttft_ms": s["median_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"], "mean_ttft_ms": s["mean_ttft_ms"],
            "router_ttft_mean_ms": router_ttft_ms, "median_itl_ms": s["median_itl_ms"],
            "duration_s": s["duration_s"], "completed": s["completed"],
            "acceptance_length": spec.get("acceptance_length"), "phases_ms": phases, "ahead": ahead}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One concurrency's row from repeats of its run on the same engine: the repeat whose TPOT is the median (the
    lower one of an even count), so every field of the row comes from one real run, with each repeat's tokens/s,
    TPOT and TTFT kept under `repeats` for the spread."""
    if not runs:
        raise ValueError("median_run needs at least one run")
    ranked = sorted(runs, key=lambda r: r["median_tpot_ms"] if r["median_tpot_ms"] is not None else float("inf"))
    row = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        row["repeats"] = [{k: r[k] for k in ("output_tok_s", "median_tpot_ms", "median_ttft_ms")} for r in runs]
    return row


def _tpot_cell(x: dict[str, Any]) -> str:
    """The row's TPOT, with the repeats' range where it has repeats."""
    if not x.get("median_tpot_ms"):
        return "-"
    spread = [r["median_tpot_ms"] for r in x.get("repeats", []) if r["median_tpot_ms"] is not None]
    return f"{x['median_tpot_ms']:.2f}" + (f" ({min(spread):.2f}-{max(spread):.2f})" if len(spread) > 1 else "")


def compare(results: dict[str, Any], layouts: list[Layout], lossless: bool, bonus_agreement: bool = False) -> None:
    """Mark each layout's greedy texts against its reference: `matches`, and the share of equal texts.
    bonus_agreement: a synthetic pair's layouts that may draft ahead are not compared (the setting feeds the draft
    its guess where the target had another bonus token, which changes which drafts synthetic acceptance keeps)."""
    if bonus_agreement and not lossless:
        layouts = [lay for lay in layouts if not (lay.draft_tp and lay.speculation_ahead is not False)]
    refs: dict[bool, str] = {}
    for lay in layouts:
        r = results.get(lay.name) or {}
        if lay.is_reference and "check" in r and lay.reference_key(lossless) not in refs:
            refs[lay.reference_key(lossless)] = lay.name
    for lay in layouts:
        r = results.get(lay.name) or {}
        ref = refs.get(lay.reference_key(lossless))
        if "check" not in r or ref is None:
            continue
        mine, theirs = r["check"], results[ref]["check"]
        r["check_reference"] = ref
        r["check_equal"] = sum(a == b for a, b in zip(mine, theirs))
        r["check_total"] = len(theirs)
        r["matches"] = mine == theirs


def table(results: dict[str, Any], layouts: list[Layout], args: argparse.Namespace) -> str:
    """The markdown tables of a run: per layout, throughput, TPOT, router cost, speculation ahead and phases;
    then time to first token, inter-token latency and duration."""
    per_c = " | ".join(f"c={c} tok/s | c={c} TPOT ms | c={c} router ms/step | c={c} ahead hit rate"
                       for c in args.concurrency)
    lines = [f"| layout | GPUs | greedy equal to | {per_c} | phases at c={args.concurrency[0]} (ms/step) |",
             "|---|---|---|" + "---|---|---|---|" * len(args.concurrency) + "---|"]
    for lay in layouts:
        r = results.get(lay.name) or {}
        if "error" in r:
            lines.append(f"| {lay.name} | {lay.num_gpus} | failed: {r['error'][:80]} |")
            continue
        eq = (f"{r['check_reference']}: {r['check_equal']}/{r['check_total']}" if "check_reference" in r else "-")
        cells = [lay.name, str(lay.num_gpus), eq]
        runs = {x["concurrency"]: x for x in r.get("runs", [])}
        for c in args.concurrency:
            x = runs.get(c)
            router = (x or {}).get("phases_ms", {}).get("router")
            ahead = (x or {}).get("ahead")
            cells += [f"{x['output_tok_s']:.1f}" if x else "-",
                      _tpot_cell(x) if x else "-",
                      f"{router:.2f}" if router is not None else "-",
                      _ahead_cell(ahead) if ahead else "-"]
        ph = (runs.get(args.concurrency[0]) or {}).get("phases_ms", {})
        cells.append(", ".join(f"{p} {ph[p]:.2f}" for p in PHASES if p in ph) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    # Where tokens/s and TPOT disagree, the time to first token (which tokens/s includes) says why.
    # The TTFT means: the client's, and (served) the router's own, from arrival at the router: their difference is
    # what the HTTP path (proxy, ingress, handle hops, streaming back) adds.
    lines += ["", "| layout | " + " | ".join(f"c={c} TTFT median / p99 ms | c={c} TTFT mean: client / router ms | "
                                             f"c={c} ITL median ms | c={c} duration s"
                                             for c in args.concurrency) + " |",
              "|---|" + "---|---|---|---|" * len(args.concurrency)]
    for lay in layouts:
        runs = {x["concurrency"]: x for x in (results.get(lay.name) or {}).get("runs", [])}
        cells = [lay.name]
        for c in args.concurrency:
            x = runs.get(c) or {}
            router_ttft = x.get("router_ttft_mean_ms")
            cells += [f"{x['median_ttft_ms']:.1f} / {x['p99_ttft_ms']:.1f}" if x.get("median_ttft_ms") else "-",
                      (f"{x['mean_ttft_ms']:.1f} / " + (f"{router_ttft:.1f}" if router_ttft is not None else "-"))
                      if x.get("mean_ttft_ms") else "-",
                      f"{x['median_itl_ms']:.2f}" if x.get("median_itl_ms") else "-",
                      f"{x['duration_s']:.2f}" if x.get("duration_s") else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
