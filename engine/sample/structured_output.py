"""Structured outputs: what a request's output must match (a JSON schema, any JSON object, a regex, a choice of
strings, a Lark or GBNF grammar), and its compiled form as a step's plan carries it to the workers.

The grammar backend is llguidance: it compiles lazily (about a millisecond for the schemas of an API call, with
no per-vocabulary precomputation), computes a token bitmask in microseconds, and refuses the JSON-schema keywords
it cannot enforce (`not`, `uniqueItems`, `if`/`then`, ...) instead of ignoring them, so a schema is either
honoured or refused with a 400, never accepted and then violated. The per-token masks are built where the
logits are (engine/sample/grammar_matchers.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.sample.grammar_spec import GrammarSpec

# JSON without free whitespace: a small model given the choice tends to emit newlines and spaces for ever.
JSON_OPTIONS = {"whitespace_flexible": False}
JSON_OBJECT_MAX_DEPTH = 4  # json_object: objects and arrays nest at most this deep


def bounded_json_object(depth: int = JSON_OBJECT_MAX_DEPTH) -> dict[str, Any]:
    """The schema of "any JSON object" (response_format json_object) with nesting bounded at `depth`: a small
    model left free nests values until max_tokens; a bounded one has to close them. Scalars stay free."""
    scalar: list[dict[str, Any]] = [{"type": t} for t in ("string", "number", "boolean", "null")]
    defs: dict[str, Any] = {"v0": {"anyOf": scalar}}
    for d in range(1, depth):
        below = {"$ref": f"#/$defs/v{d - 1}"}
        defs[f"v{d}"] = {"anyOf": [*scalar, {"type": "array", "items": below},
                                   {"type": "object", "additionalProperties": below}]}
    return {"type": "object", "additionalProperties": {"$ref": f"#/$defs/v{depth - 1}"}, "$defs": defs}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's StructuredOutputsParams); exactly one field is set.

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object; regex: a regular expression the
    whole output matches; choice: one of these strings; grammar: a Lark grammar (llguidance's dialect) or a GBNF
    one (as llama.cpp and vLLM's xgrammar backend take it; converted to Lark).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_fields = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        set_fields += ["json_object"] if self.json_object else []
        if len(set_fields) != 1:
            raise ValueError(f"structured outputs take exactly one of json, json_object, regex, choice, grammar; "
                             f"got {set_fields or 'none'}")
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, dict):  # as text: hashable, the compile cache's key
            object.__setattr__(self, "json", json.dumps(self.json))  # property order is output order

    def kind(self) -> str:
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None) \
            if not self.json_object else "json_object"

    def to_grammar(self) -> str:
        """The llguidance grammar text (raises ValueError for a schema or grammar that is not even well formed)."""
        import llguidance
        from llguidance.gbnf_to_lark import any_to_lark

        M = llguidance.LLMatcher
        try:
            if self.json is not None:
                return M.grammar_from_json_schema(self.json, defaults=JSON_OPTIONS)
            if self.json_object:
                return M.grammar_from_json_schema(bounded_json_object(), defaults=JSON_OPTIONS)
            if self.regex is not None:
                return M.grammar_from_regex(self.regex)
            if self.choice is not None:
                # Lark string literals take JSON's escapes.
                return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
            assert self.grammar is not None
            return M.grammar_from_lark(any_to_lark(self.grammar))
        except Exception as e:  # llguidance raises ValueError, the GBNF converter its own error
            raise ValueError(f"structured output {self.kind()}: {e}") from e


def grammar_spec_of(params: StructuredOutputsParams | None, tokenizer: Any, eos_token_ids: list[int],
                    vocab_size: int) -> GrammarSpec | None:
    """The GrammarSpec of a request's structured outputs, compiled once here so that a grammar the backend cannot
    compile is a ValueError (a 400) before the request runs; None without structured outputs."""
    if params is None:
        return None
    if tokenizer is None:
        raise ValueError("structured outputs need the model's tokenizer, and this model has none")
    if not eos_token_ids:
        raise ValueError("structured outputs need an end-of-sequence token to end the output, and this model has none")
    from engine.sample.grammar_matchers import compile_grammar, register_tokenizer

    spec = GrammarSpec(params.to_grammar(), register_tokenizer(tokenizer), tuple(eos_token_ids), vocab_size)
    compile_grammar(spec)
    return spec


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raise ValueError for a schema, regex or grammar the backend cannot compile (no tokenizer needed: a front
    end checks requests with it before they reach an engine)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(params.to_grammar())
    if error:
        raise ValueError(f"structured output {params.kind()} cannot be compiled: {error.strip()}")
