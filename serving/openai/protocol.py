"""OpenAI-compatible request bodies (pydantic), and their mapping to engine sampling settings.

The request models list every field of vLLM's CompletionRequest and ChatCompletionRequest. Each one is either
honoured or refused with a 400 that names it: `REFUSED` says, per field, which values this server cannot honour
and why (beam search is not built; ...); structured outputs and tools are mapped in serving/openai/structured_request.py
and serving/openai/tool_calls.py. A
field that no model lists is an error too (`extra="forbid"`): a typo or a newer OpenAI field must not be
accepted and then silently dropped. Response bodies are in serving/openai/responses.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from serving.openai.chat_options import ChatOptions
from serving.openai.structured_request import structured_outputs
from serving.openai.tool_calls import ToolSpec, tool_spec
from serving.router.client import GenerationError

# Request fields whose defaults may come from the model's generation_config.json (serving.openai.generation_config).
SUPPORTED_DEFAULTS = frozenset({"temperature", "top_p", "top_k", "max_tokens", "min_p", "repetition_penalty"})
MAX_LOGPROBS = 20  # OpenAI's limit for logprobs (completions) and top_logprobs (chat); vLLM's default too


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # vLLM's default: asking for stream_options at all asks for the usage chunk unless it says otherwise.
    include_usage: bool = True
    continuous_usage_stats: bool = False  # extension (vLLM): usage on every chunk


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # json_schema: read by serving/openai/structured_request.py
    type: str


def _off(value: Any) -> bool:
    return value is None or value is False


def _unset_or(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == a and type(value) is type(a) for a in allowed)


# Field -> (accepts(value), why other values are refused). Checked in order; the first refused field is named.
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "structural_tag": (_off, "structural tags are not supported: use response_format, guided_* or tools"),
    "guided_whitespace_pattern": (_off, "JSON outputs are generated without free whitespace; a pattern for it is "
                                        "not supported"),
    "use_beam_search": (_off, "beam search is not implemented"),
    "length_penalty": (_unset_or(1.0, 1), "it only applies to beam search, which is not implemented"),
    "best_of": (_unset_or(1), "as in vLLM's V1 engine, best_of > 1 is not supported: use n"),
    "suffix": (_off, "suffix (insertion) is not supported, as in vLLM"),
    "skip_special_tokens": (_unset_or(True), "special tokens are always skipped in the output text"),
    "spaces_between_special_tokens": (_unset_or(True), "special tokens are always skipped in the output text"),
    "priority": (_unset_or(0), "requests are scheduled first come, first served (no priorities)"),
    "logits_processors": (_off, "custom logits processors are not supported"),
    "kv_transfer_params": (_off, "disaggregated prefill is not supported"),
    "vllm_xargs": (_off, "no extension arguments are supported"),
    "prompt_embeds": (_off, "prompt embeddings are not supported"),
    "mm_processor_kwargs": (_off, "multimodal inputs are not supported"),
}


class _SamplingRequest(BaseModel):
    """The fields both endpoints share (vLLM's names, types and defaults, where vLLM has them)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own records: nothing to act on here
    request_id: str | None = None  # extension (vLLM): the response id is built from it
    cache_salt: str | None = None  # extension (vLLM): only requests with the same salt share prefix-cached KV
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # extension: keep the prompt's last k tokens
    # Logits processing (engine/sample/logits_params.py), lossless under speculation:
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI) -> bias in [-100, 100]
    min_tokens: int | None = None  # extension (vLLM)
    min_p: float | None = None  # extension (vLLM)
    allowed_token_ids: list[int] | None = None  # extension (vLLM)
    bad_words: list[str] | None = None  # extension (vLLM): tokenized by the front end (bad_words_token_ids)
    include_stop_str_in_output: bool = False  # extension (vLLM)
    # Refused unless unset or at their neutral value (REFUSED):
    best_of: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # Extension (vLLM): each prompt token's logprob, rank and this many most likely tokens (not with stream).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # completions: the prompt's text before the output; chat: refused
    response_format: ResponseFormat | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int | None = None
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool = False  # extension (vLLM): logprobs name tokens "token_id:N"
    return_token_ids: bool = False  # extension (vLLM): choices carry prompt_token_ids and token_ids
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    _structured: dict[str, Any] | None = PrivateAttr(default=None)  # StructuredOutputsParams fields, checked

    def check_supported(self) -> None:
        """Raise GenerationError(400) naming the first field whose value this server cannot honour."""
        for name, (accepts, why) in REFUSED.items():
            if name in type(self).model_fields and not accepts(getattr(self, name)):
                raise GenerationError(f"{name}={getattr(self, name)!r} is not supported: {why}", 400, name)
        if self.prompt_logprobs is not None and self.stream:
            # As vLLM: a streamed response has no field for them (completions' echo with logprobs, which lists
            # them in the choice's first chunk, streams).
            raise GenerationError("prompt_logprobs are not available when stream is true", 400, "prompt_logprobs")
        self._structured = structured_outputs(self, self.tool_spec())

    def tool_spec(self) -> ToolSpec | None:
        return None

    def sampling_params(self, max_tokens: int, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """Keyword arguments of engine.SamplingParams; the router validates them (ValueError -> 400).
        defaults: the model's generation_config.json settings, for what the request leaves unset (as vLLM's
        `--generation-config auto`); OpenAI's defaults otherwise."""
        defaults = defaults or {}

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        top_k = pick("top_k", 0)
        bias = None
        if self.logit_bias:
            try:
                bias = {int(token): value for token, value in self.logit_bias.items()}
            except ValueError as e:
                raise GenerationError("logit_bias keys must be token ids (integers, as strings)", 400,
                                      "logit_bias") from e
        return {"max_tokens": max_tokens, "temperature": pick("temperature", 1.0), "top_p": pick("top_p", 1.0),
                "top_k": 0 if top_k == -1 else top_k, "seed": self.seed, "stop": self.stop,
                "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
                "presence_penalty": pick("presence_penalty", 0.0), "frequency_penalty": pick("frequency_penalty", 0.0),
                "repetition_penalty": pick("repetition_penalty", 1.0), "min_p": pick("min_p", 0.0),
                "min_tokens": self.min_tokens or 0, "logit_bias": bias, "allowed_token_ids": self.allowed_token_ids,
                "include_stop_str_in_output": self.include_stop_str_in_output, "cache_salt": self.cache_salt,
                "structured_outputs": self._structured, "prompt_logprobs": self.prompt_logprobs}

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True  # extension (vLLM): the tokenizer's BOS etc. around a text prompt
    suffix: str | None = None
    prompt_embeds: str | list[str] | None = None  # extension (vLLM): refused (REFUSED)

    def sampling_params(self, max_tokens: int, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        params = {**super().sampling_params(max_tokens, defaults), "logprobs": self.logprobs}
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens are listed with their logprobs
            params["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return params

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one text or token list, or a batch of them (each gets n choices)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        for i, one in enumerate(batch):
            if not one:
                where = "prompt" if len(batch) == 1 else f"prompt.{i}"
                raise GenerationError(f"{where} is empty: give at least one token or character", 400, "prompt")
        return batch


class TextPart(BaseModel):
    # Other part types (image_url, input_audio, ...) carry their own fields: they parse, then check() refuses them
    # by their type.
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


# Message fields each role may carry besides role and content (OpenAI's message types; vLLM's names).
_ROLE_FIELDS = {"system": {"name"}, "developer": {"name"}, "user": {"name"},
                "assistant": {"name", "tool_calls", "refusal", "reasoning_content"}, "tool": {"tool_call_id"}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None

    def check(self, where: str) -> None:
        """Raise GenerationError(400) naming `where`.field for a message OpenAI's API would refuse."""
        for name in ("name", "tool_calls", "tool_call_id", "refusal", "reasoning_content"):
            if getattr(self, name) is not None and name not in _ROLE_FIELDS[self.role]:
                raise GenerationError(f"{where}.{name}: a {self.role} message has no field {name}", 400,
                                      f"{where}.{name}")
        if isinstance(self.content, list):
            for j, part in enumerate(self.content):
                if part.type != "text":
                    raise GenerationError(f"{where}.content.{j}.type: only text content parts are supported, "
                                          f"got {part.type!r}", 400, f"{where}.content.{j}.type")
                if part.model_extra:
                    name = sorted(part.model_extra)[0]
                    raise GenerationError(f"{where}.content.{j}.{name}: unknown field of a text part", 400,
                                          f"{where}.content.{j}.{name}")
                if part.text is None:
                    raise GenerationError(f"{where}.content.{j}.text: a text part needs its text", 400,
                                          f"{where}.content.{j}.text")
        if self.role == "tool" and self.tool_call_id is None:
            raise GenerationError(f"{where}.tool_call_id: a tool message needs the id of the call it answers",
                                  400, f"{where}.tool_call_id")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal)):
            raise GenerationError(f"{where}.content: a {self.role} message needs content", 400, f"{where}.content")

    def template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        extra = {k: v for k in ("name", "tool_calls", "tool_call_id", "reasoning_content")
                 if (v := getattr(self, k)) is not None}
        return {"role": self.role, "content": content if content is not None else "", **extra}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # without tools there is no call to parallelise
    # Passed to the chat template (GPT-OSS's renders "Reasoning: high"); a 400 for a template that does not read it
    # (serving/openai/tokenizer_routes.py).
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    include_reasoning: bool = True  # with the server's reasoning parser: false drops reasoning_content
    add_generation_prompt: bool = True  # extension (vLLM)
    continue_final_message: bool = False  # extension (vLLM)
    add_special_tokens: bool = False  # extension (vLLM): special tokens on top of the chat template's
    documents: list[dict[str, str]] | None = None  # extension (vLLM): for templates that take them (RAG)
    chat_template: str | None = None  # extension (vLLM): a Jinja template instead of the model's
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM)
    mm_processor_kwargs: dict[str, Any] | None = None  # extension (vLLM): refused (REFUSED)

    _tools: ToolSpec | None = PrivateAttr(default=None)
    _options: ChatOptions = PrivateAttr(default_factory=ChatOptions)  # the server's (use_options)

    def use_options(self, options: ChatOptions | None) -> None:
        """The server's chat settings (tool-call parser, auto tool choice, reasoning parser) for this request."""
        self._options = options or ChatOptions()
        self._tools = None

    @property
    def options(self) -> ChatOptions:
        return self._options

    def tool_spec(self) -> ToolSpec | None:
        """The request's tools and tool_choice, checked (GenerationError 400); None without tools."""
        if self._tools is None and self.tools:
            self._tools = tool_spec(self.tools, self.tool_choice, self.parallel_tool_calls,
                                    self._options.tool_parser(), self._options.enable_auto_tool_choice)
        elif not self.tools:
            tool_spec(None, self.tool_choice, self.parallel_tool_calls)
        return self._tools

    def check_supported(self) -> None:
        super().check_supported()
        for i, message in enumerate(self.messages):
            message.check(f"messages.{i}")
        if self.continue_final_message and self.add_generation_prompt:
            raise GenerationError("continue_final_message and add_generation_prompt cannot both be true", 400,
                                  "continue_final_message")
        if self.echo:
            raise GenerationError("echo is not supported for chat (it is for /v1/completions)", 400, "echo")
        if self.top_logprobs and not self.logprobs:
            raise GenerationError("top_logprobs needs logprobs=true", 400, "top_logprobs")

    def sampling_params(self, max_tokens: int, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**super().sampling_params(max_tokens, defaults),
                "logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of tokenizer.apply_chat_template besides the messages."""
        kwargs: dict[str, Any] = {**(self.chat_template_kwargs or {}),
                                  "add_generation_prompt": self.add_generation_prompt,
                                  "continue_final_message": self.continue_final_message}
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if getattr(self, "reasoning_effort", None) is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return kwargs


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a text prompt (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with chat messages, through the chat template (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    _options: ChatOptions = PrivateAttr(default_factory=ChatOptions)

    def use_options(self, options: ChatOptions | None) -> None:
        self._options = options or ChatOptions()

    @property
    def options(self) -> ChatOptions:
        return self._options

    def check_supported(self) -> None:
        self.tool_spec()
        for i, message in enumerate(self.messages):
            message.check(f"messages.{i}")
        if self.continue_final_message and self.add_generation_prompt:
            raise GenerationError("continue_final_message and add_generation_prompt cannot both be true", 400,
                                  "continue_final_message")

    template_kwargs = ChatCompletionRequest.template_kwargs

    def tool_spec(self) -> ToolSpec | None:
        """The tools as a chat request with tool_choice "auto" would render them (counting needs no choice)."""
        return tool_spec(self.tools, None, None, self._options.tool_parser()) if self.tools else None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
