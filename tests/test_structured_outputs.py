"""Structured outputs in the engine: outputs parse and validate against their schemas (the bundled SmolLM2 pair, at
T=0 and T=1, with and without a draft; greedy with the draft equals greedy without it, token for token); the
constrained distribution is exact under speculation (chi-square against the target's masked and renormalised
distribution, enumerated, with the tiny byte-level models); asynchronous scheduling changes nothing; schemas the
backend cannot enforce are refused; `tool_choice="required"` gives schema-valid calls with the bundled model.
"""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest
import torch
from byte_models import make_byte_models
from scipy import stats

from engine import LLM, SamplingParams
from engine.sample.structured_output import StructuredOutputsParams
from serving.openai.tool_calls import parse_tool_calls, render_messages, tool_grammar, tool_spec

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "role": {"enum": ["admin", "user", "guest"]}},
                 "required": ["name", "role"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"enum": ["A1", "B2", "C3"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}, "minItems": 1, "maxItems": 3}},
        "required": ["items"], "additionalProperties": False},
    "enum_required": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "note": {"type": "string", "maxLength": 8}}, "required": ["color", "size"], "additionalProperties": False},
}
PROMPT = "Reply with a JSON object only."


@pytest.fixture(scope="module")
def smol_llms():
    kw = dict(max_model_len=512, num_kv_blocks=256)
    return (LLM(model="smollm2-135m-instruct", **kw),
            LLM(model="smollm2-135m-instruct", draft_model="smollm2-135m-draft", num_speculative_tokens=4,
                adaptive_draft_length=False, **kw))  # a fixed k: the draft's proposals are counted


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_validate_with_and_without_draft(smol_llms, temperature: float) -> None:
    names = list(SCHEMAS)
    params = [SamplingParams(max_tokens=64, temperature=temperature, seed=7,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[n])) for n in names]
    runs = [llm.generate([PROMPT] * len(names), params) for llm in smol_llms]
    for outs in runs:
        for name, out in zip(names, outs):
            assert out.finish_reason == "stop", (name, out.text)
            jsonschema.validate(json.loads(out.text), SCHEMAS[name])
    assert runs[1][0].spec.num_draft_tokens > 0  # the draft really proposed
    if temperature == 0.0:  # greedy: speculation changes nothing, token for token
        assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]


@pytest.mark.slow
def test_tool_choice_required_gives_valid_arguments(smol_llms) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                             "b": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["a", "b"], "additionalProperties": False}}}]
    spec = tool_spec(tools, "required", False)
    llm = smol_llms[1]
    messages = render_messages([{"role": "user", "content": "What is the weather in Paris?"}], spec, True)
    ids = llm.tokenizer(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)["input_ids"]
    out = llm.generate([ids], SamplingParams(max_tokens=80, temperature=1.0, seed=1,
                                             structured_outputs=StructuredOutputsParams(grammar=tool_grammar(spec))))[0]
    assert out.finish_reason == "stop", out.text
    content, calls = parse_tool_calls(out.text, spec)
    assert len(calls) == 1 and content is None, out.text
    fn = calls[0]["function"]
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == fn["name"])
    jsonschema.validate(json.loads(fn["arguments"]), schema)


# --- exactness with the tiny byte-level models ----------------------------------------------------------------
CHOICES = ["ab", "abc", "b", "ca", "cab"]  # "ab" | "abc": the grammar may end or go on after "ab"


@pytest.fixture(scope="module")
def byte_models(tmp_path_factory):
    return make_byte_models(tmp_path_factory.mktemp("byte"))


def _exact_distribution(target: str, tokenizer, prompt_ids: list[int], eos: int) -> dict[str, float]:
    """P(choice) under the target at T=1 restricted at every position to what the grammar allows, renormalised:
    the product over the choice's tokens and its EOS of the masked softmax (HF's model as the oracle)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target).eval()
    def byte_id(ch: str) -> int:
        (token,) = tokenizer.encode(ch, add_special_tokens=False)  # one byte, one token
        return token

    def allowed(prefix: str) -> list[int]:
        nxt = {byte_id(s[len(prefix)]) for s in CHOICES if s.startswith(prefix) and len(s) > len(prefix)}
        return sorted(nxt | ({eos} if prefix in CHOICES else set()))

    def step(prefix: str, token: int) -> float:
        ids = prompt_ids + [byte_id(c) for c in prefix]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        allow = allowed(prefix)
        return float(logits[allow].softmax(-1)[allow.index(token)])

    out = {}
    for s in CHOICES:
        p = 1.0
        for i in range(len(s)):
            p *= step(s[:i], byte_id(s[i]))
        out[s] = p * step(s, eos)
    assert abs(sum(out.values()) - 1) < 1e-6
    return out


def test_constrained_distribution_is_exact_under_speculation(byte_models, one_thread) -> None:
    target, draft = byte_models
    llm = LLM(model=target, draft_model=draft, num_speculative_tokens=3, max_model_len=64, device="cpu",
              block_size=4, num_kv_blocks=512, max_num_seqs=128)
    prompt_ids = llm.tokenizer("x")["input_ids"]
    expected = _exact_distribution(target, llm.tokenizer, prompt_ids, eos=2)
    n = 600
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=i,
                             structured_outputs=StructuredOutputsParams(choice=CHOICES)) for i in range(n)]
    outs = llm.generate([prompt_ids] * n, params)
    assert all(o.finish_reason == "stop" for o in outs)
    counts = Counter(o.text for o in outs)
    assert set(counts) <= set(CHOICES), counts
    assert llm.spec_stats(outs).num_accepted_tokens > 0  # the constrained draft's proposals were accepted
    observed = [counts[s] for s in CHOICES]
    p = stats.chisquare(observed, [expected[s] * n for s in CHOICES]).pvalue
    assert p > 1e-3, (observed, expected)


def test_async_scheduling_changes_nothing(byte_models, one_thread) -> None:
    target, draft = byte_models
    kw = dict(draft_model=draft, num_speculative_tokens=3, max_model_len=128, device="cpu", block_size=4,
              num_kv_blocks=256)
    schema = SCHEMAS["enum_required"]
    params = [SamplingParams(max_tokens=60, temperature=t, seed=3,
                             structured_outputs=StructuredOutputsParams(json=schema)) for t in (0.0, 1.0)]
    outs = [LLM(model=target, async_scheduling=a, **kw).generate(["a", "b"], params) for a in (False, True)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    for o in outs[0]:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)


@pytest.mark.parametrize("fields, message", [
    ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),  # not enforceable: refused, not ignored
    ({"json": {"type": "foo"}}, "foo"), ({"regex": "[0-9"}, "regex"), ({"grammar": "start: /[a-"}, "grammar"),
])
def test_uncompilable_grammars_are_refused(byte_models, fields: dict, message: str) -> None:
    llm = LLM(model=byte_models[0], max_model_len=64, device="cpu", block_size=4, num_kv_blocks=64)
    with pytest.raises(ValueError, match=message):
        llm.generate(["a"], SamplingParams(structured_outputs=StructuredOutputsParams(**fields)))
