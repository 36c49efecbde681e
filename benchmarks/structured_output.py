"""Structured outputs: tokens/s and acceptance with and without a grammar, with and without speculation, and the
grammar's compile and per-token mask times (llguidance, the bundled SmolLM2 tokenizer).

    python benchmarks/structured_output.py [--device cpu|cuda] [--batch-size 4] [--new-tokens 64] [--k 4]
        [--workloads json_schema tool_call tool_call_loose json_object]

Workloads (grammar): json_schema (a bounded record), tool_call (a forced named call in Hermes markup, the
arguments' schema as LangChain sends it and strict as the server makes it, on a chat prompt listing the tool),
tool_call_loose (the same call with JSON Schema's meaning: unlisted properties allowed), json_object (any object,
nesting bounded). Each row also gives the share of outputs that ended (finish_reason stop) within --new-tokens.

Runs (one warm-up each, then the median of --repeats): the target alone and with the bundled draft
(smollm2-135m-draft), each free-text and under a JSON schema; with the grammar, also a draft that proposes
without it (what the GPU draft loop's CUDA graphs do; rejection sampling against the masked target keeps the output
exact, only acceptance drops). Temperature 0 and 1 (seeded). Free text runs to max_tokens (ignore_eos).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, save_json  # noqa: E402

import engine.speculation.proposer as proposer_module  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.sample import grammar_matchers  # noqa: E402
from engine.sample.structured_output import GrammarSpec, StructuredOutputsParams  # noqa: E402
from serving.openai.tool_calls import render_messages, tool_grammar, tool_spec  # noqa: E402

PROMPTS = ["Describe a customer order as JSON.", "Give me a user profile in JSON.",
           "Return a JSON record of a book.", "Write a JSON object about a city."]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["person", "place", "thing"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}, "maxItems": 3},
    "active": {"type": "boolean"}}, "required": ["name", "kind", "items", "active"], "additionalProperties": False}
COMPILE_SCHEMAS = {
    "flat (3 fields)": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"},
                                                         "c": {"type": "boolean"}}, "required": ["a", "b", "c"]},
    "nested + arrays + enums": SCHEMA,
    "recursive ($ref)": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"]}}, "$ref": "#/$defs/node"},
}


# The tool of the LangChain example (issue: tool calls that end): a schema without additionalProperties.
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo"]


def workload(llm: LLM, name: str) -> tuple[StructuredOutputsParams | None, list]:
    """(the grammar, the prompts) of a workload: text prompts, or chat token ids for the tool calls."""
    if name in ("none", "json_schema", "json_object"):
        so = {"none": None, "json_schema": StructuredOutputsParams(json=SCHEMA),
              "json_object": StructuredOutputsParams(json_object=True)}[name]
        return so, PROMPTS
    spec = tool_spec([WEATHER_TOOL], {"type": "function", "function": {"name": "get_weather"}}, False)
    spec.strict = name == "tool_call"
    prompts = []
    for city in CITIES:
        messages = render_messages([{"role": "user", "content": f"What is the weather in {city}?"}], spec, True)
        prompts.append(llm.tokenizer(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                       tokenize=False), add_special_tokens=False)
                       ["input_ids"])
    return StructuredOutputsParams(grammar=tool_grammar(spec)), prompts


def compile_times(llm: LLM) -> list[dict]:
    """Cold compile (no cache) of each schema, the cached lookup, and the per-token mask time along a valid output."""
    eos = sorted(llm.engine.output.eos_token_ids)
    tok_path = grammar_matchers.register_tokenizer(llm.tokenizer)
    t0 = time.perf_counter()
    grammar_matchers._ll_tokenizer(GrammarSpec("", tok_path, tuple(eos), llm.engine.vocab_size))
    rows = [{"what": "tokenizer for the grammar backend (once per process)", "ms": (time.perf_counter() - t0) * 1e3}]
    for name, schema in COMPILE_SCHEMAS.items():
        params = StructuredOutputsParams(json=schema)
        spec = GrammarSpec(params.to_grammar(), tok_path, tuple(eos), llm.engine.vocab_size)
        grammar_matchers._templates.pop(spec, None)
        t0 = time.perf_counter()
        grammar_matchers.compile_grammar(spec)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        grammar_matchers.compile_grammar(spec)
        rows.append({"what": f"compile: {name}", "ms": cold * 1e3, "cached_us": (time.perf_counter() - t0) * 1e6})
    # Per-token mask: walk a valid output of SCHEMA one token at a time, as a plain decode would.
    text = ('{"name":"Ada","kind":"person","items":[{"sku":"A1","qty":2},{"sku":"B22","qty":10}],'
            '"active":true}')
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    spec = GrammarSpec(StructuredOutputsParams(json=SCHEMA).to_grammar(), tok_path, tuple(eos), llm.engine.vocab_size)
    out = grammar_matchers.new_bitmask(1, llm.engine.vocab_size, torch.device("cpu"))
    times = []
    for n in range(len(ids) + 1):
        t0 = time.perf_counter()
        grammar_matchers.grammar_bitmask(spec, "bench", ids[:n], [], 0, 1, out)
        times.append(time.perf_counter() - t0)
    grammar_matchers.forget(["bench"])
    rows.append({"what": f"mask per token (median of {len(times)}, with bringing the matcher up)",
                 "ms": statistics.median(times) * 1e3})
    return rows


def run(llm: LLM, temperature: float, name: str, new_tokens: int, batch: int, repeats: int) -> dict:
    so, texts = workload(llm, name)
    # Free text runs to max_tokens (ignore_eos), so its batch stays as full as the JSON runs' (which end with the
    # object, mostly near max_tokens): tokens/s compares like with like.
    params = [SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=i, structured_outputs=so,
                             ignore_eos=so is None) for i in range(batch)]
    prompts = [texts[i % len(texts)] for i in range(batch)]
    llm.generate(prompts, params)  # warm-up
    results = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        results.append((seconds, outs))
    seconds, outs = sorted(results, key=lambda r: r[0])[len(results) // 2]
    tokens = sum(len(o.token_ids) for o in outs)
    spec = llm.spec_stats(outs)
    return {"tokens": tokens, "tokens_per_s": tokens / seconds,
            "ended": sum(o.finish_reason == "stop" for o in outs) / len(outs) if so is not None else None,
            "acceptance_rate": spec.acceptance_rate if spec.num_draft_tokens else None,
            "acceptance_length": spec.acceptance_length if spec.num_drafts else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft-model", default="smollm2-135m-draft")
    ap.add_argument("--device", default=None)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--workloads", nargs="+", default=["json_schema"],
                    choices=["json_schema", "tool_call", "tool_call_loose", "json_object"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--save-json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    kw = dict(max_model_len=512, device=args.device)
    base = LLM(model=args.model, **kw)
    spec = LLM(model=args.model, draft_model=args.draft_model, num_speculative_tokens=args.k, **kw)
    compile_rows = compile_times(base)
    print(markdown_table(compile_rows, ["what", "ms", "cached_us"]))
    rows = []
    process = proposer_module.needs_processing
    cases = [("target alone", base, "none", True), (f"+ draft, k={args.k}", spec, "none", True)]
    for w in args.workloads:
        cases += [("target alone", base, w, True), (f"+ draft, k={args.k}", spec, w, True),
                  (f"+ draft, k={args.k}, draft unconstrained", spec, w, False)]
    for t in args.temperatures:
        for label, llm, grammar, draft_grammar in cases:
            # The draft proposing without the grammar: its processing switched off (these requests use no other).
            proposer_module.needs_processing = process if draft_grammar else (lambda reqs: False)
            try:
                r = run(llm, t, grammar, args.new_tokens, args.batch_size, args.repeats)
            finally:
                proposer_module.needs_processing = process
            rows.append({"temperature": t, "engine": label, "grammar": grammar, **r})
            print(rows[-1], flush=True)
    print(markdown_table(rows, ["temperature", "engine", "grammar", "tokens", "tokens_per_s", "ended",
                                "acceptance_rate", "acceptance_length"]))
    save_json(args.save_json, {"environment": environment(), "args": vars(args), "compile": compile_rows,
                               "runs": rows})


if __name__ == "__main__":
    main()
