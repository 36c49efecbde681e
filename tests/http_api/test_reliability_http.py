"""Bad input, authentication and body limits on a real server: a local Ray, Serve's HTTP and gRPC proxies on
127.0.0.1, the router stepping tiny byte-level models (target + draft) on their own worker actors.

Every bad request must get its expected status with OpenAI's error shape (gRPC: its status code and a
message), never a 5xx, and must leave the server unharmed: the tests after the tables send good requests and
check that no KV block is left held by either model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from serve_support import (
    Server,
    assert_error,
    completion,
    kv_blocks_used,
    router_stats,
    sse_payloads,
    wait_idle,
)

from http_api import API_KEY, MAX_BODY, MAX_MODEL_LEN
from serving.proto import specserve_pb2 as pb
from serving.proto import specserve_pb2_grpc as pb_grpc

# `server`: the package's (conftest.py), shared with test_fuzz.py.

# --- the table of bad HTTP requests -------------------------------------------------------------------------
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _with(base: dict, **changes: object) -> bytes:
    body = {k: v for k, v in {**base, **changes}.items() if v is not _DROP}
    return json.dumps(body).encode()


_DROP = object()

# (id, path, raw body, expected status, expected `param` or None, a word the message must contain or None)
BAD_HTTP = [
    ("max_tokens_0", C, _with(OK, max_tokens=0), 400, "max_tokens", "max_tokens"),
    ("max_tokens_negative", C, _with(OK, max_tokens=-1), 400, "max_tokens", "max_tokens"),
    ("max_tokens_string", C, _with(OK, max_tokens="many"), 400, "max_tokens", None),
    ("max_tokens_fraction", C, _with(OK, max_tokens=1.5), 400, "max_tokens", None),
    ("temperature_negative", C, _with(OK, temperature=-0.1), 400, "temperature", "temperature"),
    ("temperature_above_2", C, _with(OK, temperature=2.5), 400, "temperature", "2"),
    ("temperature_nan", C, b'{"model": "tiny", "prompt": "hello", "temperature": NaN}', 400, "temperature", None),
    ("temperature_string", C, _with(OK, temperature="hot"), 400, "temperature", None),
    ("top_p_zero", C, _with(OK, top_p=0), 400, "top_p", "top_p"),
    ("top_p_above_1", C, _with(OK, top_p=1.01), 400, "top_p", "top_p"),
    ("top_p_infinite", C, b'{"model": "tiny", "prompt": "hello", "top_p": Infinity}', 400, "top_p", None),
    ("top_k_negative", C, _with(OK, top_k=-2), 400, "top_k", "top_k"),
    ("top_k_huge", C, _with(OK, top_k=2**40), 400, "top_k", "top_k"),
    ("n_too_many", C, _with(OK, n=65), 400, "n", "64"),
    ("n_0", C, _with(OK, n=0), 400, "n", None),
    ("best_of", C, _with(OK, best_of=3), 400, "best_of", None),
    ("prompt_logprobs_negative", C, _with(OK, prompt_logprobs=-1), 400, "prompt_logprobs", None),
    ("prompt_logprobs_above_20", C, _with(OK, prompt_logprobs=21), 400, "prompt_logprobs", None),
    ("logprobs_above_20", C, _with(OK, logprobs=21), 400, "logprobs", None),
    ("suffix", C, _with(OK, suffix="!"), 400, "suffix", None),
    ("presence_penalty_above_2", C, _with(OK, presence_penalty=2.5), 400, "presence_penalty", None),
    ("frequency_penalty_below_minus_2", C, _with(OK, frequency_penalty=-3), 400, "frequency_penalty", None),
    ("logit_bias_above_100", C, _with(OK, logit_bias={"5": 101}), 400, "logit_bias", None),
    ("logit_bias_not_a_token", C, _with(OK, logit_bias={"five": 1}), 400, "logit_bias", None),
    ("stop_empty_string", C, _with(OK, stop=[""]), 400, "stop", "stop"),
    ("stop_token_ids_negative", C, _with(OK, stop_token_ids=[-1]), 400, "stop_token_ids", None),
    ("seed_string", C, _with(OK, seed="abc"), 400, "seed", None),
    ("seed_past_64_bits", C, _with(OK, seed=2**70), 400, "seed", "64 bits"),
    ("prompt_missing", C, _with(OK, prompt=_DROP), 400, "prompt", None),
    ("prompt_empty", C, _with(OK, prompt=""), 400, "prompt", "empty"),
    ("prompt_no_tokens", C, _with(OK, prompt=[]), 400, "prompt", "empty"),
    ("prompt_batch_empty_item", C, _with(OK, prompt=["a", ""]), 400, "prompt", "empty"),
    ("prompt_token_outside_vocab", C, _with(OK, prompt=[999999]), 400, "prompt", "vocabulary"),
    ("prompt_token_negative", C, _with(OK, prompt=[-5]), 400, "prompt", "vocabulary"),
    ("prompt_longer_than_context", C, _with(OK, prompt="x" * 200), 400, "prompt", str(MAX_MODEL_LEN)),
    ("prompt_ids_fill_context", C, _with(OK, prompt=[5] * MAX_MODEL_LEN), 400, "prompt", str(MAX_MODEL_LEN)),
    ("prompt_lone_surrogate", C, b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, "prompt", None),
    ("unknown_model", C, _with(OK, model="gpt-4"), 404, "model", "gpt-4"),
    ("malformed_json", C, b'{"model": "tiny", "prompt": ', 400, None, "JSON"),
    ("body_is_a_list", C, b"[]", 400, None, None),
    ("body_is_null", C, b"null", 400, None, None),
    ("body_empty", C, b"", 400, None, None),
    ("stream_bad_max_tokens", C, _with(OK, max_tokens=0, stream=True), 400, "max_tokens", None),
    ("stream_options_not_object", C, _with(OK, stream=True, stream_options=5), 400, "stream_options", None),
    ("chat_no_messages", CHAT, _with(OK_CHAT, messages=[]), 400, "messages", None),
    ("chat_messages_missing", CHAT, _with(OK_CHAT, messages=_DROP), 400, "messages", None),
    ("chat_message_without_role", CHAT, _with(OK_CHAT, messages=[{"content": "hi"}]), 400, None, "role"),
    ("chat_image_part", CHAT, _with(OK_CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages.0.content.0.type", "text"),
    ("chat_content_number", CHAT, _with(OK_CHAT, messages=[{"role": "user", "content": 5}]), 400, None, None),
    ("chat_top_logprobs_without_logprobs", CHAT, _with(OK_CHAT, top_logprobs=2), 400, "top_logprobs", None),
    ("chat_n_0", CHAT, _with(OK_CHAT, n=0), 400, "n", None),
    ("chat_unknown_role", CHAT, _with(OK_CHAT, messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages.0.role", None),
    # Tools are honoured; a tool the API cannot use is a 400 naming it, and so is a choice of a tool not given.
    ("chat_tools", CHAT, _with(OK_CHAT, tools=[{"type": "retrieval"}]), 400, "tools.0", None),
    ("chat_tool_choice_unknown", CHAT, _with(OK_CHAT, tools=[{"type": "function", "function": {"name": "f"}}],
                                             tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "tool_choice", None),
    ("unknown_field", C, _with(OK, temprature=1), 400, "temprature", "unknown field"),
    ("chat_max_completion_tokens_0", CHAT, _with(OK_CHAT, max_completion_tokens=0), 400, "max_tokens", None),
    ("chat_temperature_3", CHAT, _with(OK_CHAT, temperature=3), 400, "temperature", None),
    ("chat_unknown_model", CHAT, _with(OK_CHAT, model="other"), 404, "model", None),
    ("body_over_limit", C, _with(OK, prompt="x" * (MAX_BODY + 1)), 413, None, str(MAX_BODY)),
]


@pytest.mark.parametrize("path, body, status, param, word", [case[1:] for case in BAD_HTTP],
                         ids=[case[0] for case in BAD_HTTP])
def test_bad_http_request(server: Server, path: str, body: bytes, status: int, param: str | None,
                          word: str | None) -> None:
    with server.http() as c:
        r = c.post(path, content=body, headers={"content-type": "application/json"})
    err = assert_error(r, status)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if word is not None:
        assert word in err["message"], err


def test_bad_http_table_is_large() -> None:
    assert len(BAD_HTTP) >= 25


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/nope", 404), ("POST", "/v1/models", 405),
                                                  ("GET", "/v1/completions", 405)])
def test_unknown_routes_and_methods(server: Server, method: str, path: str, status: int) -> None:
    with server.http() as c:
        assert_error(c.request(method, path), status)


def test_chunked_body_over_limit(server: Server) -> None:
    """No Content-Length to trust: the body is counted as it arrives."""
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_BODY // 4096 + 2):
            yield b"x" * 4096
        yield b'"}'

    with server.http() as c:
        r = c.post(C, content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413)


def test_body_just_under_limit_is_served(server: Server) -> None:
    """The limit is on bytes, not on what they say: a body under it reaches the engine (here: a prompt longer
    than the context, which the engine refuses naming the limit)."""
    body = _with(OK, prompt="y" * (MAX_BODY - 200))
    assert len(body) < MAX_BODY
    with server.http() as c:
        err = assert_error(c.post(C, content=body, headers={"content-type": "application/json"}), 400)
    assert "max_model_len is 128" in err["message"]


# --- authentication ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"},
                                     {"Authorization": f"Bearer {API_KEY}x"}],
                         ids=["none", "wrong", "no-scheme", "basic", "longer"])
def test_api_key_required(server: Server, headers: dict) -> None:
    with server.http(headers=headers) as c:
        for r in (c.post(C, json=OK), c.get("/v1/models"), c.post(CHAT, json=OK_CHAT)):
            err = assert_error(r, 401)
            assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"


def test_api_key_accepted(server: Server) -> None:
    with server.http(headers={"Authorization": f"bearer {API_KEY}"}) as c:  # the scheme is case-insensitive
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_health_and_metrics_open_without_key(server: Server) -> None:
    with server.http(headers={}) as c:
        assert c.get("/health").status_code == 200
        r = c.get("/metrics")
        assert r.status_code == 200 and "specserve_num_requests_running" in r.text


# --- gRPC --------------------------------------------------------------------------------------------------
AUTH = (("authorization", f"Bearer {API_KEY}"),)
BAD_GRPC = [
    ("empty_prompt", dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ("max_tokens_negative", dict(prompt="hi", max_tokens=-1), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("temperature_negative", dict(prompt="hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("temperature_above_2", dict(prompt="hi", temperature=2.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("temperature_nan", dict(prompt="hi", temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT,
     "temperature"),
    ("top_p_above_1", dict(prompt="hi", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("top_k_negative", dict(prompt="hi", top_k=-3), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    ("stop_empty", dict(prompt="hi", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ("prompt_and_ids", dict(prompt="hi", prompt_token_ids=[5]), grpc.StatusCode.INVALID_ARGUMENT, "not both"),
    ("ids_outside_vocab", dict(prompt_token_ids=[999999]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ("prompt_longer_than_context", dict(prompt="x" * 200), grpc.StatusCode.INVALID_ARGUMENT, str(MAX_MODEL_LEN)),
]


@pytest.mark.parametrize("kwargs, code, word", [case[1:] for case in BAD_GRPC], ids=[case[0] for case in BAD_GRPC])
def test_bad_grpc_request(server: Server, kwargs: dict, code: grpc.StatusCode, word: str) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(**kwargs), metadata=AUTH, timeout=60))
    assert info.value.code() == code, info.value
    assert word in info.value.details()


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer nope"),)], ids=["none", "wrong"])
def test_grpc_api_key_required(server: Server, metadata: tuple) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt="hi"), metadata=metadata,
                                                          timeout=60))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


# --- and the server is unharmed ----------------------------------------------------------------------------
def test_good_requests_after_bad_ones(server: Server) -> None:
    with server.http() as c:
        r = completion(server, c, max_tokens=6)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        streamed = c.post(C, json={**OK, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True})
        assert streamed.status_code == 200
        chunks = sse_payloads(streamed.text)
        assert chunks[-1] == "[DONE]"
        assert "".join(json.loads(ch)["choices"][0]["text"] for ch in chunks[:-1]) == r.json()["choices"][0]["text"]
    with grpc.insecure_channel(server.grpc_target) as channel:
        out = list(pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(prompt="hello", max_tokens=6, ignore_eos=True), metadata=AUTH, timeout=60))
    assert "".join(o.text for o in out) == r.json()["choices"][0]["text"]
    stats = wait_idle()
    assert set(kv_blocks_used(stats).values()) == {0}, stats
    assert router_stats()["healthy"]


def test_openai_client_errors(server: Server) -> None:
    """The official client maps the statuses to its exception types."""
    import openai

    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base}/v1", api_key="bad", max_retries=0).models.list()
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens >= 1


def test_form_body_is_a_client_error(server: Server) -> None:
    with server.http() as c:
        assert_error(c.post(C, content=b"prompt=hi", headers={"content-type": "application/x-www-form-urlencoded"}),
                     400)


# --- configuration and the guard alone (no server) ---------------------------------------------------------
def test_reliability_flags_and_config() -> None:
    from deploy.cli import build_parser
    from deploy.config import ServeConfig, load_config

    args = build_parser().parse_args(["serve", "--api-key", "k1", "--auth-health-metrics", "--max-request-body-bytes",
                                      "1000", "--max-queued-requests", "none", "--continue-without-draft",
                                      "--drain-timeout-s", "5"])
    given = {k: v for k, v in vars(args).items() if k not in ("command", "func", "verbose", "config")}
    cfg = load_config(None, given)
    assert (cfg.api_key, cfg.auth_health_metrics, cfg.max_request_body_bytes, cfg.max_queued_requests,
            cfg.continue_without_draft, cfg.drain_timeout_s) == ("k1", True, 1000, None, True, 5.0)
    defaults = ServeConfig()
    assert (defaults.api_key, defaults.auth_health_metrics, defaults.max_queued_requests) == (None, False, 256)
    assert ServeConfig.from_dict({"max_request_body_bytes": "none", "continue_without_draft": "yes"}) \
        .max_request_body_bytes is None
    for bad, word in (({"api_key": " \t"}, "api_key"), ({"max_queued_requests": -1}, "max_queued_requests"),
                      ({"max_request_body_bytes": 0}, "max_request_body_bytes"), ({"drain_timeout_s": -1}, "drain")):
        with pytest.raises(ValueError, match=word):
            ServeConfig(**bad).validate()


def test_guard_protects_health_and_metrics_when_asked() -> None:
    """auth_health_metrics: the probes need the key too (the guard in front of a plain ASGI app)."""
    import asyncio

    import httpx

    from serving.openai.http_guard import RequestGuard

    async def app(scope, receive, send) -> None:
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"seen %d bytes" % len(body)})

    async def run() -> list[tuple[int, str]]:
        out = []
        for open_paths in (frozenset({"/health"}), frozenset()):
            guard = RequestGuard(app, api_key="k", max_body_bytes=10, open_paths=open_paths)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t") as c:
                for path, headers, body in (("/health", {}, b""), ("/health", {"Authorization": "Bearer k"}, b""),
                                            ("/x", {"Authorization": "Bearer k"}, b"0123456789"),
                                            ("/x", {"Authorization": "Bearer k"}, b"0123456789A")):
                    r = await c.post(path, headers=headers, content=body)
                    out.append((r.status_code, r.text))
        return out

    results = asyncio.run(run())
    assert [s for s, _ in results] == [200, 200, 200, 413, 401, 200, 200, 413], results
    assert results[2][1] == "seen 10 bytes" and "invalid_api_key" in results[4][1]
