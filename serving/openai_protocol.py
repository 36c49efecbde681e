"""OpenAI-compatible request and response bodies (pydantic), and their mapping to engine sampling settings.

Requests accept OpenAI's fields plus vLLM's extensions that the engine implements (top_k, stop_token_ids,
ignore_eos). Fields the engine cannot honour are rejected with a 400 rather than silently ignored, except
for harmless ones (`user`, `stream_options` without usage). Unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serving.router_client import GenerationError


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise GenerationError(f"n={self.n} is not supported: specserve returns one choice per request (n=1)",
                                  400, "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise GenerationError(f"{name} is not supported (only 0)", 400, name)
        if self.logit_bias:
            raise GenerationError("logit_bias is not supported", 400, "logit_bias")

    def sampling_params(self, max_tokens: int) -> dict[str, Any]:
        """Keyword arguments of engine.SamplingParams; the router validates them (ValueError -> 400)."""
        top_k = self.top_k if self.top_k is not None else 0
        return {"max_tokens": max_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,  # OpenAI's default
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "top_k": 0 if top_k == -1 else top_k,
                "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                "ignore_eos": self.ignore_eos}

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise GenerationError("echo is not supported", 400, "echo")
        if self.suffix:
            raise GenerationError("suffix is not supported", 400, "suffix")
        if self.logprobs is not None:
            raise GenerationError("logprobs are not supported", 400, "logprobs")
        if self.best_of not in (None, 1):
            raise GenerationError("best_of is not supported (only 1)", 400, "best_of")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request: OpenAI also allows a batch, which n=1 serving does not."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise GenerationError(f"{len(p)} prompts in one request are not supported: send one per request",
                                      400, "prompt")
            p = p[0]
        if isinstance(p, list) and not p:
            raise GenerationError("prompt is empty: give at least one token", 400, "prompt")
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... go to the chat template as they are
    role: str
    content: str | list[ContentPart] | None = None

    def template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise GenerationError("only text content parts are supported", 400, "messages")
            content = "".join(part.text or "" for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # extension (vLLM)

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise GenerationError("logprobs are not supported", 400, "logprobs")


# --- responses -------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache instead of being computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class SpecDecodeStats(BaseModel):
    """Per-request speculation statistics (docs/ARCHITECTURE.md: rate = accepted / drafted, length = 1 + accepted /
    verify steps)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    acceptance_rate: float
    acceptance_length: float


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    spec_decode: SpecDecodeStats | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    spec_decode: SpecDecodeStats | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    spec_decode: SpecDecodeStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specserve"
    max_model_len: int | None = None


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
