"""OpenAI-compatible response bodies (pydantic) and OpenAI's error shape.

Whole responses go through these models (serving/openai/choices.py validates what it built); streamed chunks are
plain dicts of the same fields, built per token where validating each would cost more than the token."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache instead of being computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class SpecDecodeStats(BaseModel):
    """Per-request speculation statistics (rate = accepted / drafted, length = 1 + accepted / verify steps)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    acceptance_rate: float
    acceptance_length: float


class CompletionLogprobs(BaseModel):
    """Completions' logprobs (OpenAI's legacy shape): per emitted token, its text, its offset in the choice's
    text, its log-probability, and the `logprobs` most likely tokens at that position."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int  # in the vocabulary, 1 for the most likely token
    decoded_token: str


# vLLM's prompt_logprobs: None for the first prompt token, then per token {token id: its entry} for the token itself
# and the most likely tokens at its position. Only with prompt_logprobs asked for.
PromptLogprobs = list[dict[str, PromptTokenLogprob] | None] | None


class CompletionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a key the server builds but the model lacks is a bug, not dropped
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    stop_reason: str | int | None = None  # extension (vLLM): the stop string or token id that ended it
    prompt_token_ids: list[int] | None = None  # extension (vLLM): with return_token_ids
    token_ids: list[int] | None = None  # extension (vLLM): with return_token_ids
    prompt_logprobs: PromptLogprobs = Field(default=None, exclude_if=lambda v: v is None)  # extension (vLLM)


class _ResponseHead(BaseModel):
    """The fields a completion and a chat completion open with (a subclass narrows `object` to its own value; the
    fields keep this order in the JSON)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionResponse(_ResponseHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    spec_decode: SpecDecodeStats | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda calls: not calls)  # only with calls
    # With the server's reasoning parser (serving/openai/reasoning_parser.py): the thinking apart from the answer.
    reasoning_content: str | None = Field(default=None, exclude_if=lambda r: r is None)


class ChatChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    stop_reason: str | int | None = None  # extension (vLLM)
    prompt_token_ids: list[int] | None = None  # extension (vLLM): with return_token_ids
    token_ids: list[int] | None = None  # extension (vLLM): with return_token_ids


class ChatCompletionResponse(_ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    spec_decode: SpecDecodeStats | None = None
    prompt_logprobs: PromptLogprobs = Field(default=None, exclude_if=lambda v: v is None)  # extension (vLLM)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specserve"
    max_model_len: int | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_type(status: int) -> str:
    if status == 503:
        return "service_unavailable"
    if status == 429:
        return "rate_limit_exceeded"
    return "invalid_request_error" if 400 <= status < 500 else "internal_server_error"
