"""Tool-call parsers by vLLM's `--tool-call-parser` names: each reads one model family's call markup and gives the
grammar that makes a forced call come out in it (serving/openai/tool_parsers/base.py). `openai` is GPT-OSS's harmony
format, read from token ids (serving/openai/harmony.py)."""

from __future__ import annotations

from serving.openai.tool_parsers.base import Extracted, ParsedCall, ToolParser
from serving.openai.tool_parsers.harmony import HarmonyToolParser
from serving.openai.tool_parsers.hermes import HermesParser
from serving.openai.tool_parsers.llama3_json import Llama3JsonParser
from serving.openai.tool_parsers.mistral import MistralParser
from serving.openai.tool_parsers.pythonic import PythonicParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                                  PythonicParser, HarmonyToolParser)}
DEFAULT_TOOL_PARSER = "hermes"  # the bundled SmolLM2 pair's (and Qwen's) markup


def get_tool_parser(name: str) -> ToolParser:
    """The parser of this name; ValueError naming the ones there are."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[name]()


__all__ = ["DEFAULT_TOOL_PARSER", "TOOL_PARSERS", "Extracted", "ParsedCall", "ToolParser", "get_tool_parser"]
