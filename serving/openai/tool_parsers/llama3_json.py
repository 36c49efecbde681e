"""Llama 3.1/3.2/3.3 JSON calls: the whole output is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `; `."""

from __future__ import annotations

import json
import re
from typing import Any

from serving.openai.tool_parsers.base import Extracted, ParsedCall, ToolParser, call_object, json_values
from serving.openai.tool_parsers.hermes import _call_schema

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    anywhere = False
    start_tokens = (PYTHON_TAG, "{")
    format_hint = ('To call a function, respond only with a JSON object of the form {"name": function name, '
                   '"parameters": dictionary of argument name and its value}; several calls separated by "; ".')

    def extract(self, markup: str, names: set[str], truncated: bool) -> Extracted:
        body = markup.lstrip()
        body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
        values, tail = json_values(body, ";")
        calls = [call_object(v.get("name"), v.get("parameters", v.get("arguments")), names)
                 if isinstance(v, dict) else None for v in values]
        if not values or None in calls or (tail.strip() and not truncated):
            # Not (only) calls: text after all, unless max_tokens cut what opens a call (then the unfinished markup
            # is dropped).
            found = [c for c in calls if c] if truncated else []
            opens = markup.lstrip().startswith(PYTHON_TAG) or _opens_call(body)
            return Extracted("" if truncated and (found or opens) else markup, found)
        return Extracted("", [c for c in calls if c is not None])

    def grammar(self, calls: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        call = {"anyOf": [_call_schema(n, p, "parameters") for n, p in calls]} if len(calls) > 1 else \
            _call_schema(*calls[0], "parameters")
        call["x-guidance"] = {"whitespace_flexible": False}
        start = 'call ("; " call)*' if parallel else "call"
        return f"start: {start}\ncall: %json {json.dumps(call)}\n"

    def format_calls(self, calls: list[ParsedCall]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


def _opens_call(body: str) -> bool:
    """Whether `body` is the start of a call object: `{"name":`, or a cut-off beginning of it."""
    if re.match(r'\{\s*"name"\s*:', body):
        return True
    compact = re.sub(r"\s+", "", body)
    return bool(compact) and '{"name":'.startswith(compact)
