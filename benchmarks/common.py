"""Helpers shared by the benchmark scripts: timing with warm-up and medians, environment facts."""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def median_seconds(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def save_random_model(cfg: object, out: Path, seed: int = 0) -> str:
    """A checkpoint of random weights for the transformers config `cfg`, drawn after torch.manual_seed(seed) and
    saved at `out`; its path."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return str(out)


def environment() -> dict:
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86_64'})"
    return {"date": datetime.date.today().isoformat(), "device": dev, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version()}


def save_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return "" if v is None else str(v)


def graph_us(fn: Callable[[int], object], calls: int, replays: int = 30) -> float:
    """Median GPU time of one fn() call, from CUDA-graph replays of `calls` calls."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return replay_us(graph, replays) / calls


def replay_us(graph: torch.cuda.CUDAGraph, replays: int = 30, warmup: int = 3) -> float:
    """Median microseconds of one replay of a captured graph (CUDA events), after `warmup` replays."""
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def prefix_token_map(num_ids: int | None) -> str | None:
    """A draft token map (EngineConfig.draft_token_map) of the first num_ids token ids, in a temporary file; None
    for None. Random weights have no hot tokens, so any num_ids ids cost the same: a prefix is the simplest."""
    if num_ids is None:
        return None
    import tempfile

    f = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="draft-map-", delete=False)
    with f:
        json.dump(list(range(num_ids)), f)
    return f.name
