"""Reasoning parsers by vLLM's `--reasoning-parser` names: a thinking model's `<think>...</think>` apart from its
answer, as `reasoning_content` beside `content`, whole or streamed.

qwen3: reasoning where the output opens with `<think>` (up to `</think>`, or to the end of an output cut while
thinking), or, whole outputs only, before a `</think>` whose `<think>` was the chat template's; otherwise everything
is content (thinking off). deepseek_r1: the model always thinks first, so
everything before `</think>` is reasoning, and an output cut before it is all reasoning.

Streamed, qwen3 treats text as reasoning once the output opens with `<think>` (it cannot know about a `</think>`
still to come otherwise); deepseek_r1 from the first token.

openai_gptoss: GPT-OSS's harmony format, whose analysis channel is the reasoning; its markers are special tokens
the text leaves out, so it is split from the output's token ids (serving/openai/harmony.py), reasoning, content and tool
calls at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from serving.openai.tool_parsers.base import partial_suffix

THINK, END_THINK = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: ClassVar[str]
    thinks_first: ClassVar[bool]  # reasoning from the first token, with or without <think>

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a finished output."""
        body = text.lstrip()
        opened = body.startswith(THINK)
        if opened:
            body = body[len(THINK):]
        end = body.find(END_THINK)
        if end < 0:
            return (body, "") if self.thinks_first or opened else (None, text)
        return body[:end], body[end + len(END_THINK):]


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    thinks_first = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    thinks_first = True


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    thinks_first = False

    def split(self, text: str) -> tuple[str | None, str]:
        raise NotImplementedError("harmony outputs are split from token ids (serving.openai.harmony.HarmonyStream)")


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (Qwen3ReasoningParser,
                                                                          DeepSeekR1ReasoningParser,
                                                                          GptOssReasoningParser)}
HARMONY_REASONING_PARSER = GptOssReasoningParser.name


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}")
    return REASONING_PARSERS[name]()


class ReasoningStream:
    """One streamed choice's text into (reasoning delta, content delta) pairs."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.buffer = ""
        self.state = "reasoning" if parser.thinks_first else "start"  # start | reasoning | content
        self.opened = False  # the leading <think>, if any, is consumed

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buffer += text
        reasoning = ""
        if self.state != "content" and not self.opened:
            stripped = self.buffer.lstrip()
            if stripped.startswith(THINK):
                self.buffer, self.state, self.opened = stripped[len(THINK):], "reasoning", True
            elif THINK.startswith(stripped) and not final:
                return "", ""  # may still open with <think>
            else:
                self.opened = True
                self.state = "reasoning" if self.parser.thinks_first else "content"
        if self.state == "reasoning":
            end = self.buffer.find(END_THINK)
            if end < 0:
                keep = 0 if final else partial_suffix(self.buffer, END_THINK)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer = self.buffer[:end], self.buffer[end + len(END_THINK):]
            self.state = "content"
        content, self.buffer = self.buffer, ""
        return reasoning, content
