"""GPT-OSS's harmony format split from recorded output streams (serving/openai/harmony.py), with a tokenizer that has
harmony's special tokens (tests/harmony_support.py): reasoning then final, tool calls, preambles, malformed headers,
cut outputs; streamed in any chunks it gives what the whole output gives; the forced-call grammar
(serving/openai/tool_parsers/harmony.py) admits exactly the markup the split reads back; the parser is chosen by the
tokenizer and by vLLM's flag names."""

from __future__ import annotations

import json
import random

import pytest
from byte_models import byte_tokenizer
from harmony_support import harmony_tokenizer

from serving.openai.chat_options import ChatOptions
from serving.openai.harmony import HarmonyStream, HarmonyTokens, parse_harmony
from serving.openai.tool_parsers import ParsedCall, get_tool_parser

TOK = harmony_tokenizer()
HT = HarmonyTokens.of(TOK)
TOOLS = {"get_weather", "get_time"}

# Outputs as a GPT-OSS writes them after the generation prompt's `<|start|>assistant`.
REASON_FINAL = ("<|channel|>analysis<|message|>The user greets. Reply kindly, with an accent: é, 🌍.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>Héllo! How can I help? 👋<|return|>")
TOOL_CALL = ("<|channel|>analysis<|message|>Need the weather in Paris.<|end|>"
             "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
             "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
             '{"city": "Paris", "unit": "°C"}<|call|>')
# The recipient in the role part of the header, a content type without <|constrain|> (both harmony's forms).
TOOL_CALL_ROLE_RECIPIENT = ('<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_time'
                            '<|channel|>commentary json<|message|>{"zone": "CET"}<|call|>')
TWO_THOUGHTS = ("<|channel|>analysis<|message|>first<|end|><|start|>assistant<|channel|>analysis<|message|>second"
                "<|end|><|start|>assistant<|channel|>final<|message|>done<|return|>")
BUILTIN_TOOL = ("<|channel|>analysis to=python<|message|>print(1)<|call|>")
UNKNOWN_FUNCTION = ("<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{\"now\": true}<|call|>")
# Malformed: (output, reasoning, content)
MALFORMED = [
    # two channels in one header: an unknown channel, its body is content
    ("<|channel|>analysis<|channel|>final<|message|>x<|return|>", None, "x"),
    # a header that never reaches <|message|> is dropped, the next message is read
    ("<|channel|>analysis<|end|><|start|>assistant<|channel|>final<|message|>ok<|return|>", None, "ok"),
    # a new header inside a body ends that body
    ("<|channel|>analysis<|message|>think<|channel|>final<|message|>ok<|return|>", "think", "ok"),
    # no format at all: content
    ("Just text, no harmony.<|return|>", None, "Just text, no harmony."),
    # no channel: content; stray <|message|> and <|constrain|> in a body are skipped
    ("<|message|>a<|message|>b<|constrain|>c<|end|>", None, "abc"),
    # text between messages without <|start|>, and an unknown channel
    ("<|channel|>analysis<|message|>r<|end|>assistant<|channel|>bogus<|message|>c<|return|>", "r", "c"),
    # a header cut by the output's end
    ("<|channel|>final<|message|>a<|end|><|start|>assistant<|channel|>fin", None, "a"),
    # an empty output, and one of markers only
    ("", None, ""),
    ("<|start|><|end|><|message|><|call|><|return|>", None, ""),
    # a header without markers longer than any header: a model writing plain text, streamed as content
    ("x" * 100 + "<|end|>", None, "x" * 100),
    # other special tokens are skipped
    ("<|channel|>final<|message|>a</s>b<|return|>", None, "ab"),
]


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def streamed(token_ids: list[int], cuts: list[int], names: set[str] | None = TOOLS,
             truncated: bool = False) -> tuple[str | None, str, list[dict]]:
    """The output fed in chunks cut at `cuts`, deltas joined as a client joins them."""
    stream = HarmonyStream(HT, TOK, names)
    reasoning, content, calls = "", "", []
    bounds = [0, *cuts, len(token_ids)]
    for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
        d = stream.feed(token_ids[a:b], final=n == len(bounds) - 2, truncated=truncated)
        reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.calls
    return (reasoning if stream.saw_reasoning else None), content, calls


def _plain(calls: list[dict]) -> list[tuple[int, str, str]]:
    return [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_reasoning_then_final() -> None:
    r = parse_harmony(ids(REASON_FINAL), HT, TOK, None)
    assert r.reasoning == "The user greets. Reply kindly, with an accent: é, 🌍."
    assert r.content == "Héllo! How can I help? 👋"
    assert r.calls == []


def test_tool_call_with_preamble() -> None:
    r = parse_harmony(ids(TOOL_CALL), HT, TOK, TOOLS)
    assert r.reasoning == "Need the weather in Paris."
    assert r.content == "Let me check."  # a commentary message without a recipient is a preamble: content
    assert [c["function"]["name"] for c in r.calls] == ["get_weather"]
    assert json.loads(r.calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "°C"}
    assert r.calls[0]["type"] == "function" and r.calls[0]["id"].startswith("call_")
    r = parse_harmony(ids(TOOL_CALL_ROLE_RECIPIENT), HT, TOK, TOOLS)
    assert _plain(r.calls) == [(0, "get_time", '{"zone": "CET"}')] and r.content == ""


def test_messages_of_one_kind_join_and_builtin_tools_are_reasoning() -> None:
    r = parse_harmony(ids(TWO_THOUGHTS), HT, TOK, None)
    assert (r.reasoning, r.content) == ("first\n\nsecond", "done")
    r = parse_harmony(ids(BUILTIN_TOOL), HT, TOK, TOOLS)
    assert (r.reasoning, r.content, r.calls) == ("print(1)", "", [])


def test_calls_the_request_does_not_parse_are_content() -> None:
    r = parse_harmony(ids(UNKNOWN_FUNCTION), HT, TOK, TOOLS)
    assert (r.content, r.calls) == ('{"now": true}', [])
    r = parse_harmony(ids(TOOL_CALL), HT, TOK, None)  # no tools in the request
    assert r.calls == [] and r.content == 'Let me check.\n\n{"city": "Paris", "unit": "°C"}'


@pytest.mark.parametrize("output,reasoning,content", MALFORMED)
def test_malformed_headers_are_tolerated(output: str, reasoning: str | None, content: str) -> None:
    r = parse_harmony(ids(output), HT, TOK, TOOLS)
    assert (r.reasoning, r.content, r.calls) == (reasoning, content, [])


def test_cut_by_max_tokens() -> None:
    """A call cut by max_tokens is dropped (never content); cut reasoning or content is kept."""
    call = ids(TOOL_CALL)
    cut = call[:-4]  # inside the arguments
    r = parse_harmony(cut, HT, TOK, TOOLS, truncated=True)
    assert (r.reasoning, r.content, r.calls) == ("Need the weather in Paris.", "Let me check.", [])
    r = parse_harmony(ids(REASON_FINAL)[:20], HT, TOK, None, truncated=True)  # 10 header tokens, 10 bytes
    assert r.reasoning == "The user g" and r.content == ""
    # A call the output's own end closes (a stop string, say) is whole.
    assert len(parse_harmony(call[:-1], HT, TOK, TOOLS).calls) == 1


@pytest.mark.parametrize("output", [REASON_FINAL, TOOL_CALL, TOOL_CALL_ROLE_RECIPIENT, TWO_THOUGHTS,
                                    UNKNOWN_FUNCTION, *[m[0] for m in MALFORMED]])
def test_streaming_at_every_boundary_equals_the_whole(output: str) -> None:
    token_ids = ids(output)
    whole = parse_harmony(token_ids, HT, TOK, TOOLS)
    expected = (whole.reasoning, whole.content, _plain(whole.calls))
    n = len(token_ids)
    chunkings = [[i] for i in range(1, n)] + [list(range(1, n))]  # every two-chunk cut, and token by token
    rng = random.Random(0)
    chunkings += [sorted(rng.sample(range(1, n), k=min(n - 1, rng.randint(1, 6)))) for _ in range(20)] if n > 1 else []
    for cuts in chunkings:
        r, c, calls = streamed(token_ids, cuts)
        assert (r, c, _plain(calls)) == expected, cuts


def test_random_token_soup_never_fails() -> None:
    """Any sequence of harmony markers and text: no exception, and streamed equals whole."""
    rng = random.Random(1)
    alphabet = [HT.start, HT.end, HT.message, HT.channel, HT.constrain, HT.return_, HT.call,
                *ids("analysis final commentary to=functions.get_weather json {}é")]
    for _ in range(200):
        token_ids = [rng.choice(alphabet) for _ in range(rng.randint(0, 40))]
        whole = parse_harmony(token_ids, HT, TOK, TOOLS)
        cuts = sorted(rng.sample(range(1, len(token_ids)), k=min(len(token_ids) - 1, 3))) if len(token_ids) > 1 else []
        r, c, calls = streamed(token_ids, cuts)
        assert (r, c, _plain(calls)) == (whole.reasoning, whole.content, _plain(whole.calls))


def test_forced_call_grammar_admits_the_markup_the_split_reads() -> None:
    """The `openai` parser's grammar of a forced call, compiled by llguidance for the harmony tokenizer: the
    markup format_calls writes (less the generation prompt's `<|start|>assistant`) is accepted, ends at <|call|>,
    and the split reads the same call back; other markup or another function is refused."""
    import llguidance
    import llguidance.hf

    parser = get_tool_parser("openai")
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    grammar = parser.grammar([("get_weather", params), ("get_time", {"type": "object"})], parallel=True)
    ll = llguidance.hf.from_tokenizer(TOK, n_vocab=len(TOK), eos_token=[2])
    markup = parser.format_calls([ParsedCall("get_weather", {"city": "Paris"})])
    output = ids(markup.removeprefix("<|start|>assistant"))

    def accepts(token_ids: list[int]) -> bool:
        m = llguidance.LLMatcher(ll, llguidance.grammar_from("lark", grammar), log_level=0)
        assert not m.is_error(), m.get_error()
        return all(m.consume_token(t) for t in token_ids) and m.is_accepting()

    assert accepts(output)
    assert output[-1] == HT.call
    assert _plain(parse_harmony(output, HT, TOK, TOOLS).calls) == [(0, "get_weather", '{"city":"Paris"}')]
    assert not accepts(ids('<|channel|>final<|message|>{"city": "Paris"}<|return|>'))
    assert not accepts(ids('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                           '{"town": "Paris"}<|call|>'))


def test_parser_choice() -> None:
    """Harmony is on for a tokenizer with its tokens whatever the flags; its vLLM names are refused for one
    without them; the byte tokenizer keeps the text parsers."""
    opts = ChatOptions.create().for_tokenizer(TOK)
    assert opts.harmony == HT and opts.tool_parser().name == "openai"
    assert opts.reasoning().name == "openai_gptoss"
    assert HT.stop_token_ids == [TOK.convert_tokens_to_ids("<|return|>"), TOK.convert_tokens_to_ids("<|call|>")]
    named = ChatOptions.create(tool_call_parser="openai", reasoning_parser="openai_gptoss").for_tokenizer(TOK)
    assert named.harmony == HT
    plain = ChatOptions.create(reasoning_parser="qwen3").for_tokenizer(byte_tokenizer())
    assert plain.harmony is None and plain.tool_parser().name == "hermes" and plain.reasoning().name == "qwen3"
    for flags in ({"tool_call_parser": "openai"}, {"reasoning_parser": "openai_gptoss"}):
        with pytest.raises(ValueError, match="harmony tokens"):
            ChatOptions.create(**flags).for_tokenizer(byte_tokenizer())
    with pytest.raises(ValueError, match="'openai'"):
        ChatOptions.create(tool_call_parser="harmony")


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "paint"}}, "required"])
def test_forced_call_grammar_samples_parse_back(choice: str | dict) -> None:
    """Random outputs under the forced-call grammar of a request (tool_spec, strict schemas): each ends at
    <|call|> and the split reads one call of the forced tools whose arguments follow the strict schema."""
    import jsonschema
    import llguidance
    import llguidance.hf
    import numpy as np

    from engine.sample.structured_output import StructuredOutputsParams
    from serving.openai.json_schema_strictness import disallow_additional_properties
    from serving.openai.tool_calls import tool_grammar, tool_spec

    args = {"type": "object", "properties": {"c": {"enum": ["r", "g"]}, "n": {"type": "integer", "minimum": 0,
            "maximum": 9}}, "required": ["c"]}
    tools = [{"type": "function", "function": {"name": "paint", "parameters": args}},
             {"type": "function", "function": {"name": "stop", "parameters": {"type": "object"}}}]
    spec = tool_spec(tools, choice, None, get_tool_parser("openai"))
    grammar = StructuredOutputsParams(grammar=tool_grammar(spec)).to_grammar()
    ll = llguidance.hf.from_tokenizer(TOK, n_vocab=len(TOK), eos_token=[TOK.eos_token_id])
    for seed in range(6):
        matcher, rng, out = llguidance.LLMatcher(ll, grammar), random.Random(seed), []
        while not (out and out[-1] == HT.call):
            assert len(out) < 400, TOK.decode(out)
            mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            token = rng.choice([t for t in np.flatnonzero(mask[:len(TOK)]).tolist() if t != TOK.eos_token_id])
            assert matcher.consume_token(token)
            out.append(token)
        assert matcher.is_accepting()
        r = parse_harmony(out, HT, TOK, set(spec.functions))
        assert r.content == "" and r.reasoning is None and len(r.calls) == 1, TOK.decode(out)
        name, arguments = r.calls[0]["function"]["name"], json.loads(r.calls[0]["function"]["arguments"])
        assert name == "paint" or (choice == "required" and name == "stop")
        jsonschema.validate(arguments, disallow_additional_properties(args if name == "paint" else {"type": "object"}))
