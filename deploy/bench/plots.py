"""PNG figures of benchmark summaries (matplotlib, Agg backend: no display needed).

Every PNG also carries the values it plots as JSON in a text chunk named "specserve" (PIL:
`Image.open(path).text["specserve"]`), so a figure can be checked against, or re-plotted from, its numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METADATA_KEY = "specserve"


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'specserve[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path, values: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={METADATA_KEY: json.dumps(values)})
    _plt().close(fig)
    return path


def latency_distributions(summary: dict[str, Any], path: str | Path) -> Path:
    """Histograms of TTFT, TPOT, ITL and E2E latency (ms), with their mean/median/p99 marked."""
    plt = _plt()
    pr = summary["per_request"]
    series = {"ttft": pr["ttfts_ms"], "tpot": pr["tpots_ms"], "itl": pr["itls_ms"], "e2el": pr["e2els_ms"]}
    titles = {"ttft": "Time to first token", "tpot": "Time per output token", "itl": "Inter-token latency",
              "e2el": "End-to-end latency"}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    values: dict[str, Any] = {"label": summary.get("label"), "max_concurrency": summary.get("max_concurrency")}
    for ax, (name, data) in zip(axes.flat, series.items()):
        stats = {s: summary[f"{s}_{name}_ms"] for s in ("mean", "median", "p99")}
        values[name] = {"count": len(data), **stats}
        if data:
            ax.hist(data, bins=min(50, max(5, len(data) // 2)), color="#4C72B0", alpha=0.8)
            for s, style in (("mean", "-"), ("median", "--"), ("p99", ":")):
                ax.axvline(stats[s], color="black", linestyle=style, label=f"{s} {stats[s]:.1f} ms")
            ax.legend(fontsize=8)
        ax.set_title(titles[name])
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    fig.suptitle(_title(summary, "latency distributions"))
    fig.tight_layout()
    return _save(fig, Path(path), values)


def acceptance_by_position(summary: dict[str, Any], path: str | Path) -> Path | None:
    """Bar chart: fraction of verify steps whose draft was accepted at each position; None without speculation."""
    spec = summary.get("spec_decode")
    if not spec or not spec.get("acceptance_by_position"):
        return None
    plt = _plt()
    rates = spec["acceptance_by_position"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([str(i) for i in range(len(rates))], rates, color="#55A868")
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position (0-based)")
    ax.set_ylabel("accepted / verify steps")
    ax.set_title(_title(summary, f"acceptance rate {spec['acceptance_rate']:.2f}, "
                                 f"length {spec['acceptance_length']:.2f}"))
    fig.tight_layout()
    values = {"label": summary.get("label"), "acceptance_by_position": rates,
              "acceptance_rate": spec["acceptance_rate"], "acceptance_length": spec["acceptance_length"]}
    return _save(fig, Path(path), values)


def throughput_vs_concurrency(series: dict[str, list[dict[str, Any]]], path: str | Path,
                              title: str = "Output throughput against concurrency") -> Path:
    """One line per label: output tokens/s of each run against its max concurrency (log-2 x axis)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    values: dict[str, Any] = {}
    for label, runs in series.items():
        pts = sorted((int(s["max_concurrency"]), float(s["output_throughput"])) for s in runs
                     if s.get("max_concurrency"))
        values[label] = [{"max_concurrency": c, "output_throughput": t} for c, t in pts]
        ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if len(series) > 1 or any(series):
        ax.legend()
    fig.tight_layout()
    return _save(fig, Path(path), values)


def throughput_vs_tpot(series: dict[str, list[dict[str, Any]]], path: str | Path,
                       title: str = "Output throughput against TPOT p99") -> Path:
    """One line per label through its load points (report.load_point rows): output tokens/s against TPOT p99,
    the concurrency points solid and the Poisson-rate points dotted, each in order of load."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    values: dict[str, Any] = {}
    for n, (label, points) in enumerate(series.items()):
        color = f"C{n % 10}"
        values[label] = []
        for kind, style in (("concurrency", "-o"), ("request_rate", ":s")):
            pts = sorted((p for p in points if p.get(kind) and p.get("tpot_p99_ms") is not None
                          and (kind == "concurrency" or not p.get("concurrency"))), key=lambda p: p[kind])
            if not pts:
                continue
            values[label] += [{"load": p["load"], "tpot_p99_ms": p["tpot_p99_ms"],
                               "output_tok_s": p["output_tok_s"]} for p in pts]
            ax.plot([p["tpot_p99_ms"] for p in pts], [p["output_tok_s"] for p in pts], style, color=color,
                    label=label if kind == "concurrency" or not any(q.get("concurrency") for q in points) else None)
    ax.set_xlabel("TPOT p99 (ms)   (o solid: concurrency points, s dotted: Poisson-rate points)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, Path(path), values)


def ttft_vs_load(series: dict[str, list[dict[str, Any]]], path: str | Path) -> Path:
    """TTFT p50 (solid) and p99 (dashed) against the offered load, one colour per label: against the concurrency
    cap, and against the Poisson request rate in a second panel where there are rate points."""
    plt = _plt()
    kinds = [k for k in ("concurrency", "request_rate")
             if any(p.get(k) and (k == "concurrency" or not p.get("concurrency")) for ps in series.values()
                    for p in ps)] or ["concurrency"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.5), squeeze=False)
    values: dict[str, Any] = {}
    for ax, kind in zip(axes[0], kinds):
        for n, (label, points) in enumerate(series.items()):
            pts = sorted((p for p in points if p.get(kind) and p.get("ttft_p50_ms") is not None
                          and (kind == "concurrency" or not p.get("concurrency"))), key=lambda p: p[kind])
            if not pts:
                continue
            values.setdefault(label, {})[kind] = [{kind: p[kind], "ttft_p50_ms": p["ttft_p50_ms"],
                                                   "ttft_p99_ms": p["ttft_p99_ms"]} for p in pts]
            x = [p[kind] for p in pts]
            ax.plot(x, [p["ttft_p50_ms"] for p in pts], "-o", color=f"C{n % 10}", label=f"{label} p50")
            ax.plot(x, [p["ttft_p99_ms"] for p in pts], "--x", color=f"C{n % 10}", label=f"{label} p99")
        if kind == "concurrency":
            ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("max concurrency" if kind == "concurrency" else "Poisson request rate (req/s)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title("TTFT p50 (solid) and p99 (dashed)")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, Path(path), values)


def _title(summary: dict[str, Any], what: str) -> str:
    label = summary.get("label") or summary.get("model") or ""
    c = summary.get("max_concurrency")
    return f"{label}{' ' if label else ''}(concurrency {c or 'unbounded'}): {what}"


def read_plot_values(path: str | Path) -> dict[str, Any]:
    """The values a PNG written here carries."""
    from PIL import Image

    with Image.open(path) as im:
        return json.loads(im.text[METADATA_KEY])
