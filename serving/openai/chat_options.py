"""The server's chat settings, vLLM's flags of the same names: `--enable-auto-tool-choice`, `--tool-call-parser`,
`--chat-template` and `--reasoning-parser` (deploy.config.ServeConfig's fields; docs/tool_calling.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from serving.openai.reasoning_parser import ReasoningParser, get_reasoning_parser
from serving.openai.tool_parsers import DEFAULT_TOOL_PARSER, ToolParser, get_tool_parser


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
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1: reasoning_content apart from content; None: off

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

    def tool_parser(self) -> ToolParser:
        return get_tool_parser(self.tool_call_parser)

    def reasoning(self) -> ReasoningParser | None:
        return get_reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None
