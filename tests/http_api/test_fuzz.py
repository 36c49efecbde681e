"""Fuzzing the HTTP API from its own OpenAPI schema: no request may get a 5xx.

The server (the package's, conftest.py: a local Ray, Serve's HTTP proxy on 127.0.0.1, tiny byte-level models)
publishes `/openapi.json`; bodies for every POST route are drawn from that schema's request body with hypothesis:
values that follow the schema (with numbers drawn near the API's limits), values of the wrong type, missing and
unknown fields. Every answer must be below 500; errors must have OpenAI's shape, successes must parse (a stream
must end with `data: [DONE]`). Afterwards the server is healthy and holds no KV block in either model. Bounded:
100 schema examples and 40 raw-bytes examples, no deadline.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serve_support import Server, kv_blocks_used, wait_idle

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    """A client of the package's server (conftest.py, shared with test_reliability_http.py), with its API key:
    the bodies reach validation and the engine, not only the key check."""
    with server.http(timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def routes(client: httpx.Client) -> dict[str, st.SearchStrategy]:
    """POST route -> strategy of JSON bodies, from the app's own OpenAPI schema."""
    spec = client.get("/openapi.json").json()
    out = {}
    for path, methods in spec["paths"].items():
        post = methods.get("post")
        if post and "requestBody" in post:
            schema = post["requestBody"]["content"]["application/json"]["schema"]
            out[path] = body_strategy(schema, spec)
    assert {"/v1/completions", "/v1/chat/completions"} <= set(out), sorted(out)
    return out


# --- JSON schema -> hypothesis, biased towards the edges -------------------------------------------------
NUMBERS = st.sampled_from([0, 1, -1, 2, 0.5, 1.0, 1.5, 2.0, 2.0001, -0.0001, 1e-7, 1e9, 2**31, 2**63, 2**64, -2**63,
                           10**30, 1e308, -1e308])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10, 10), NUMBERS, st.text(max_size=8))
ANY_JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                        max_leaves=6)
def _resolve(schema: dict, spec: dict) -> dict:
    while "$ref" in schema:
        node: Any = spec
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def _typed(schema: dict, spec: dict, depth: int) -> st.SearchStrategy:
    schema = _resolve(schema, spec)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([_typed(s, spec, depth) for s in schema[key]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(max_size=24)
    if kind == "integer":
        return st.one_of(st.integers(-3, 50), NUMBERS.filter(lambda x: isinstance(x, int)))
    if kind == "number":
        return st.one_of(st.floats(-3, 3, allow_nan=False), NUMBERS)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = schema.get("items", {})
        return st.lists(_typed(items, spec, depth + 1) if depth < 4 else SCALARS, max_size=4)
    if kind == "object" or "properties" in schema:
        return _object(schema, spec, depth)
    return ANY_JSON


def _object(schema: dict, spec: dict, depth: int) -> st.SearchStrategy:
    props = schema.get("properties", {})
    required = set(schema.get("required", []))
    if not props:  # a free-form mapping (e.g. logit_bias)
        values = schema.get("additionalProperties")
        return st.dictionaries(st.text(max_size=6), _typed(values, spec, depth + 1) if isinstance(values, dict)
                               else SCALARS, max_size=3)

    @st.composite
    def objects(draw: st.DrawFn) -> dict:
        # Start from a body the server should accept (so that many requests reach the engine and stream), then
        # now and then break it: a field from the schema set to a schema-typed or arbitrary value, or a
        # required field dropped.
        out = {}
        for name, sub in props.items():
            if name in required or (name in GOOD and draw(st.booleans())):
                out[name] = draw(GOOD[name] if name in GOOD else _typed(sub, spec, depth + 1))
        for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2]))):
            name = draw(st.sampled_from(sorted(props)))
            how = draw(st.integers(0, 4))
            if how == 0 and name in out:
                del out[name]
            else:
                out[name] = draw(_typed(props[name], spec, depth + 1) if how < 3 else ANY_JSON)
        if draw(st.integers(0, 9)) == 0:
            out[draw(st.text(min_size=1, max_size=6))] = draw(SCALARS)  # an unknown field
        return out

    return objects()


def body_strategy(schema: dict, spec: dict) -> st.SearchStrategy:
    return _typed(schema, spec, 0)


# Values the server accepts, by field name: the starting point that mutations then break.
TEXT = st.text(min_size=1, max_size=16)
GOOD = {
    "model": st.just(MODEL),
    "prompt": st.one_of(TEXT, st.lists(st.integers(3, 258), min_size=1, max_size=12)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                "content": TEXT}), min_size=1, max_size=3),
    "max_tokens": st.integers(1, 12),
    "max_completion_tokens": st.integers(1, 12),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.one_of(st.integers(0, 50), st.just(-1)),
    "seed": st.integers(-2**63, 2**63 - 1),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "n": st.just(1),
    "tokens": st.lists(st.integers(3, 258), max_size=12),
}


# --- checks ----------------------------------------------------------------------------------------------
# What a success must hold, per route: generation routes their choices, the tokenizer routes their answer.
SUCCESS_KEY = {"/tokenize": "tokens", "/detokenize": "prompt"}


def check_response(r: httpx.Response, streamed: bool, path: str = "/v1/completions") -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text[:500]
        return
    if streamed and r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n"), r.text[-200:]
        for event in r.text.split("\n\n")[:-2]:
            payload = json.loads(event[len("data: "):])
            assert "error" not in payload, payload  # an in-band error would be the server failing mid-stream
    elif path in SUCCESS_KEY:
        assert SUCCESS_KEY[path] in r.json(), r.text[:500]
    else:
        assert r.json()["choices"], r.text[:500]


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
@given(data=st.data())
def test_schema_fuzz_no_5xx(client: httpx.Client, routes: dict[str, st.SearchStrategy], data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(sorted(routes)), label="path")
    body = data.draw(routes[path], label="body")
    raw = json.dumps(body, allow_nan=True)  # NaN and 1e308-style extremes included
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    streamed = isinstance(body, dict) and body.get("stream") is True
    event(f"{path} {r.status_code}")  # `pytest --hypothesis-show-statistics` shows how many reached the engine
    check_response(r, streamed, path)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode),
                     st.sampled_from([b"{", b"[]", b"null", b'"x"', b"1e999", b'{"prompt": NaN}', b"\xff\xfe"])),
       content_type=st.sampled_from(["application/json", "text/plain", ""]))
def test_raw_bytes_fuzz_no_5xx(client: httpx.Client, path: str, raw: bytes, content_type: str) -> None:
    headers = {"content-type": content_type} if content_type else {}
    r = client.post(path, content=raw, headers=headers)
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


def test_server_healthy_after_fuzzing(server: Server, client: httpx.Client) -> None:
    stats = wait_idle(timeout_s=60)
    assert set(kv_blocks_used(stats).values()) == {0}, stats
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 3, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert not math.isnan(r.json()["spec_decode"]["acceptance_rate"])
