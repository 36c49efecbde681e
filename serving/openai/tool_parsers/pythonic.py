"""Pythonic calls (Llama 3.2/4 "pythonic", Llama-3.2 small models, ToolACE): the whole output is a Python list of
calls with keyword arguments, `[get_weather(city="Paris"), get_time(zone="CET")]`. Argument values are Python
literals; JSON's true/false/null are read too (a forced call's values are generated as JSON)."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from serving.openai.tool_parsers.base import Extracted, ParsedCall, ToolParser, lark_literal

_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicParser(ToolParser):
    name = "pythonic"
    anywhere = False
    start_tokens = ("[",)
    format_hint = ('To call functions, respond only with a Python list of calls with keyword arguments, e.g. '
                   '[func_name1(param1=value1, param2=value2), func_name2(param=value)].')

    def extract(self, markup: str, names: set[str], truncated: bool) -> Extracted:
        try:
            tree = ast.parse(markup.strip(), mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                raise ValueError("not a list of calls")
            calls = [_call(node, names) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError):
            # Text after all, unless max_tokens cut what opens a call (then the unfinished markup is dropped).
            return Extracted("" if truncated and _opens_call(markup, names) else markup, [])
        return Extracted("", calls)

    def grammar(self, calls: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        rules = []
        for i, (name, params) in enumerate(calls):
            props = params.get("properties") or {}
            required = [k for k in props if k in set(params.get("required", []))]
            optional = [k for k in props if k not in required]
            for j, key in enumerate(props):
                schema = props[key] if isinstance(props[key], dict) else {}
                rules.append(f"a{i}_{j}: {lark_literal(key + '=')} %json "
                             f"{json.dumps({**schema, 'x-guidance': {'whitespace_flexible': False}})}")
            idx = {k: j for j, k in enumerate(props)}
            arg = [f"a{i}_{idx[k]}" for k in props]
            sep = '", "'
            if required:
                body = f" {sep} ".join(arg[idx[k]] for k in required)
                body += "".join(f" ({sep} {arg[idx[k]]})?" for k in optional)
            elif optional:  # any subset, in order: the first present one, then optional others after it
                alts = [arg[idx[k]] + "".join(f" ({sep} {arg[idx[o]]})?" for o in optional[n + 1:])
                        for n, k in enumerate(optional)]
                body = "(" + " | ".join(alts) + ")?"
            else:
                body = ""
            rules.append(f"c{i}: {lark_literal(name + '(')} {body} \")\"")
        start = 'call (", " call)*' if parallel else "call"
        return "\n".join([f'start: "[" {start} "]"', "call: " + " | ".join(f"c{i}" for i in range(len(calls))),
                          *rules]) + "\n"

    def format_calls(self, calls: list[ParsedCall]) -> str:
        return "[" + ", ".join(f"{c.name}(" + ", ".join(f"{k}={v!r}" for k, v in c.arguments.items()) + ")"
                               for c in calls) + "]"


def _call(node: ast.expr, names: set[str]) -> ParsedCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.func.id not in names \
            or node.args:
        raise ValueError("not a keyword call of one of the tools")
    return ParsedCall(node.func.id, {kw.arg: _value(kw.value) for kw in node.keywords if kw.arg is not None})


def _value(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.Dict):
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values) if k is not None}
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(e) for e in node.elts]
    value = ast.literal_eval(node)
    if value is not None and not isinstance(value, str | int | float | bool):  # sets, bytes, complex: not JSON
        raise ValueError(f"a {type(value).__name__} argument has no JSON form")
    return value


def _opens_call(text: str, names: set[str]) -> bool:
    """Whether `text` is the start of a call list: `[` then a tool's name (or the start of one) and, once the name
    is whole, `(`."""
    m = re.match(r"\s*\[\s*([A-Za-z_]\w*)?(\s*\()?", text)
    if m is None:
        return False
    name, paren = m.group(1) or "", m.group(2)
    if paren:
        return name in names
    return m.end() == len(text) and any(n.startswith(name) for n in names)
