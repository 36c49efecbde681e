"""Tool calling: the request's tools into the prompt, `required` and named choices into a grammar, and the model's
call markup back out as OpenAI `tool_calls`, in the family's format the server's tool-call parser reads
(serving/openai/tool_parsers/: hermes, llama3_json, mistral, pythonic).

Prompt: the tools go to the chat template (`apply_chat_template(..., tools=...)`, as transformers passes them).
A template that ignores them (it renders the same text with and without: SmolLM2's and Gemma 3's do) gets a
system prompt listing the tools' schemas and the parser's call format instead, and the conversation's earlier
calls and results are rendered in that format (results as `<tool_response>` blocks).

Output: with `tool_choice` "required" or a named function, a grammar makes the output one call (named: that
function; required: any of the tools; several, each complete, when parallel_tool_calls allows) whose arguments
follow the tool's `parameters` schema, strict by default (serving/openai/json_schema_strictness.py), and then only the
end of the output. With "auto" (which needs the server's enable_auto_tool_choice, as in vLLM) the model may call
or answer; its markup is parsed out if it emits it. "none" leaves the tools out of the prompt. Call markup never
reaches `content`: an unfinished call cut by max_tokens is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from serving.openai.json_schema_strictness import disallow_additional_properties
from serving.openai.tool_parsers import DEFAULT_TOOL_PARSER, ParsedCall, ToolParser, get_tool_parser
from serving.router.client import GenerationError

SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n{format_hint}")


@dataclass
class ToolSpec:
    """The request's tools and its choice among them, checked."""

    functions: dict[str, dict[str, Any]]  # name -> the OpenAI function object (name, description, parameters)
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function a named choice forces
    parallel: bool = True
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the request gave them (for the template)
    parser: ToolParser = field(default_factory=lambda: get_tool_parser(DEFAULT_TOOL_PARSER))
    strict: bool = True  # forced calls' arguments: no properties their schema does not list

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"


def tool_spec(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
              parallel_tool_calls: bool | None, parser: ToolParser | None = None,
              auto_allowed: bool = True) -> ToolSpec | None:
    """Check tools and tool_choice (400 naming the field); None when the request has no tools. auto_allowed:
    the server's enable_auto_tool_choice (a request left to choose, "auto" or tool_choice unset, is a 400 without
    it, as vLLM answers)."""
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
    if choice == "auto" and not auto_allowed:
        raise GenerationError('tool_choice "auto" (the default with tools) needs a server started with '
                              "--enable-auto-tool-choice and --tool-call-parser; give 'required', 'none' or a "
                              "function", 400, "tool_choice")
    return ToolSpec(functions, choice, named, parallel_tool_calls is not False, list(tools),
                    parser or get_tool_parser(DEFAULT_TOOL_PARSER))


def tool_grammar(spec: ToolSpec) -> str | None:
    """A Lark grammar (llguidance's) that forces the choice's calls in the parser's markup; None for auto/none."""
    if spec.choice == "named":
        assert spec.named is not None
        names = [spec.named]
    elif spec.choice == "required":
        names = list(spec.functions)
    else:
        return None
    calls = []
    for name in names:
        fn = spec.functions[name]
        params = fn["parameters"]
        # A tool's own `strict` (OpenAI's structured outputs) decides for it; else the request's default.
        if (fn["strict"] if isinstance(fn.get("strict"), bool) else spec.strict):
            try:
                params = disallow_additional_properties(params)
            except RecursionError as e:
                raise GenerationError(f"the parameters of tool {name!r} nest too deep", 400, "tools") from e
        calls.append((name, params))
    return spec.parser.grammar(calls, spec.choice == "required" and spec.parallel)


def render_messages(messages: list[dict[str, Any]], spec: ToolSpec | None, template_ignores_tools: bool
                    ) -> list[dict[str, Any]]:
    """The messages for a template that ignores tools: a system prompt listing the tools and the parser's call
    format first (merged with the conversation's own system message), earlier calls in the parser's markup and
    their results as `<tool_response>` blocks."""
    if spec is None or not template_ignores_tools:
        return messages
    out = []
    listing = "\n".join(json.dumps({"type": "function", "function": fn}) for fn in spec.functions.values())
    system = SYSTEM_PROMPT.format(tools=listing, format_hint=spec.parser.format_hint)
    if messages and messages[0]["role"] in ("system", "developer"):
        system = messages[0]["content"] + "\n\n" + system
        messages = messages[1:]
    out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function", {})
                args = fn.get("arguments", "{}")
                args = json.loads(args) if isinstance(args, str) and args.strip() else args
                calls.append(ParsedCall(fn.get("name"), args if isinstance(args, dict) else {}))
            markup = spec.parser.format_calls(calls)
            out.append({"role": "assistant", "content": ((m.get("content") or "") + markup).strip()})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    return out


def _openai_call(call: ParsedCall) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


def parse_tool_calls(text: str, spec: ToolSpec, truncated: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished output: the parser's calls naming one of the tools; the rest of the
    text is the content (None when calls left nothing else). truncated: cut by max_tokens, so an unfinished
    call is dropped instead of becoming content."""
    stream = ToolCallStream(spec)
    content, calls = stream.feed(text, final=True, truncated=truncated)
    for c in calls:
        c.pop("index")
    content = content.strip() if calls else content
    return (content or None) if calls else content, calls


class ToolCallStream:
    """One streamed choice's text split into content deltas and `delta.tool_calls` chunks.

    Text streams as content until the parser sees call markup begin (a tail that may be the start of it is held
    until it is not); from there the text is held, and the output's end parses it: its calls as tool-call
    chunks (per call, its index, id, type and name, then its arguments as one fragment: the client's
    concatenation equals the non-streamed arguments) and any text around them as content. Held text that holds
    no calls is content after all, unless max_tokens cut it: then it is an unfinished call, and dropped.
    """

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.parser = spec.parser
        self.names = set(spec.functions)
        self.buffer = ""
        self.state = "text"  # text | markup | plain (markup can no longer start: a parser that reads from the start)
        self.num_calls = 0

    def feed(self, text: str, final: bool = False, truncated: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """New text in; (content to send now, tool-call deltas to send now) out. final: the output ended
        (truncated: by max_tokens)."""
        self.buffer += text
        content = ""
        if self.state == "text":
            start, hold = self.parser.find_start(self.buffer)
            if start is not None:
                content, self.buffer, self.state = self.buffer[:start], self.buffer[start:], "markup"
            else:
                keep = 0 if final else hold
                content, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                if not self.parser.anywhere and not keep and content.strip():
                    self.state = "plain"
        elif self.state == "plain":
            content, self.buffer = self.buffer, ""
        if self.state != "markup" or not final:
            return content, []
        found = self.parser.extract(self.buffer, self.names, truncated)
        self.buffer = ""
        calls = []
        for call in found.calls:
            calls.append({"index": self.num_calls, **_openai_call(call)})
            self.num_calls += 1
        # Whitespace between and around calls is not content (as the whole response's content is stripped).
        return content + (found.content if found.content.strip() or not calls else ""), calls
