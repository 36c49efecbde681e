"""Send a benchmark's requests: arrivals at a Poisson (or gamma, with burstiness) rate or all at once, at most
`max_concurrency` in flight, optionally no new request after `max_duration_s`, a progress bar; and the server's
Prometheus counters before and after, for speculation statistics of servers whose responses do not carry them.

The arrival schedule (`arrival_times`) is the one place arrivals are drawn: benchmarks/engine_driver.py feeds the
in-process engine the same schedule, so a served run and an in-process run of one seed see the same load."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from deploy.bench.client import RequestResult, request_body, send_request
from deploy.bench.datasets import BenchRequest

logger = logging.getLogger("specserve")

CHAT_ENDPOINT = "/v1/chat/completions"


@dataclass
class BenchConfig:
    base_url: str  # http://host:port
    model: str
    endpoint: str = "/v1/completions"  # or /v1/chat/completions
    request_rate: float = math.inf  # requests per second; inf: all at once
    burstiness: float = 1.0  # gamma shape of the inter-arrival times; 1 = Poisson
    max_concurrency: int | None = None  # requests in flight at most; None: no cap
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int = 0
    timeout_s: float = 600.0
    progress: bool = True
    # No request is sent (arrives, or takes a concurrency slot) later than this many seconds into the run: the
    # ones left are not sent and not counted. None: every request is sent.
    max_duration_s: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    def validate(self) -> None:
        if not (self.request_rate > 0):
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if self.burstiness <= 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_duration_s is not None and not self.max_duration_s > 0:
            raise ValueError(f"--max-duration must be > 0, got {self.max_duration_s}")


@dataclass
class RunResult:
    config: BenchConfig
    results: list[RequestResult]
    duration_s: float
    metrics_before: dict[str, float] | None  # Prometheus samples ("name{labels}" -> value), None: no /metrics
    metrics_after: dict[str, float] | None
    # Engine steps of the run that speculated and that did not, where the driver counted them itself (in
    # process); None: from the server's metrics, if it has them (report.speculation_steps).
    step_counts: tuple[int, int] | None = None


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the run's start at which each of `num` requests arrives: the first at 0, then gaps drawn from
    a gamma distribution of mean 1 / rate and shape `burstiness` (exponential gaps, i.e. a Poisson process, at
    burstiness 1); all at 0 for an infinite rate. The same seed gives the same schedule, served or in process."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(num):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


async def _arrivals(requests: list[BenchRequest], rate: float, burstiness: float, seed: int,
                    deadline: float | None = None) -> AsyncIterator[tuple[int, BenchRequest]]:
    """Yield (index, request) at `arrival_times` from now, against the clock (a late wake-up is not carried into
    the next gap); none that would arrive after `deadline` (a perf_counter() time)."""
    t0 = time.perf_counter()
    for i, (req, at) in enumerate(zip(requests, arrival_times(len(requests), rate, burstiness, seed), strict=True)):
        if deadline is not None and t0 + at > deadline:
            return
        wait = t0 + at - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        yield i, req


async def fetch_metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """The server's /metrics as {"name{labels}": value}; None when it has none."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", timeout=30.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_prometheus(resp.text)


# Labels naming the replica a series came from: an engine replica, and with a draft pool its draft replica.
_REPLICA_LABELS = ("replica", "draft_replica")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _without_replica_labels(key: str) -> str | None:
    """`name{labels}` without its replica labels; None where it has none."""
    name, brace, labels = key.partition("{")
    if not brace:
        return None
    pairs = _LABEL.findall(labels.rstrip("}"))
    kept = [(k, v) for k, v in pairs if k not in _REPLICA_LABELS]
    if len(kept) == len(pairs):
        return None
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in kept) + "}" if kept else "")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {"name{labels}": value} (labels as written by the server). A server of several
    engine replicas (specserve's /metrics labels each series with its `replica`, and with a draft pool its
    `draft_replica`) also gets each series summed over its replicas, under the name without those labels, so
    totals read the same from one engine or many."""
    out: dict[str, float] = {}
    summed: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        key = key.strip()
        out[key] = v
        bare = _without_replica_labels(key)
        if bare is not None:
            summed[bare] = summed.get(bare, 0.0) + v
    for key, v in summed.items():
        out.setdefault(key, v)
    return out


async def fetch_model_name(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model the server lists at /v1/models."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        try:
            resp = await client.get(base_url.rstrip("/") + "/v1/models")
            resp.raise_for_status()
            return resp.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise ValueError(f"could not read the served model from {base_url}/v1/models ({e}); is the server up? "
                             "Give --model to skip this") from None


async def run_benchmark(requests: list[BenchRequest], cfg: BenchConfig, warmup: int = 0) -> RunResult:
    """Send `requests` as `cfg` says and wait for all of them. `warmup` requests (the first ones of the list,
    at the same concurrency) run before and are not counted: first-request costs (compilation, graph capture,
    cold caches) stay out of the figures."""
    cfg.validate()
    url = cfg.base_url.rstrip("/") + cfg.endpoint
    limit = cfg.max_concurrency
    # One connection per request in flight: a shared pool would queue streams behind each other.
    limits = httpx.Limits(max_connections=limit or None, max_keepalive_connections=limit or None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0), limits=limits) as client:
        semaphore = asyncio.Semaphore(limit) if limit else None

        def body(i: int, req: BenchRequest) -> dict[str, Any]:
            # Per-request seeds make sampled runs repeatable; greedy requests need none.
            seed = cfg.seed + i if cfg.temperature > 0 else None
            return request_body(cfg.model, req.prompt, req.output_len, cfg.chat, cfg.temperature, cfg.top_p,
                                cfg.ignore_eos, seed, cfg.extra_body)

        deadline: float | None = None

        async def one(i: int, req: BenchRequest, bar: Any) -> RequestResult | None:
            if semaphore is None:
                res = await send_request(client, url, body(i, req), cfg.chat, req.prompt_len)
            else:
                async with semaphore:
                    # A request that gets its slot after the deadline is not sent: at a concurrency cap the
                    # run ends as the slots drain, with every later request left out.
                    if deadline is not None and time.perf_counter() > deadline:
                        return None
                    res = await send_request(client, url, body(i, req), cfg.chat, req.prompt_len)
            if bar is not None:
                bar.update(1)
            return res

        if warmup:
            warm = [requests[i % len(requests)] for i in range(warmup)]
            done = await asyncio.gather(*(one(i, r, None) for i, r in enumerate(warm)))
            failed = [r.error for r in done if r is not None and not r.success]
            if failed:
                raise RuntimeError(f"{len(failed)} of {warmup} warm-up requests failed; first error: {failed[0]}")
        before = await fetch_metrics(client, cfg.base_url)
        bar = _progress_bar(len(requests), cfg.progress)
        tasks = []
        t0 = time.perf_counter()
        if cfg.max_duration_s is not None:
            deadline = t0 + cfg.max_duration_s
        async for i, req in _arrivals(requests, cfg.request_rate, cfg.burstiness, cfg.seed, deadline):
            tasks.append(asyncio.create_task(one(i, req, bar)))
        results = [r for r in await asyncio.gather(*tasks) if r is not None]
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        after = await fetch_metrics(client, cfg.base_url)
    return RunResult(cfg, results, duration, before, after)


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True)
