"""One request's stream as the router publishes it, and the refusals a request can get before it is queued.

Only the router's process uses these: serving/router.py imports them inside its methods, so the Serve
controller, which creates the router actor, never needs this module.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

# Seconds a refused client is told to wait (HTTP Retry-After) before it tries again.
RETRY_AFTER_S = 1


class Rejected(Exception):
    """A request refused before it was queued: 429 (queue full) or 503 (draining, engine down)."""

    def __init__(self, message: str, status: int, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass
class RequestStream:
    """One request's published state: what the last step left, and what the caller has already seen."""

    request: Any  # engine.request.Request (read only under the router's lock)
    arrival: float
    holdback: int  # chars of text withheld while running: a stop string may still cut them off
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending_tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: tuple[str, int] | None = None  # (message, HTTP-like status)
    spec: dict[str, Any] = field(default_factory=lambda: {"num_drafts": 0, "num_draft_tokens": 0,
                                                          "num_accepted_tokens": 0, "accepted_per_position": []})
    num_published: int = 0  # output tokens already moved to pending_tokens
    sent_text: int = 0  # chars of text already yielded
    first_token_time: float | None = None
    last_token_time: float | None = None

    def take_delta(self) -> dict[str, Any]:
        done = self.finish_reason is not None
        end = len(self.text) if done else max(self.sent_text, len(self.text) - self.holdback)
        text = self.text[self.sent_text:end]
        self.sent_text = max(self.sent_text, end)
        tokens, self.pending_tokens = self.pending_tokens, []
        return {"request_id": self.request.request_id, "token_ids": tokens, "text": text,
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
                "num_prompt_tokens": self.request.num_prompt_tokens, "num_completion_tokens": self.num_published,
                "spec": dict(self.spec, accepted_per_position=list(self.spec["accepted_per_position"]))}
