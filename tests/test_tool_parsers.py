"""Tool-call parsers on their families' markup, their forced-call grammars (every output a grammar allows parses
back into complete calls), the streamed split, schema strictness, the bounded json_object and the reasoning
parsers. No server: tests/openai_parity/test_tool_clients.py serves them to real clients."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from byte_models import byte_tokenizer

from engine.sample.structured_output import StructuredOutputsParams, bounded_json_object
from serving.openai.chat_options import ChatOptions, load_chat_template
from serving.openai.json_schema_strictness import disallow_additional_properties
from serving.openai.reasoning_parser import ReasoningStream, get_reasoning_parser
from serving.openai.tool_calls import ToolCallStream, parse_tool_calls, tool_grammar, tool_spec
from serving.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from serving.router.client import GenerationError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]

# Each family's markup as its models write it: (output, content, [(name, arguments)]).
FAMILY_OUTPUTS = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
         [("get_weather", {"city": "Paris"})]),
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check.",
         [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]),
        ("It is sunny.", "It is sunny.", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
         '"parameters": {}}', None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
        ('It is {"hot": true} today.', 'It is {"hot": true} today.', []),
        ('{"temperature": 21}', '{"temperature": 21}', []),  # JSON that is not a call stays content
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
         '"arguments": {}}]', None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', None, [("get_weather", {"city": "Rome"})]),
        ("No call here.", "No call here.", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="c"), get_time()]', None,
         [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]),
        ("[get_weather(city='Lima')]", None, [("get_weather", {"city": "Lima"})]),
        ("[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
    ],
}


# The parsers that read text; `openai` (GPT-OSS's harmony) reads token ids: tests/test_harmony.py.
TEXT_PARSERS = sorted(set(TOOL_PARSERS) - {"openai"})


def _spec(parser: str, choice: str | dict = "auto", parallel: bool | None = None, tools: list | None = None):
    return tool_spec(tools or TOOLS, choice, parallel, get_tool_parser(parser))


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser", sorted(FAMILY_OUTPUTS))
def test_parser_reads_its_family_markup_whole_and_streamed(parser: str) -> None:
    assert set(FAMILY_OUTPUTS) == set(TEXT_PARSERS)
    spec = _spec(parser)
    for text, content, calls in FAMILY_OUTPUTS[parser]:
        got_content, got_calls = parse_tool_calls(text, spec)
        assert (got_content, _calls(got_calls)) == (content, calls), text
        # Streamed in small pieces: the same content and calls, and no markup ever sent as content.
        stream, streamed, deltas = ToolCallStream(spec), "", []
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        for i, piece in enumerate(pieces):
            c, d = stream.feed(piece, final=i == len(pieces) - 1)
            streamed += c
            deltas += d
        assert _calls(deltas) == calls and [d["index"] for d in deltas] == list(range(len(calls)))
        assert streamed.strip() == (content or ""), text


@pytest.mark.parametrize("parser", sorted(FAMILY_OUTPUTS))
def test_output_cut_by_max_tokens_keeps_no_markup(parser: str) -> None:
    spec = _spec(parser)
    text, _, calls = FAMILY_OUTPUTS[parser][0]
    whole = parser == "hermes" and text + "\n<tool_call>\n{\"name\": \"get_ti"  # a complete call, then a cut one
    cut = whole or text[:len(text) - 4]
    content, got = parse_tool_calls(cut, spec, truncated=True)
    assert _calls(got) == (calls if whole else []) and not content, (cut, content)
    streamed = ToolCallStream(spec).feed(cut, final=True, truncated=True)
    assert not streamed[0] and _calls(streamed[1]) == _calls(got)
    # The same text not cut: an unfinished call is text after all (what a model wrote that is no call).
    assert parse_tool_calls(cut, spec)[0]


def _sample(grammar: str, seed: int, max_len: int = 600) -> str:
    """An output the grammar allows: random tokens under its mask, EOS once complete (half the time)."""
    import llguidance
    import llguidance.hf

    tok = byte_tokenizer()
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok)), grammar)
    rng, out = random.Random(seed), []
    for _ in range(max_len):
        mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = [t for t in np.flatnonzero(mask[:len(tok)]).tolist()]
        if tok.eos_token_id in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return tok.decode(out)
        token = rng.choice([t for t in allowed if t != tok.eos_token_id])
        assert matcher.consume_token(token)
        out.append(token)
    raise AssertionError(f"no end after {max_len} tokens: {tok.decode(out)!r}")


ARGS = {"type": "object", "properties": {"c": {"enum": ["r", "g"]}, "n": {"type": "integer", "minimum": 0,
        "maximum": 9}, "ok": {"type": "boolean"}}, "required": ["c"]}  # no additionalProperties: strict adds it
GRAMMAR_TOOLS = [{"type": "function", "function": {"name": "paint", "parameters": ARGS}},
                 {"type": "function", "function": {"name": "stop", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("parser", TEXT_PARSERS)
@pytest.mark.parametrize("choice, parallel", [({"type": "function", "function": {"name": "paint"}}, None),
                                              ("required", False), ("required", True)])
def test_forced_call_grammar_ends_and_parses_back(parser: str, choice: str | dict, parallel: bool | None) -> None:
    spec = _spec(parser, choice, parallel, GRAMMAR_TOOLS)
    grammar = tool_grammar(spec)
    for seed in range(6):
        text = _sample(StructuredOutputsParams(grammar=grammar).to_grammar(), seed)
        content, calls = parse_tool_calls(text, spec)
        assert calls and content is None, text
        if not parallel:
            assert len(calls) == 1, text
        for name, args in _calls(calls):
            assert name == "paint" or (choice == "required" and name == "stop"), text
            schema = disallow_additional_properties(ARGS if name == "paint" else {"type": "object"})
            jsonschema.validate(args, schema)  # strict: no key the schema does not list


def test_strictness_walks_nested_schemas_and_can_be_turned_off() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
              "l": {"type": "array", "items": {"type": "object"}}, "open": {"type": "object",
              "additionalProperties": True}}, "$defs": {"d": {"properties": {"x": {}}}}}
    strict = disallow_additional_properties(schema)
    assert strict["additionalProperties"] is False and strict["properties"]["a"]["additionalProperties"] is False
    assert strict["properties"]["l"]["items"]["additionalProperties"] is False
    assert strict["properties"]["open"]["additionalProperties"] is True  # what a schema says holds
    assert strict["$defs"]["d"]["additionalProperties"] is False and "additionalProperties" not in schema
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": {"b": 1, "invented": 2}}, strict)
    # A forced call is strict by default; JSON Schema's meaning when the request turns strictness off.
    spec = _spec("hermes", "required", False, [{"type": "function", "function": {"name": "f",
                                                                                  "parameters": schema}}])
    assert tool_grammar(spec).count('"additionalProperties": false') == 1 + 4  # the call's wrapper, the schema's
    spec.strict = False
    assert tool_grammar(spec).count('"additionalProperties": false') == 1


def test_json_object_nesting_is_bounded() -> None:
    import llguidance

    def deep(d: int) -> dict:
        return {"k": deep(d - 1)} if d else {"k": 1}

    validator = jsonschema.Draft202012Validator(bounded_json_object())
    assert validator.is_valid(deep(3)) and not validator.is_valid(deep(4)) and validator.is_valid({"a": [1, "x"]})
    grammar = StructuredOutputsParams(json_object=True).to_grammar()
    tok = byte_tokenizer()
    for obj, ok in ((deep(3), True), (deep(4), False)):
        m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok)), grammar)
        ids = tok(json.dumps(obj, separators=(",", ":")), add_special_tokens=False)["input_ids"]
        assert m.consume_tokens(ids) == ok and (m.is_accepting() or not ok)


def test_auto_choice_needs_the_servers_flag() -> None:
    with pytest.raises(GenerationError) as e:
        tool_spec(TOOLS, None, None, auto_allowed=False)  # tool_choice unset with tools: "auto"
    assert e.value.status == 400 and e.value.param == "tool_choice" and "enable-auto-tool-choice" in e.value.message
    assert tool_spec(TOOLS, "required", None, auto_allowed=False).choice == "required"
    assert tool_spec(TOOLS, "none", None, auto_allowed=False).choice == "none"


def test_chat_options_check_names_and_read_template_files(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{{ x }}") == "{{ x }}"
    with pytest.raises(ValueError, match="neither a file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="tool_call_parser"):
        ChatOptions.create(tool_call_parser="nope")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ChatOptions.create(reasoning_parser="nope")
    assert ChatOptions.create(chat_template=str(path)).chat_template == path.read_text()


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", "<think>\nweigh it\n</think>\n\nIt is 4.", "\nweigh it\n", "\n\nIt is 4."),
    ("qwen3", "It is 4.", None, "It is 4."),  # thinking off
    ("qwen3", "<think>still weighing", "still weighing", ""),  # cut while thinking
    ("deepseek_r1", "weigh it</think>It is 4.", "weigh it", "It is 4."),
    ("deepseek_r1", "<think>weigh it</think>It is 4.", "weigh it", "It is 4."),
    ("deepseek_r1", "still weighing", "still weighing", ""),
])
def test_reasoning_split_whole_and_streamed(name: str, text: str, reasoning: str | None, content: str) -> None:
    parser = get_reasoning_parser(name)
    assert parser.split(text) == (reasoning, content)
    for size in (1, 2, 5):
        stream, r, c = ReasoningStream(parser), "", ""
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            dr, dc = stream.feed(piece, final=i == len(pieces) - 1)
            r, c = r + dr, c + dc
        assert (r, c) == (reasoning or "", content), size


def test_strictness_defaults_by_field() -> None:
    from serving.openai.protocol import ChatCompletionRequest

    loose = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": loose}}

    def strict(**extra: object) -> bool:
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **extra)
        body.check_supported()
        schema = body._structured["json"]
        return (json.loads(schema) if isinstance(schema, str) else schema).get("additionalProperties") is False

    off = {"disable_additional_properties": False}
    assert strict(response_format=rf) and not strict(response_format=rf, structured_outputs=off)
    assert not strict(response_format={**rf, "json_schema": {**rf["json_schema"], "strict": False}})
    assert not strict(guided_json=loose) and not strict(structured_outputs={"json": loose})
    assert strict(guided_json=loose, guided_decoding_backend="guidance:disable-additional-properties")
    assert strict(structured_outputs={"json": loose, "disable_additional_properties": True})
    # Forced calls: strict unless turned off.
    tools = {"tools": [{"type": "function", "function": {"name": "f", "parameters": loose}}], "tool_choice": "required"}
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **tools)
    body.check_supported()
    assert body._structured["grammar"].count('"additionalProperties": false') == 2
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], structured_outputs=off,
                                 **tools)
    body.check_supported()
    assert body._structured["grammar"].count('"additionalProperties": false') == 1
    # A tool's own `strict` decides for it, either way.
    for own, off_too, count in ((False, False, 1), (True, True, 2)):
        fn = {"name": "f", "parameters": loose, "strict": own}
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                     tools=[{"type": "function", "function": fn}], tool_choice="required",
                                     **({"structured_outputs": off} if off_too else {}))
        body.check_supported()
        assert body._structured["grammar"].count('"additionalProperties": false') == count, (own, off_too)


# What a model may write in auto mode that is no call, or no whole one: (parser, output, truncated, content kept).
NOT_CALLS = [
    ("hermes", '<tool_call>\n{"name": ["get_weather"], "arguments": {}}\n</tool_call>', False, True),
    ("llama3_json", '{"name": {"a": 1}, "parameters": {}}', False, True),
    ("mistral", '[TOOL_CALLS][{"name": ["x"], "arguments": {}}]', False, True),
    ("pythonic", "[get_weather(city={1, 2})]", False, True),
    ("pythonic", '[get_weather(city=b"x")]', False, True),
    ("pythonic", "[get_weather(city=1j)]", False, True),
    ("pythonic", "[Paris](https://example.org) is the capital of Fra", True, True),
    ("pythonic", "[get_wea", True, False),
    ("pythonic", '[get_weather(city="Par', True, False),
    ("llama3_json", '{"city": "Paris", "country": "Fr', True, True),
    ("llama3_json", '{"na', True, False),
    ("llama3_json", '{"name": "get_weather", "parameters": {"ci', True, False),
]


@pytest.mark.parametrize("parser, output, truncated, kept", NOT_CALLS)
def test_what_is_no_call_stays_text_and_never_fails(parser: str, output: str, truncated: bool, kept: bool) -> None:
    """No call parsed and no error (a 500) for names or values JSON cannot hold; text cut by max_tokens is dropped
    only where it opens a call."""
    content, calls = parse_tool_calls(output, _spec(parser), truncated=truncated)
    assert calls == [] and bool(content) == kept, (content, calls)


def test_serve_flags_reach_the_chat_options(tmp_path) -> None:
    from deploy.cli import build_parser
    from deploy.config import ServeConfig

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
                                      "--chat-template", str(path), "--reasoning-parser", "deepseek_r1"])
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func", "verbose", "config")}
    cfg = ServeConfig.from_dict(flags)
    cfg.validate()
    options = ChatOptions.create(**cfg.chat_options())  # what the front end builds (the template read already)
    assert options == ChatOptions(True, "pythonic", "{{ messages }}", "deepseek_r1")
    assert ServeConfig().chat_options()["tool_call_parser"] == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServeConfig.from_dict({"tool_call_parser": "nope"}).validate()
