"""One request's stream as the router publishes it, and the refusals a request can get before it is queued.

Only the router's process uses these: serving/router/router.py imports them inside its methods, so the Serve
controller, which creates the router actor, never needs this module.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

# Seconds a refused client is told to wait (HTTP Retry-After) before it tries again.
RETRY_AFTER_S = 1
# The served default of `stream_interval_ms` (after a stream's first delta, at most one delta per this many ms; the
# last at once). Each delta is a streamed item through the handle and an SSE chunk through the ingress and the proxy,
# whatever it carries. On one H100 under load (benchmarks/RESULTS.md, "Coalescing a stream's deltas on a GPU"),
# 20 ms halved the client-router TTFT gap at c=16 and c=64, through Serve's proxy and with direct streaming, and
# raised tokens/s 0-4%, for an ITL p99 about the interval. Ray Serve LLM's own default is 50 ms.
STREAM_INTERVAL_MS = 20.0


class Rejected(Exception):
    """A request refused before it was queued: 429 (queue full) or 503 (draining, engine down)."""

    def __init__(self, message: str, status: int, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass
class StepDelta:
    """What one step left a request, copied on the step thread before the next step can change it."""

    new_token_ids: list[int]
    text: str
    spec: tuple[int, int, int, list[int]]  # drafts, draft tokens, accepted tokens, accepted per position (totals)
    finish_reason: str | None  # set when the request finished in this step
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens the prefix cache supplied (0 until the request is admitted)
    logprobs: list[Any] | None = None  # per new token (logprob, top tokens), when the request asked for them
    # With prompt logprobs asked for, on the delta of the first output token (the prompt is all computed by then):
    # per prompt token from the second on, (logprob, rank, top tokens).
    prompt_logprobs: list[Any] | None = None


@dataclass
class RequestStream:
    """One request's published state: what the last step left, and what the caller has already seen."""

    request: Any  # engine.request.Request (read only between steps: the step thread writes it)
    arrival: float
    holdback: int  # chars of text withheld while running: a stop string may still cut them off
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[Any] = field(default_factory=list)  # one per pending token, when asked for
    pending_prompt_logprobs: list[Any] | None = None  # the prompt's, until a delta carries them
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: tuple[str, int] | None = None  # (message, HTTP-like status)
    spec: dict[str, Any] = field(default_factory=lambda: {"num_drafts": 0, "num_draft_tokens": 0,
                                                          "num_accepted_tokens": 0, "accepted_per_position": []})
    num_snapshotted: int = 0  # output tokens already copied into a StepDelta (the step thread's counter)
    num_published: int = 0  # output tokens already moved to pending_tokens
    sent_text: int = 0  # chars of text already yielded
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_cached_tokens: int = 0
    ended: bool = False  # its last delta or its error went out (else its consumer left early)

    def snapshot(self, req: Any) -> StepDelta:
        """Copy what a step gave `req` (an engine Request). Runs on the step thread, between two steps."""
        start = self.num_snapshotted
        new = req.output_token_ids[start:]
        self.num_snapshotted += len(new)
        sp = req.spec
        finish = (req.finish_reason or req.status.value) if req.status.finished else None
        logprobs = req.output_logprobs[start:start + len(new)] if req.params.logprobs is not None else None
        prompt_logprobs = list(req.prompt_logprobs) if req.params.prompt_logprobs is not None and new and \
            start == 0 else None
        return StepDelta(list(new), req.output_text, (sp.num_drafts, sp.num_draft_tokens, sp.num_accepted_tokens,
                                                      list(sp.accepted_per_position)),
                         finish, req.stop_reason, req.num_prompt_tokens, req.num_cached_tokens or 0, logprobs,
                         prompt_logprobs)

    def publish(self, delta: StepDelta, now: float, metrics: Any) -> None:
        """Take a step's delta: new tokens, text, speculation counts, the finish; count them in `metrics`
        (serving.metrics.EngineMetrics) and wake the caller. Runs on the event loop."""
        new = delta.new_token_ids
        self.num_published += len(new)
        self.pending_tokens.extend(new)
        if delta.logprobs is not None:
            self.pending_logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.pending_prompt_logprobs = delta.prompt_logprobs
        self.text = delta.text
        self.num_cached_tokens = delta.num_cached_tokens
        if new:
            if self.first_token_time is None:
                self.first_token_time = now
                metrics.on_first_token(delta.num_prompt_tokens, now - self.arrival)
                metrics.on_tokens(len(new), None)
            else:
                metrics.on_tokens(len(new), now - (self.last_token_time or now))
            self.last_token_time = now
        metrics.on_spec(*self._spec_increment(delta.spec))
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            metrics.on_finished(self.finish_reason, now - self.arrival)
        self.event.set()

    def _spec_increment(self, spec: tuple[int, int, int, list[int]]) -> tuple[int, int, int, list[int]]:
        """(drafts, draft tokens, accepted tokens, accepted per position) since the last publish."""
        old = self.spec
        drafts, draft_tokens, accepted, per_pos = spec
        old_pos = old["accepted_per_position"] + [0] * (len(per_pos) - len(old["accepted_per_position"]))
        inc = (drafts - old["num_drafts"], draft_tokens - old["num_draft_tokens"],
               accepted - old["num_accepted_tokens"], [a - b for a, b in zip(per_pos, old_pos)])
        self.spec = {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
                     "accepted_per_position": per_pos}
        return inc

    async def deltas(self, interval_s: float) -> AsyncIterator[dict[str, Any]]:
        """What the caller is sent, as the steps publish it: deltas up to the finished one, or an error (a dict of
        `error` and `status`). interval_s > 0 (stream_interval_ms): a delta that is neither the first, the last
        nor an error waits until `interval_s` after the one before, the steps meanwhile adding to it, and a timer
        wakes the stream then: each delta costs the same through the handle, the ingress and the proxy whatever
        it carries."""
        loop = asyncio.get_running_loop()
        next_send, timer = 0.0, None
        try:
            while True:
                await self.event.wait()
                self.event.clear()
                if self.error is not None:
                    self.ended = True
                    yield {"error": self.error[0], "status": self.error[1]}
                    return
                if self.finish_reason is None and loop.time() < next_send:
                    if timer is None:
                        timer = loop.call_at(next_send, self.event.set)
                    continue
                if timer is not None:
                    timer.cancel()
                    timer = None
                delta = self.take_delta()
                self.ended = delta["finish_reason"] is not None
                if delta["token_ids"] or delta["text"] or self.ended:
                    yield delta
                    next_send = loop.time() + interval_s
                if self.ended:
                    return
        finally:
            if timer is not None:
                timer.cancel()

    def take_delta(self) -> dict[str, Any]:
        done = self.finish_reason is not None
        end = len(self.text) if done else max(self.sent_text, len(self.text) - self.holdback)
        text = self.text[self.sent_text:end]
        self.sent_text = max(self.sent_text, end)
        tokens, self.pending_tokens = self.pending_tokens, []
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        prompt_logprobs, self.pending_prompt_logprobs = self.pending_prompt_logprobs, None
        return {"request_id": self.request.request_id, "token_ids": tokens, "text": text,
                "logprobs": logprobs if self.request.params.logprobs is not None else None,
                "prompt_logprobs": prompt_logprobs,
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
                "num_prompt_tokens": self.request.num_prompt_tokens, "num_completion_tokens": self.num_published,
                "num_cached_tokens": self.num_cached_tokens,
                "spec": dict(self.spec, accepted_per_position=list(self.spec["accepted_per_position"]))}
