"""A request's structured-output fields (OpenAI's response_format, vLLM's guided_* and structured_outputs, and the
grammar a tool_choice implies) into the engine's StructuredOutputsParams, as a dict the router passes on.

At most one of them may be set (a 400 names the second). Strictness (serving/openai/json_schema_strictness.py): forced
tool calls' arguments and response_format's json_schema (OpenAI's structured outputs, whose strict mode admits no
unlisted property; client libraries send model schemas that never say additionalProperties) are strict unless the
request sets `structured_outputs.disable_additional_properties` false; vLLM's own guided_json and
structured_outputs.json keep JSON Schema's meaning unless it is true or `guided_decoding_backend` is
"guidance:disable-additional-properties" (vLLM's names). Every schema, regex and grammar is compiled
here, before the request is queued, so one the backend (llguidance) cannot compile is a 400 that names its field.
"""

from __future__ import annotations

import json
from typing import Any

from engine.sample.structured_output import StructuredOutputsParams, check_grammar
from serving.openai.json_schema_strictness import disallow_additional_properties
from serving.openai.tool_calls import ToolSpec, tool_grammar
from serving.router.client import GenerationError

STRICT_BACKEND = "guidance:disable-additional-properties"
# guided_decoding_backend values served (all: llguidance)
BACKENDS = (None, "auto", "guidance", "llguidance", STRICT_BACKEND)
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_OPTION_KEYS = ("disable_additional_properties",)  # how, not what: not a structured output of their own


def _response_format(rf: Any) -> dict[str, Any] | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.type == "json_schema":
        js = (rf.model_extra or {}).get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str):
            raise GenerationError("response_format.json_schema needs an object with a name (and a schema)", 400,
                                  "response_format.json_schema")
        schema = js.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise GenerationError("response_format.json_schema.schema must be a JSON schema object", 400,
                                  "response_format.json_schema.schema")
        # The schema is enforced either way; `strict` (default true here) also refuses properties it does not list.
        return {"json": schema}
    raise GenerationError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {rf.type!r}",
                          400, "response_format.type")


def _json_schema_strict(rf: Any) -> bool:
    """response_format json_schema's `strict`: only an explicit false keeps JSON Schema's meaning (additional
    properties allowed where the schema does not say)."""
    js = (rf.model_extra or {}).get("json_schema") if rf is not None else None
    return not (isinstance(js, dict) and js.get("strict") is False)


def structured_outputs(body: Any, tools: ToolSpec | None = None) -> dict[str, Any] | None:
    """The request's StructuredOutputsParams fields (a dict), or None; GenerationError(400) naming the field."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = _response_format(body.response_format)
    if rf is not None:
        found.append(("response_format", rf))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            found.append((name, {key: value}))
    strict = None  # disable_additional_properties as the request set it
    if body.structured_outputs is not None:
        strict = body.structured_outputs.get("disable_additional_properties")
        if strict is not None and not isinstance(strict, bool):
            raise GenerationError("structured_outputs.disable_additional_properties must be true or false", 400,
                                  "structured_outputs.disable_additional_properties")
        so = {k: v for k, v in body.structured_outputs.items() if v not in (None, False) and k not in _OPTION_KEYS}
        for key in so:
            if key not in _STRUCTURED_KEYS:
                raise GenerationError(f"structured_outputs.{key} is not supported (this server takes "
                                      f"{', '.join(_STRUCTURED_KEYS)})", 400, f"structured_outputs.{key}")
        if so:
            found.append(("structured_outputs", so))
    if body.guided_decoding_backend == STRICT_BACKEND:
        strict = True if strict is None else strict
    if tools is not None:
        tools.strict = strict is not False
    if tools is not None and (grammar := tool_grammar(tools)) is not None:
        found.append(("tool_choice", {"grammar": grammar}))
    if body.guided_decoding_backend not in BACKENDS:
        raise GenerationError(f"guided_decoding_backend {body.guided_decoding_backend!r} is not available: this "
                              "server's structured outputs use llguidance ('guidance')", 400,
                              "guided_decoding_backend")
    if not found:
        return None
    if len(found) > 1:
        raise GenerationError(f"{found[1][0]} cannot be combined with {found[0][0]}: give one structured output",
                              400, found[1][0])
    name, fields = found[0]
    if strict is None and name == "response_format":
        strict = _json_schema_strict(body.response_format)
    if strict and "json" in fields:
        schema = fields["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GenerationError(f"{name}: the JSON schema is not JSON: {e}", 400, name) from e
        try:
            fields = {**fields, "json": disallow_additional_properties(schema)}
        except RecursionError as e:
            raise GenerationError(f"{name}: the JSON schema nests too deep", 400, name) from e
    try:
        params = StructuredOutputsParams(**fields)
        check_grammar(params)
    except (TypeError, ValueError) as e:
        raise GenerationError(f"{name}: {e}", 400, name) from e
    return fields
