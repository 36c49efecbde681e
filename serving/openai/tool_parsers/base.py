"""What every tool-call parser does: find a model family's call markup in generated text, turn it into calls, and
give the Lark grammar (llguidance's dialect, with `%json` for the arguments) that makes a forced call come out in
that markup and then end.

A parser is stateless: the streaming split (serving/openai/tool_calls.py ToolCallStream) asks it where markup starts and
how much of a text's tail it must hold back, and parses the held markup once the output is finished.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedCall:
    name: str  # one of the request's tools
    arguments: dict[str, Any]  # the decoded arguments object


@dataclass(frozen=True)
class Extracted:
    """A finished output's markup: the calls in it and the text around them that is content."""

    content: str
    calls: list[ParsedCall]


def partial_suffix(text: str, token: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `token`."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def call_object(name: str, arguments: Any, names: set[str]) -> ParsedCall | None:
    """A call when `name` is one of the tools and the arguments decode to an object (JSON text or a dict)."""
    if not isinstance(name, str) or name not in names:  # the model may write any JSON value there
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    return ParsedCall(name, arguments) if isinstance(arguments, dict) else None


def json_values(text: str, separators: str) -> tuple[list[Any], str]:
    """Consecutive JSON values at the start of `text`, with `separators` characters (and whitespace) between
    them; returns the values and the text left after the last one that decoded."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        start = pos
        while start < len(text) and (text[start].isspace() or (values and text[start] in separators)):
            start += 1
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            return values, text[pos:]
        values.append(value)
        pos = end


def lark_literal(text: str) -> str:
    """A Lark string literal of `text` (Lark's literals take JSON's escapes)."""
    return json.dumps(text)


class ToolParser:
    """One family's markup. `anywhere`: markup may begin after content (Hermes, Mistral); otherwise only at the
    start of the output (after whitespace), and an output that starts otherwise holds no calls."""

    name: ClassVar[str]
    anywhere: ClassVar[bool] = True
    start_tokens: ClassVar[tuple[str, ...]] = ()  # texts that open markup

    def find_start(self, text: str) -> tuple[int | None, int]:
        """(index where markup starts, or None; length of the tail to hold back because it may open markup)."""
        if self.anywhere:
            found = [i for t in self.start_tokens if (i := text.find(t)) >= 0]
            if found:
                return min(found), 0
            return None, max(partial_suffix(text, t) for t in self.start_tokens)
        stripped = text.lstrip()
        offset = len(text) - len(stripped)
        if not stripped:
            return None, len(text)
        if any(stripped.startswith(t) for t in self.start_tokens):
            return offset, 0
        if any(t.startswith(stripped) for t in self.start_tokens):
            return None, len(text)
        return None, 0

    def extract(self, markup: str, names: set[str], truncated: bool) -> Extracted:
        """The calls in `markup` (text from where find_start found markup to the output's end) and the content
        left. truncated: the output was cut (max_tokens); an unfinished call is dropped, never content."""
        raise NotImplementedError

    def grammar(self, calls: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        """A Lark grammar whose every match is one call (several when parallel) of these (name, parameters
        schema) pairs in this family's markup, and nothing after it: the output ends once it closes."""
        raise NotImplementedError

    def format_calls(self, calls: list[ParsedCall]) -> str:
        """Earlier calls of the conversation as this family writes them (for templates that ignore tools)."""
        raise NotImplementedError

    format_hint: ClassVar[str] = ""  # how to call, for the system prompt of a template that ignores tools
