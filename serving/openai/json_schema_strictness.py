"""Schema strictness as vLLM's guidance backend offers it ("guidance:disable-additional-properties"): every object
schema that does not say `additionalProperties` gets `additionalProperties: false`, so the output holds only the
properties the schema lists.

JSON Schema's own meaning (an unlisted property may be anything) lets a small model invent and nest keys until
max_tokens. Tool arguments are strict by default here (a model must not invent a function's parameters; OpenAI's
`strict: true` means the same); response_format / guided_json keep JSON Schema's meaning unless the request asks
(docs/tool_calling.md).
"""

from __future__ import annotations

import copy
from typing import Any

_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems")


def _is_object_schema(node: dict[str, Any]) -> bool:
    t = node.get("type")
    return t == "object" or (isinstance(t, list) and "object" in t) or "properties" in node


def disallow_additional_properties(schema: Any) -> Any:
    """A copy of `schema` where each object schema without `additionalProperties` has it false."""
    schema = copy.deepcopy(schema)
    _walk(schema)
    return schema


def _walk(node: Any) -> None:
    if not isinstance(node, dict):
        return
    if _is_object_schema(node) and "additionalProperties" not in node:
        node["additionalProperties"] = False
    for key in _SUBSCHEMA_LISTS:
        for sub in node.get(key) or []:
            _walk(sub)
    for key in _SUBSCHEMA_MAPS:
        sub_map = node.get(key)
        if isinstance(sub_map, dict):
            for sub in sub_map.values():
                _walk(sub)
    for key in _SUBSCHEMAS:
        _walk(node.get(key))
