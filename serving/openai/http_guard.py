"""The HTTP front door, before any route runs: the API key and the request body's size.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would buffer streamed responses and hide
the client's disconnect from them). It reads the whole body first, up to the limit, so a body over the limit
is refused with 413 whether or not it declared a Content-Length, and memory per request stays bounded; the
body is then replayed to the app, and later `receive` calls (the disconnect a streaming response waits for)
go to the server as before.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from serving.openai.responses import error_body, error_type

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers, open unless asked otherwise


class RequestGuard:
    """api_key: required as `Authorization: Bearer KEY` on every path but `open_paths` (None: no key).
    max_body_bytes: larger request bodies get 413 (None: no limit)."""

    def __init__(self, app: ASGIApp, api_key: str | None = None, max_body_bytes: int | None = None,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        if api_key is not None and not api_key.strip():
            raise ValueError("api_key must not be empty: give a key, or none to serve without one")
        if max_body_bytes is not None and max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1 (or None: no limit), got {max_body_bytes}")
        self.app = app
        self._key = api_key.encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._key is not None and scope.get("path") not in self.open_paths and not self._authorized(scope):
            await _reply(send, 401, "Incorrect or missing API key: send it as the header "
                                    "'Authorization: Bearer YOUR_KEY'", "invalid_api_key",
                         [(b"www-authenticate", b"Bearer")])
            return
        if self.max_body_bytes is None:
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _reply(send, 400, f"invalid Content-Length header {declared[:32]!r}", None)
                return
            if int(declared) > self.max_body_bytes:
                await _reply(send, 413, self._too_large(int(declared)), "request_too_large")
                return
        body, more, size = [], True, 0
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _reply(send, 413, self._too_large(size, at_least=True), "request_too_large")
                return
            body.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        # Constant time: how much of a guess matches must not show in the response time.
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self._key or b"")

    def _too_large(self, size: int, at_least: bool = False) -> str:
        return (f"the request body has {'more than ' if at_least else ''}{size} bytes, over this server's limit "
                f"of {self.max_body_bytes} bytes (max_request_body_bytes); send a shorter prompt")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _reply(send: Send, status: int, message: str, code: str | None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(error_body(message, error_type(status), None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})
