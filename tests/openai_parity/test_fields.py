"""OpenAI request parity, served: every field is honoured or refused with a 400 naming it, unknown fields and bad
chat messages are named, the tokenizer routes, /version and /v1/models/{id}, usage in streams as vLLM sends it, and
generation_config.json defaults (fixtures: conftest.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_support import assert_error, sse_events

from engine import LLM
from openai_parity import CHAT, CMPL, MAX_NEW_TOKENS, MODEL, SERVED_MAX_MODEL_LEN, _offline

# (endpoint body, field, value): each must be refused with a 400 whose param names the field.
REFUSED = [
    # reasoning_effort goes to a chat template that reads it (GPT-OSS's: tests/test_harmony_served.py); the byte
    # models' does not, so it is refused here.
    *[(CHAT, "reasoning_effort", "low"), (CHAT, "echo", True)],
    *[(body | {"stream": True}, "prompt_logprobs", 1) for body in (CMPL, CHAT)],  # no field for them in a stream
    *[(body, field, value) for body in (CMPL, CHAT) for field, value in [
        ("structural_tag", "{}"), ("guided_whitespace_pattern", " "), ("use_beam_search", True),
        ("length_penalty", 0.5), ("best_of", 2),
        ("skip_special_tokens", False), ("spaces_between_special_tokens", False),
        ("priority", 1), ("logits_processors", ["x"]), ("kv_transfer_params", {"a": 1}), ("vllm_xargs", {"a": 1})]],
    (CMPL, "suffix", "end"), (CMPL, "prompt_embeds", "AAAA"), (CHAT, "mm_processor_kwargs", {"a": 1}),
]


# The fields each endpoint honours (tested below and in tests/serving_e2e/); with REFUSED, every field the request
# models declare. A new field must be added to one of the two: accepted and dropped is not an option.
HONOURED_BOTH = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "n", "stream", "stream_options", "user", "request_id", "cache_salt",
                 "truncate_prompt_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "logit_bias", "min_tokens", "min_p", "allowed_token_ids", "bad_words", "include_stop_str_in_output",
                 "return_tokens_as_token_ids", "return_token_ids", "logprobs", "add_special_tokens",
                 "prompt_logprobs",  # tests/openai_parity/test_prompt_logprobs.py
                 # Structured outputs (tests/test_structured_outputs.py):
                 "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "guided_decoding_backend", "structured_outputs"}
HONOURED = {"completions": HONOURED_BOTH | {"prompt", "echo"},
            "chat": HONOURED_BOTH | {"messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls",
                                     "tools", "tool_choice",
                                     "include_reasoning", "add_generation_prompt", "continue_final_message",
                                     "reasoning_effort",
                                     "documents", "chat_template", "chat_template_kwargs"}}
REFUSED_BY_ENDPOINT = {"completions": set(), "chat": {"echo"}}  # refused by the endpoint's own check


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_field_is_honoured_or_refused(endpoint: str) -> None:
    from serving.openai.protocol import REFUSED as REFUSED_FIELDS
    from serving.openai.protocol import ChatCompletionRequest, CompletionRequest

    model = CompletionRequest if endpoint == "completions" else ChatCompletionRequest
    declared = set(model.model_fields)
    refused = declared & set(REFUSED_FIELDS) | REFUSED_BY_ENDPOINT[endpoint]
    assert declared == HONOURED[endpoint] | refused, declared ^ (HONOURED[endpoint] | refused)
    body = CMPL if endpoint == "completions" else CHAT
    tested = {f for b, f, _ in REFUSED if b is body or ("messages" in b) == (endpoint == "chat")}
    assert refused <= tested, refused - tested  # the table below sends every refused field


@pytest.mark.parametrize("body, field, value", REFUSED,
                         ids=[f"{'chat' if 'messages' in b else 'cmpl'}-{f}" for b, f, _ in REFUSED])
def test_refused_fields_name_themselves(client: httpx.Client, body: dict, field: str, value: object) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = assert_error(client.post(path, json={**body, field: value}), 400)
    assert err["param"] == field, err
    assert field in err["message"] and "unknown field" not in err["message"]  # a known field, refused


@pytest.mark.parametrize("body, field, value", [
    (CMPL, "response_format", {"type": "text"}), (CHAT, "tool_choice", "none"), (CMPL, "best_of", 1),
    (CMPL, "user", "u1"),
    (CHAT, "parallel_tool_calls", True), (CMPL, "cache_salt", "s"), (CMPL, "priority", 0),
    (CHAT, "include_reasoning", False), (CMPL, "skip_special_tokens", True), (CMPL, "length_penalty", 1.0),
], ids=lambda x: x if isinstance(x, str) else None)
def test_neutral_values_are_accepted(client: httpx.Client, body: dict, field: str, value: object) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = client.post(path, json={**body, field: value, "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, body", [("/v1/completions", CMPL), ("/v1/chat/completions", CHAT)])
def test_unknown_fields_are_refused(client: httpx.Client, path: str, body: dict) -> None:
    err = assert_error(client.post(path, json={**body, "temprature": 0.5}), 400)
    assert err["param"] == "temprature" and "unknown field" in err["message"]
    err = assert_error(client.post(path, json={**body, "stream_options": {"include_usage": True, "x": 1}}), 400)
    assert err["param"] == "stream_options.x"


@pytest.mark.parametrize("message, param", [
    ({"role": "wizard", "content": "hi"}, "messages.0.role"),
    ({"role": "user"}, "messages.0.content"),
    ({"role": "user", "content": None}, "messages.0.content"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages.0.content.0.type"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages.0.content.0.text"),
    ({"role": "tool", "content": "42"}, "messages.0.tool_call_id"),
    ({"role": "user", "content": "hi", "tool_call_id": "c1"}, "messages.0.tool_call_id"),
    ({"role": "user", "content": "hi", "colour": "red"}, "messages.0.colour"),
])
def test_bad_chat_messages(client: httpx.Client, message: dict, param: str) -> None:
    err = assert_error(client.post("/v1/chat/completions", json={**CHAT, "messages": [message]}), 400)
    assert err["param"] == param, err


def test_good_chat_messages(client: httpx.Client) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "really"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                       "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}, {"role": "user", "content": "go"}]
    r = client.post("/v1/chat/completions", json={**CHAT, "messages": messages, "temperature": 0})
    assert r.status_code == 200, r.text
    # The same conversation through /tokenize counts the prompt the chat request prefilled.
    tok = client.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert tok["count"] == r.json()["usage"]["prompt_tokens"] == len(tok["tokens"])


def test_tokenize_detokenize_version_models(client: httpx.Client) -> None:
    tok = client.post("/tokenize", json={"model": MODEL, "prompt": "héllo", "return_token_strs": True}).json()
    # The byte tokenizer: BOS is not added by default for this tokenizer; one token per UTF-8 byte.
    assert tok["count"] == len(tok["tokens"]) == len("héllo".encode()) and tok["max_model_len"] == SERVED_MAX_MODEL_LEN
    assert len(tok["token_strs"]) == tok["count"]
    assert client.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json() == {"prompt": "héllo"}
    assert assert_error(client.post("/detokenize", json={"tokens": [10**6]}), 400)["param"] == "tokens"
    assert assert_error(client.post("/tokenize", json={"model": "other", "prompt": "x"}), 404)["param"] == "model"
    assert_error(client.post("/tokenize", json={"prompt": "x", "bogus": 1}), 400)
    assert isinstance(client.get("/version").json()["version"], str)
    card = client.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == SERVED_MAX_MODEL_LEN
    assert assert_error(client.get("/v1/models/other"), 404)["code"] == "model_not_found"


def test_stream_usage_as_vllm(client: httpx.Client) -> None:
    req = {**CMPL, "temperature": 0, "stream": True}
    plain = [json.loads(e) for e in sse_events(client.post("/v1/completions", json=req))[:-1]]
    assert all("usage" not in ch for ch in plain)  # no stream_options: no usage (vLLM)
    assert "spec_decode" in plain[-1] and plain[-1]["choices"][0]["finish_reason"]
    # stream_options given: include_usage defaults to true (vLLM's default), on a final choices-less chunk.
    with_options = client.post("/v1/completions", json={**req, "stream_options": {}})
    chunks = [json.loads(e) for e in sse_events(with_options)[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all("usage" not in ch for ch in chunks[:-1])
    cont = [json.loads(e) for e in sse_events(client.post("/v1/completions", json={
        **req, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))[:-1]]
    assert all("usage" in ch for ch in cont)
    assert [ch["usage"]["completion_tokens"] for ch in cont[:-1]] == sorted(ch["usage"]["completion_tokens"]
                                                                            for ch in cont[:-1])
    # stream_options without stream is refused, as vLLM does.
    assert_error(client.post("/v1/completions", json={**CMPL, "stream_options": {"include_usage": True}}), 400)


def test_generation_config_defaults(client: httpx.Client, llm: LLM) -> None:
    """The target's generation_config.json sets top_k=7 and max_new_tokens: a request that leaves them unset
    samples with top_k 7 and stops at max_new_tokens; one that sets them keeps its own (up to the cap)."""
    seeded = {"model": MODEL, "prompt": "hello", "temperature": 1.0, "seed": 5, "ignore_eos": True}
    r = client.post("/v1/completions", json={**seeded, "max_tokens": MAX_NEW_TOKENS + 4}).json()
    assert r["usage"]["completion_tokens"] == MAX_NEW_TOKENS  # capped by max_new_tokens, as vLLM caps it
    assert r["choices"][0]["text"] == _offline(llm, "hello", max_tokens=MAX_NEW_TOKENS, temperature=1.0, top_k=7,
                                               seed=5, ignore_eos=True)
    r = client.post("/v1/completions", json={**seeded, "top_k": 0, "max_tokens": 6}).json()
    assert r["choices"][0]["text"] == _offline(llm, "hello", max_tokens=6, temperature=1.0, top_k=0, seed=5,
                                               ignore_eos=True)


def test_max_tokens_beyond_the_context_is_a_400_naming_the_field(client: httpx.Client) -> None:
    """As vLLM: a prompt plus max_tokens (chat: max_completion_tokens, when given) over the served context is
    refused, naming the field the client used; exactly what the context leaves is served."""
    n = client.post("/v1/completions", json={**CMPL, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    err = assert_error(client.post("/v1/completions", json={**CMPL, "max_tokens": SERVED_MAX_MODEL_LEN - n + 1}), 400)
    assert err["param"] == "max_tokens" and f"maximum context length is {SERVED_MAX_MODEL_LEN}" in err["message"], err
    assert assert_error(client.post("/v1/completions", json={**CMPL, "max_tokens": 10**6, "stream": True}),
                        400)["param"] == "max_tokens"
    ok = client.post("/v1/completions", json={**CMPL, "max_tokens": SERVED_MAX_MODEL_LEN - n, "temperature": 0})
    assert ok.status_code == 200, ok.text
    chat = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    err = assert_error(client.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 10**6}), 400)
    assert err["param"] == "max_completion_tokens", err
    assert assert_error(client.post("/v1/chat/completions", json={**chat, "max_tokens": 10**6}),
                        400)["param"] == "max_tokens"
