"""Hermes-style calls (Qwen 2.5/3, SmolLM, Hermes, many fine-tunes): `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>` blocks, one per call, anywhere in the output."""

from __future__ import annotations

import json
import re
from typing import Any

from serving.openai.tool_parsers.base import Extracted, ParsedCall, ToolParser, call_object

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class HermesParser(ToolParser):
    name = "hermes"
    start_tokens = (OPEN,)
    format_hint = ('For each function call return a json object with function name and arguments within '
                   '<tool_call></tool_call> XML tags as follows:\n<tool_call>\n{"name": <function-name>, '
                   '"arguments": <args-json-object>}\n</tool_call>')

    def extract(self, markup: str, names: set[str], truncated: bool) -> Extracted:
        calls, rest, last = [], [], 0
        for m in _BLOCK.finditer(markup):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                obj = None
            call = call_object(obj.get("name"), obj.get("arguments", obj.get("parameters")), names) \
                if isinstance(obj, dict) else None
            if call is None:
                continue  # not a call of these tools: stays text
            calls.append(call)
            rest.append(markup[last:m.start()])
            last = m.end()
        tail = markup[last:]
        if truncated and (cut := tail.find(OPEN)) >= 0:
            tail = tail[:cut]  # an unclosed block cut by max_tokens is markup, not content
        rest.append(tail)
        return Extracted("".join(rest), calls)

    def grammar(self, calls: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        call = {"anyOf": [_call_schema(n, p) for n, p in calls]} if len(calls) > 1 else _call_schema(*calls[0])
        call["x-guidance"] = {"whitespace_flexible": False}
        start = 'call ("\\n" call)*' if parallel else "call"
        return (f"start: {start}\n"
                f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
                f"body: %json {json.dumps(call)}\n")

    def format_calls(self, calls: list[ParsedCall]) -> str:
        return "\n".join(f"{OPEN}\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n{CLOSE}"
                         for c in calls)


def _call_schema(name: str, parameters: dict[str, Any], key: str = "arguments") -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, key: parameters},
            "required": ["name", key], "additionalProperties": False}
