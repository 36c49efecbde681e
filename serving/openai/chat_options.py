"""The server's chat settings, vLLM's flags of the same names: `--enable-auto-tool-choice`, `--tool-call-parser`,
`--chat-template` and `--reasoning-parser` (deploy.config.ServeConfig's fields; docs/tool_calling.md).

GPT-OSS speaks the harmony format (serving/openai/harmony.py): a tokenizer with harmony's special tokens turns it on
whatever the parser flags say (the other parsers read markup its outputs never hold), and its vLLM names
(`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`) ask for it, refused for a tokenizer without
those tokens."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.openai.harmony import HarmonyTokens
from serving.openai.reasoning_parser import HARMONY_REASONING_PARSER, ReasoningParser, get_reasoning_parser
from serving.openai.tool_parsers import DEFAULT_TOOL_PARSER, ToolParser, get_tool_parser
from serving.openai.tool_parsers.harmony import HarmonyToolParser


def load_chat_template(value: str) -> str:
    """A chat template given as a file path or inline (as vLLM takes --chat-template): the file's text when the
    path exists, the text itself when it looks like a template; ValueError for a path that does not exist."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a long inline template is not a valid path on some systems
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")


@dataclass(frozen=True)
class ChatOptions:
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (the default with tools) served; else a 400
    tool_call_parser: str = DEFAULT_TOOL_PARSER  # the markup forced calls take and outputs are parsed for
    chat_template: str | None = None  # the template's text (load_chat_template), replacing the model's
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1 | openai_gptoss: reasoning_content apart; None: off
    harmony: HarmonyTokens | None = None  # the tokenizer's harmony tokens when outputs are harmony (for_tokenizer)

    def __post_init__(self) -> None:
        get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)

    @classmethod
    def create(cls, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
               chat_template: str | None = None, reasoning_parser: str | None = None) -> ChatOptions:
        """From the configuration's values: a template path is read here, a parser name checked."""
        return cls(bool(enable_auto_tool_choice), tool_call_parser or DEFAULT_TOOL_PARSER,
                   load_chat_template(chat_template) if chat_template else None, reasoning_parser or None)

    @property
    def asks_harmony(self) -> bool:
        return self.tool_call_parser == HarmonyToolParser.name or self.reasoning_parser == HARMONY_REASONING_PARSER

    def for_tokenizer(self, tokenizer: Any) -> ChatOptions:
        """These options for the served tokenizer: harmony on when it has harmony's tokens; ValueError when a
        harmony parser is named for a tokenizer without them."""
        tokens = HarmonyTokens.of(tokenizer) if tokenizer is not None else None
        if tokens is None and self.asks_harmony:
            raise ValueError("tool_call_parser 'openai' and reasoning_parser 'openai_gptoss' read GPT-OSS's harmony "
                             "format, but the tokenizer has no harmony tokens (<|start|>, <|channel|>, <|message|>, "
                             "<|end|>, <|return|>, <|call|>, <|constrain|>)")
        return dataclasses.replace(self, harmony=tokens)

    def tool_parser(self) -> ToolParser:
        return HarmonyToolParser() if self.harmony is not None else get_tool_parser(self.tool_call_parser)

    def reasoning(self) -> ReasoningParser | None:
        if self.harmony is not None:
            return get_reasoning_parser(HARMONY_REASONING_PARSER)
        return get_reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None
