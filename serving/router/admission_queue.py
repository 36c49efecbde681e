"""Requests accepted by the router but not yet in the engine: the step thread takes them all before each step.

Why a queue instead of adding under the engine lock: an arrival that must hold the engine stops the step thread at
the end of its step, hands the lock to the event loop, adds one request, and starts a new step thread. Under load a
wave of arrivals spread over a few milliseconds was admitted over several step boundaries, each its own prefill, and
paid a thread hop each. Here the event loop validates and queues a request without touching the engine's state,
and the step thread admits everything that arrived during its last step in one go, so the wave is one prefill.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any


class AdmissionQueue:
    """Thread-safe FIFO of (engine request, its stream). Put on the event loop, taken on the step thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: deque[tuple[Any, Any]] = deque()
        self._ids: set[str] = set()

    def put(self, request: Any, stream: Any) -> None:
        with self._lock:
            self._items.append((request, stream))
            self._ids.add(request.request_id)

    def take_all(self) -> list[tuple[Any, Any]]:
        """Everything queued, oldest first; the queue is empty afterwards."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._ids.clear()
        return items

    def remove(self, request_id: str) -> tuple[Any, Any] | None:
        """Take one request out before it reaches the engine (an abort); None if it is not queued."""
        with self._lock:
            if request_id not in self._ids:
                return None
            self._ids.discard(request_id)
            for i, item in enumerate(self._items):
                if item[0].request_id == request_id:
                    del self._items[i]
                    return item
        return None

    def holds(self, request_id: str) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._items)
