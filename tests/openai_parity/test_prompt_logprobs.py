"""A prompt's logprobs over HTTP, served with the draft speculating: completions' `echo` with `logprobs` (OpenAI's
legacy scoring request, as evaluation harnesses send it), streamed and not, and vLLM's `prompt_logprobs` field on
completions and chat, each against the offline engine's prompt logprobs (which equal HF's: tests/
test_prompt_logprobs.py). Bad values and `stream` with `prompt_logprobs` are 400s naming the field
(test_fields.py, tests/http_api/test_reliability_http.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_support import sse_events

from engine import LLM, SamplingParams
from openai_parity import CHAT, MODEL

PROMPT = "hello, world"


def _offline(llm: LLM, prompt_ids: list[int], k: int) -> list[dict[int, float] | None]:
    out = llm.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k))[0]
    return out.prompt_logprobs


def test_echo_with_logprobs_scores_the_prompt(client: httpx.Client, llm: LLM) -> None:
    req = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": True,
           "return_token_ids": True}
    choice = client.post("/v1/completions", json=req).json()["choices"][0]
    ids = choice["prompt_token_ids"]
    ref = _offline(llm, ids, 2)
    lp = choice["logprobs"]
    # Prompt tokens first (the first has nothing before it), then the output token.
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx([r[t] for t, r in zip(ids[1:], ref[1:])], abs=1e-4)
    assert all(len(top) in (2, 3) for top in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert choice["text"].startswith(PROMPT) and "prompt_logprobs" not in choice  # not asked for by name
    chunks = [json.loads(e) for e in sse_events(client.post("/v1/completions", json={**req, "stream": True}))[:-1]]
    streamed = [v for ch in chunks for v in ch["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-4)  # a separate pass: float32 rounds apart


def test_prompt_logprobs_field(client: httpx.Client, llm: LLM) -> None:
    req = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 1,
           "return_token_ids": True}
    choice = client.post("/v1/completions", json=req).json()["choices"][0]
    ids, got = choice["prompt_token_ids"], choice["prompt_logprobs"]
    ref = _offline(llm, ids, 1)
    assert len(got) == len(ids) and got[0] is None and choice["logprobs"] is None
    for tok, entry, r in zip(ids[1:], got[1:], ref[1:]):
        assert entry[str(tok)]["logprob"] == pytest.approx(r[tok], abs=1e-4)
        assert entry[str(tok)]["rank"] >= 1 and isinstance(entry[str(tok)]["decoded_token"], str)
        best = max(entry.values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1 and best["logprob"] == pytest.approx(max(r.values()), abs=1e-4)
    assert "prompt_logprobs" not in client.post("/v1/completions", json={**req, "prompt_logprobs": None}).json()[
        "choices"][0]
    chat = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in chat["prompt_logprobs"][1:])
