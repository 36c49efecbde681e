"""Mistral calls: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}` (tokenizers before v11),
or `[TOOL_CALLS]name[ARGS]{...}` per call (v11 and later). `[TOOL_CALLS]` is a special token: the output must be
detokenized with it kept for this parser to see it."""

from __future__ import annotations

import json
from typing import Any

from serving.openai.tool_parsers.base import Extracted, ParsedCall, ToolParser, call_object, json_values
from serving.openai.tool_parsers.hermes import _call_schema

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(ToolParser):
    name = "mistral"
    start_tokens = (TOOL_CALLS,)
    format_hint = ('To call functions, respond with [TOOL_CALLS] followed by a JSON list of objects '
                   '{"name": function name, "arguments": arguments object}.')

    def extract(self, markup: str, names: set[str], truncated: bool) -> Extracted:
        calls: list[ParsedCall] = []
        for part in markup.split(TOOL_CALLS)[1:]:
            part = part.strip()
            if ARGS in part and not part.startswith("["):  # v11: name[ARGS]{...}
                name, _, rest = part.partition(ARGS)
                values, _ = json_values(rest, "")
                call = call_object(name.strip(), values[0], names) if values else None
                if call is not None:
                    calls.append(call)
                elif not truncated:
                    return Extracted(markup, [])
                continue
            values, tail = json_values(part, "")
            items = values[0] if values and isinstance(values[0], list) else None
            found = [call_object(v.get("name"), v.get("arguments"), names) if isinstance(v, dict) else None
                     for v in items or []]
            if items is None or None in found:
                if truncated:
                    continue  # an unfinished array: dropped
                return Extracted(markup, [])
            calls.extend(c for c in found if c is not None)
        return Extracted("", calls)

    def grammar(self, calls: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        item = {"anyOf": [_call_schema(n, p) for n, p in calls]} if len(calls) > 1 else _call_schema(*calls[0])
        array: dict[str, Any] = {"type": "array", "items": item, "minItems": 1,
                                 "x-guidance": {"whitespace_flexible": False}}
        if not parallel:
            array["maxItems"] = 1
        return f'start: "{TOOL_CALLS}" calls\ncalls: %json {json.dumps(array)}\n'

    def format_calls(self, calls: list[ParsedCall]) -> str:
        return TOOL_CALLS + json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])
