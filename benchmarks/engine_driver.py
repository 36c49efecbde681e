"""The benchmark client's workload run against an EngineCore in this process: no Ray, no HTTP.

For machines where the serving stack cannot be installed, and to see the engine's own numbers without the
router's and the proxy's overhead. Requests arrive as `specserve bench` sends them: at the bench's arrival times
(deploy/bench/runner.arrival_times, the same schedule for the same seed: all at once at an infinite rate), at most
`max_concurrency` in flight, none sent after `max_duration_s`. An arrival waits for the step in flight to end
(the engine takes requests between steps, as the router does), and its clock starts when it arrived, or when a
slot freed for it: the client's semaphore, where a finished request's slot goes to the next one. Timed by the
bench's definitions: TTFT from that start to the step that produced its first token, one ITL sample per step that
gave it tokens, E2E to the step that finished it. The result is the bench's RunResult (with the steps that
speculated and that did not), so deploy/bench/report.py summarizes it like a served run.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from deploy.bench.client import RequestResult
from deploy.bench.datasets import BenchRequest
from deploy.bench.runner import BenchConfig, RunResult, arrival_times
from engine.request import Request, RequestStatus, SamplingParams


def release_gpu_cache() -> None:
    """Give the GPU memory of engines this process no longer references back to the device.

    offline_llm cannot do it alone: the caller's `as llm` name keeps the engine alive until the caller returns, and
    an engine's reference cycles wait for the collector, after which PyTorch's allocator still holds the memory.
    A served layout after an in-process one then found 55 GB of an 80 GB GPU taken by the driver and ran out of
    memory at c=64. So whatever starts an engine calls this first."""
    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@contextmanager
def offline_llm(serve_fields: dict[str, Any]) -> Iterator[Any]:
    """engine.LLM built from `specserve serve` config fields (unknown keys ignored), as the served app would
    build its engine; the memory of engines before it is given back first (release_gpu_cache)."""
    from deploy.config import ServeConfig
    from engine import LLM

    release_gpu_cache()
    known = set(ServeConfig.field_names())
    llm = LLM(**ServeConfig.from_dict({k: v for k, v in serve_fields.items() if k in known}).engine_args())
    try:
        yield llm
    finally:
        del llm
        release_gpu_cache()


def prompt_ids(req: BenchRequest, tokenizer: Any, chat: bool) -> list[int]:
    """Token ids of a bench request: as given, or tokenized (through the chat template for chat endpoints)."""
    if isinstance(req.prompt, list):
        return list(req.prompt)
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": req.prompt}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])
    return list(tokenizer(req.prompt)["input_ids"])


def run_in_process(engine: Any, requests: list[BenchRequest], cfg: BenchConfig, tokenizer: Any,
                   warmup: int = 0, phase_totals: dict[str, list[float]] | None = None,
                   tag: str = "bench") -> RunResult:
    """Run `requests` through `engine` (an EngineCore) as cfg says (arrivals, concurrency cap, duration).
    phase_totals: filled with [seconds, steps] per step phase of the measured run (not the warm-up), as a
    server's `specserve_step_duration_seconds{phase}` sum and count would hold them. tag: the request ids' prefix
    (a repeat of the same requests takes another, so no id meets one a queued step may still hold). The warm-up
    sends its requests all at once, at the same concurrency."""
    encoded = [(prompt_ids(r, tokenizer, cfg.chat), r.output_len) for r in requests]
    if warmup:
        _drive(engine, [encoded[i % len(encoded)] for i in range(warmup)], cfg, [0.0] * warmup, None, "warmup")
    arrivals = arrival_times(len(encoded), cfg.request_rate, cfg.burstiness, cfg.seed)
    steps = [0, 0]
    t0 = time.perf_counter()
    results = _drive(engine, encoded, cfg, arrivals, cfg.max_duration_s, tag, phase_totals, steps)
    return RunResult(cfg, results, time.perf_counter() - t0, None, None, step_counts=(steps[0], steps[1]))


def _drive(engine: Any, encoded: list[tuple[list[int], int]], cfg: BenchConfig, arrivals: list[float],
           max_duration_s: float | None, tag: str, phase_totals: dict[str, list[float]] | None = None,
           steps: list[int] | None = None) -> list[RequestResult]:
    """steps: [speculating, not] engine steps, counted here."""
    limit = cfg.max_concurrency or len(encoded)
    t0 = time.perf_counter()
    pending = deque((i, t0 + at, item) for i, (item, at) in enumerate(zip(encoded, arrivals, strict=True)))
    free_since = deque([t0] * limit)  # when each free concurrency slot freed, oldest first
    live: dict[str, tuple[Request, RequestResult, int]] = {}  # id -> (request, result, output tokens seen)
    results: list[RequestResult | None] = [None] * len(encoded)
    deadline = None if max_duration_s is None else t0 + max_duration_s
    while pending or live:
        now = time.perf_counter()
        while pending and free_since and pending[0][1] <= now:
            i, arrived, (ids, max_tokens) = pending.popleft()
            start = max(arrived, free_since.popleft())
            if deadline is not None and start > deadline:  # as the client: no request sent past the deadline
                pending.clear()
                break
            params = SamplingParams(max_tokens=max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                    ignore_eos=cfg.ignore_eos, seed=cfg.seed + i if cfg.temperature > 0 else None)
            req = Request(f"{tag}-{i}", ids, params)
            res = RequestResult(prompt_len=len(ids), start=start)
            engine.add_request(req)
            live[req.request_id] = (req, res, 0)
            results[i] = res
        if not live:
            if pending and deadline is not None and pending[0][1] > deadline:
                pending.clear()
            elif pending:  # idle until the next arrival
                time.sleep(max(0.0, pending[0][1] - time.perf_counter()))
            continue
        engine.step()
        now = time.perf_counter()
        if steps is not None:
            steps[0 if engine.last_step.draft_length else 1] += 1
        if phase_totals is not None:
            for phase, seconds in engine.last_step.phase_seconds.items():
                total = phase_totals.setdefault(phase, [0.0, 0.0])
                total[0] += seconds
                total[1] += 1
        for rid, (req, res, seen) in list(live.items()):
            n = req.num_output_tokens
            if n > seen:
                if seen == 0:
                    res.ttft = now - res.start
                else:
                    res.itl.append(now - res.start - res.latency)
                res.latency = now - res.start
                live[rid] = (req, res, n)
            if req.status.finished:
                res.output_len = n
                res.latency = now - res.start
                res.success = req.status != RequestStatus.FINISHED_ABORTED and n > 0
                res.error = "" if res.success else "aborted"
                s = req.spec
                res.spec = {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                            "num_accepted_tokens": s.num_accepted_tokens,
                            "accepted_per_position": list(s.accepted_per_position)} if engine.spec_config else None
                del live[rid]
                free_since.append(now)
    return [r for r in results if r is not None]
