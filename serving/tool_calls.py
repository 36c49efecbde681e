"""Tool calling: the request's tools into the prompt, `required` and named choices into a grammar, and the model's
Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks back out as OpenAI `tool_calls`.

Prompt: the tools go to the chat template (`apply_chat_template(..., tools=...)`, as transformers passes them).
A template that ignores them (it renders the same text with and without: SmolLM2's and Gemma 3's do) gets a
Hermes-style system prompt listing the tools' schemas and the call format instead, and the conversation's earlier
calls and results are rendered as `<tool_call>` / `<tool_response>` blocks.

Output: with `tool_choice` "required" or a named function, a grammar makes the output one call (named: that
function; required: any of the tools, several calls unless parallel_tool_calls is false) whose arguments follow
the tool's `parameters` schema. With "auto" the model may call or answer; its `<tool_call>` blocks are parsed out
if it emits them. "none" leaves the tools out of the prompt.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from serving.router_client import GenerationError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function "
    "call return a json object with function name and arguments within <tool_call></tool_call> XML tags as "
    'follows:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass
class ToolSpec:
    """The request's tools and its choice among them, checked."""

    functions: dict[str, dict[str, Any]]  # name -> the OpenAI function object (name, description, parameters)
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function a named choice forces
    parallel: bool = True
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the request gave them (for the template)

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"


def tool_spec(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
              parallel_tool_calls: bool | None) -> ToolSpec | None:
    """Check tools and tool_choice (400 naming the field); None when the request has no tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise GenerationError("tool_choice needs tools", 400, "tool_choice")
        return None
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise GenerationError(f"tools.{i}: only tools of type 'function' with a 'function' object are "
                                  "supported", 400, f"tools.{i}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise GenerationError(f"tools.{i}.function.name must be 1-64 letters, digits, '_', '.' or '-'", 400,
                                  f"tools.{i}.function.name")
        if name in functions:
            raise GenerationError(f"tools.{i}.function.name: {name!r} is given twice", 400, f"tools.{i}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}, "additionalProperties": False})
        if not isinstance(params, dict):
            raise GenerationError(f"tools.{i}.function.parameters must be a JSON schema object", 400,
                                  f"tools.{i}.function.parameters")
        functions[name] = {**fn, "parameters": params}
    choice, named = tool_choice if tool_choice is not None else "auto", None
    if isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(named, str) or named not in functions:
            raise GenerationError(f"tool_choice names {named!r}, which is not one of the tools", 400, "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise GenerationError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}", 400,
                              "tool_choice")
    return ToolSpec(functions, choice, named, parallel_tool_calls is not False, list(tools))


def _call_schema(name: str, fn: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": fn["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(spec: ToolSpec) -> str | None:
    """A Lark grammar (llguidance's, with %json for the calls) that forces the choice's calls; None for auto/none."""
    if spec.choice == "named":
        assert spec.named is not None
        schema = _call_schema(spec.named, spec.functions[spec.named])
    elif spec.choice == "required":
        schema = {"anyOf": [_call_schema(n, fn) for n, fn in spec.functions.items()]}
    else:
        return None
    schema["x-guidance"] = {"whitespace_flexible": False}  # as structured_output.JSON_OPTIONS, for %json
    calls = 'call ("\\n" call)*' if spec.choice == "required" and spec.parallel else "call"
    return (f"start: {calls}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {json.dumps(schema)}\n")


def render_messages(messages: list[dict[str, Any]], spec: ToolSpec | None, template_ignores_tools: bool
                    ) -> list[dict[str, Any]]:
    """The messages for a template that ignores tools: the Hermes system prompt first (merged with the
    conversation's own system message), earlier calls and results as Hermes blocks."""
    if spec is None or not template_ignores_tools:
        return messages
    out = []
    listing = "\n".join(json.dumps({"type": "function", "function": fn}) for fn in spec.functions.values())
    system = HERMES_SYSTEM.format(tools=listing)
    if messages and messages[0]["role"] in ("system", "developer"):
        system = messages[0]["content"] + "\n\n" + system
        messages = messages[1:]
    out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = []
            for call in m["tool_calls"]:
                fn = call.get("function", {})
                args = fn.get("arguments", "{}")
                args = json.loads(args) if isinstance(args, str) and args.strip() else args
                blocks.append(f"{OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': args})}\n{CLOSE}")
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n".join(blocks)).strip()})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    return out


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _parse_block(body: str, spec: ToolSpec) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in spec.functions:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return _call(obj["name"], args if args is not None else {})


def parse_tool_calls(text: str, spec: ToolSpec) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished output: every well-formed `<tool_call>` block naming one of the tools
    becomes a call; the rest of the text is the content (None when nothing else is left)."""
    calls, rest, last = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _parse_block(m.group(1), spec)
        if call is None:
            continue
        calls.append(call)
        rest.append(text[last:m.start()])
        last = m.end()
    rest.append(text[last:])
    content = "".join(rest).strip()
    return (content or None) if calls else text, calls


class ToolCallStream:
    """One streamed choice's text split into content deltas and `delta.tool_calls` chunks.

    Text outside blocks streams as content, except a tail that may be the start of `<tool_call>` (held until it
    is not). A block streams once it is closed: one chunk with its index, id, type and name and its arguments as
    a first fragment; the client's concatenation of the fragments equals the non-streamed arguments.
    """

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.buffer = ""
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """New text in; (content to send now, tool-call deltas to send now) out."""
        self.buffer += text
        content, calls = "", []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buffer, OPEN)
                content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                content += self.buffer[:start]
                self.buffer = self.buffer[start:]
                if final:  # an unclosed block at the end: it was text after all
                    content += self.buffer
                    self.buffer = ""
                break
            call = _parse_block(self.buffer[start + len(OPEN):end].strip(), self.spec)
            if call is None:
                content += self.buffer[:end + len(CLOSE)]
            else:
                content += self.buffer[:start]
                calls.append({"index": self.num_calls, **call})
                self.num_calls += 1
            self.buffer = self.buffer[end + len(CLOSE):]
        return content, calls


def _partial_suffix(text: str, token: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `token`."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0
