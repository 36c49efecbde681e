"""One streamed request to an OpenAI-compatible server, timed: time to first token, the gap before every later
streamed chunk (inter-token latency), end-to-end latency, token counts from `usage`, and specserve's per-response
`spec_decode` statistics when the server sends them.

A chunk may carry several tokens (speculation commits a run of accepted tokens at once); as in vLLM's benchmark,
ITL is measured per chunk and TPOT per token: (latency - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # usage.prompt_tokens (else the dataset's count)
    output_len: int = 0  # usage.completion_tokens (else the number of content chunks)
    ttft: float = 0.0  # seconds from sending to the first content chunk
    itl: list[float] = field(default_factory=list)  # seconds between consecutive content chunks
    latency: float = 0.0  # seconds from sending to the end of the stream
    start: float = 0.0  # perf_counter() when sent
    spec: dict[str, Any] | None = None  # the response's `spec_decode` object (specserve)
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for single-token outputs."""
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def request_body(model: str, prompt: str | list[int], max_tokens: int, chat: bool, temperature: float,
                 top_p: float, ignore_eos: bool, seed: int | None, extra: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                            "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        if not isinstance(prompt, str):
            raise ValueError("chat requests need text prompts")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's and specserve's extension
    if seed is not None:
        body["seed"] = seed
    body.update(extra or {})
    return body


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], chat: bool,
                       prompt_len: int | None = None) -> RequestResult:
    """POST `body` (with stream: true) and read the server-sent events to the end; never raises for a failed
    request (the result says why)."""
    out = RequestResult(prompt_len=prompt_len or 0)
    num_chunks = 0
    start = out.start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {_error_message(detail)}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = _error_message(json.dumps(chunk))
                    return out
                now = time.perf_counter()
                if chunk.get("choices"):
                    choice = chunk["choices"][0]
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if num_chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    num_chunks += 1
                    out.text += piece or ""
                if chunk.get("usage"):
                    out.prompt_len = chunk["usage"].get("prompt_tokens") or out.prompt_len
                    out.output_len = chunk["usage"].get("completion_tokens") or 0
                if chunk.get("spec_decode"):
                    out.spec = chunk["spec_decode"]
        out.latency = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    if num_chunks == 0:
        out.error = "the stream ended without any output"
        return out
    if not out.output_len:  # a server without usage in streams: count chunks (a lower bound with speculation)
        out.output_len = num_chunks
    out.success = True
    return out


def _error_message(body: str) -> str:
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict):
            return str(err.get("message"))
        return str(err or body)
    except (json.JSONDecodeError, AttributeError):
        return body[:500]
