"""The benchmark client's workload run against an EngineCore in this process: no Ray, no HTTP.

For machines where the serving stack cannot be installed, and to see the engine's own numbers without the
router's and the proxy's overhead. Requests arrive as `specserve bench` sends them (all at once, at most
`max_concurrency` in flight; a finished request's slot goes to the next one before the next step), and are
timed by the same definitions: TTFT from being added to the step that produced its first token, one ITL sample
per step that gave it tokens, E2E to the step that finished it. The result is the bench's RunResult, so
deploy/bench/report.py summarizes it like a served run.
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from deploy.bench.client import RequestResult
from deploy.bench.datasets import BenchRequest
from deploy.bench.runner import BenchConfig, RunResult
from engine.request import Request, RequestStatus, SamplingParams


@contextmanager
def offline_llm(serve_fields: dict[str, Any]) -> Iterator[Any]:
    """engine.LLM built from `specserve serve` config fields (unknown keys ignored), as the served app would
    build its engine; its GPU memory is given back on exit, so the next engine of a sweep has the whole GPU."""
    import torch

    from deploy.config import ServeConfig
    from engine import LLM

    known = set(ServeConfig.field_names())
    llm = LLM(**ServeConfig.from_dict({k: v for k, v in serve_fields.items() if k in known}).engine_args())
    try:
        yield llm
    finally:
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


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
    """Run `requests` through `engine` (an EngineCore) at cfg.max_concurrency; request rate must be inf.
    phase_totals: filled with [seconds, steps] per step phase of the measured run (not the warm-up), as a
    server's `specserve_step_duration_seconds{phase}` sum and count would hold them. tag: the request ids' prefix
    (a repeat of the same requests takes another, so no id meets one a queued step may still hold)."""
    if not math.isinf(cfg.request_rate):
        raise ValueError("the in-process driver sends requests as fast as slots free up (request rate inf)")
    encoded = [(prompt_ids(r, tokenizer, cfg.chat), r.output_len) for r in requests]
    if warmup:
        _drive(engine, [encoded[i % len(encoded)] for i in range(warmup)], cfg, "warmup")
    t0 = time.perf_counter()
    results = _drive(engine, encoded, cfg, tag, phase_totals)
    return RunResult(cfg, results, time.perf_counter() - t0, None, None)


def _drive(engine: Any, encoded: list[tuple[list[int], int]], cfg: BenchConfig, tag: str,
           phase_totals: dict[str, list[float]] | None = None) -> list[RequestResult]:
    limit = cfg.max_concurrency or len(encoded)
    pending = deque(enumerate(encoded))
    live: dict[str, tuple[Request, RequestResult, int]] = {}  # id -> (request, result, output tokens seen)
    results: list[RequestResult | None] = [None] * len(encoded)
    while pending or live:
        while pending and len(live) < limit:
            i, (ids, max_tokens) = pending.popleft()
            params = SamplingParams(max_tokens=max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                    ignore_eos=cfg.ignore_eos, seed=cfg.seed + i if cfg.temperature > 0 else None)
            req = Request(f"{tag}-{i}", ids, params)
            res = RequestResult(prompt_len=len(ids), start=time.perf_counter())
            engine.add_request(req)
            live[req.request_id] = (req, res, 0)
            results[i] = res
        engine.step()
        now = time.perf_counter()
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
    return [r for r in results if r is not None]
