"""JSON schemas closed as llama.cpp closes them: an object schema that lists `properties` and says
nothing of `additionalProperties` allows no other keys.

JSON Schema itself allows any undeclared key there, and a small model given that freedom wanders
into keys of its own (`{"city": "Oslo", "type": "string", "description": ...` until max_tokens)
and the call never parses. llama.cpp's JSON-schema grammars treat a missing `additionalProperties`
as false ("produces faster grammars + reduces hallucinations", its grammars/README.md), and
XGrammar's strict mode does the same. `"additionalProperties": true` (or a schema) still allows
extra keys, and an object schema without `properties` (`{"type": "object"}`) stays any object.

Members of an `allOf` are left open: llguidance intersects them, so a member closed on its own
keys would forbid the keys its siblings declare. Their nested schemas are closed all the same.
"""
from __future__ import annotations

import copy
from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "contains", "not", "if", "then", "else",
                  "unevaluatedItems", "propertyNames")


def closed(schema: Any) -> Any:
    """A copy of `schema` with `"additionalProperties": false` on every object schema that declares
    `properties` and leaves `additionalProperties` (and `unevaluatedProperties`) unsaid."""
    out = copy.deepcopy(schema)
    _close(out, close_here=True)
    return out


def _close(schema: Any, close_here: bool) -> None:
    if isinstance(schema, list):  # `items` in the draft-4 tuple form
        for s in schema:
            _close(s, True)
        return
    if not isinstance(schema, dict):
        return
    if (close_here and isinstance(schema.get("properties"), dict) and "allOf" not in schema
            and "additionalProperties" not in schema and "unevaluatedProperties" not in schema):
        schema["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for s in schema[key].values():
                _close(s, True)
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for s in schema[key]:
                _close(s, True)
    for key in _SCHEMA_VALUES:
        if key in schema:
            _close(schema[key], True)
    if isinstance(schema.get("allOf"), list):
        for s in schema["allOf"]:
            _close(s, False)
