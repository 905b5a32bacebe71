"""A text argument value typed by the request's tool schema as vLLM 0.32's readers of nested or
typed values type it (pure): shared by minimax_m3, k2_horizon and inkling.

`schema_types(schema)` lists the types a parameter's schema allows as the schema spells them (its
`type`, a string or a list; its `enum`'s values' types; anyOf/oneOf/allOf), {"string"} where it
gives none. `coerce(text, types)` reads the text as the first of those types, in the order null,
integer, number (a whole number an integer), boolean (true/false/1/0), object, array, string, each
type name read through vLLM's aliases (`int64`, `float32`, `varchar`, `dict`...); failing all,
JSON where it is, else the text. A number that is not finite is no number.
"""

from __future__ import annotations

import json
import math
from typing import Any

# the type names vLLM's coercion reads as JSON Schema's
ALIASES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
           "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
           "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer",
           "float": "number", "float32": "number", "float64": "number", "double": "number",
           "bool": "boolean", "dict": "object", "arr": "array", "list": "array", "sequence": "array"}
_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")


def schema_types(schema: Any) -> set[str]:
    """The types a schema allows, as it spells them; {"string"} where it gives none."""
    if not isinstance(schema, dict):
        return {"string"}
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else set()
    types |= {t for t in kind if isinstance(t, str)} if isinstance(kind, list) else set()
    enum = schema.get("enum")
    for value in enum if isinstance(enum, list) else ():
        types.add("null" if value is None else "boolean" if isinstance(value, bool) else "integer"
                  if isinstance(value, int) else "number" if isinstance(value, float) else "string"
                  if isinstance(value, str) else "array" if isinstance(value, list) else "object"
                  if isinstance(value, dict) else "")
    for choices in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(choices) if isinstance(schema.get(choices), list) else ():
            types |= schema_types(choice)
    return (types - {""}) or {"string"}


def finite(value) -> bool:
    """No NaN or infinity anywhere in a JSON value."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(map(finite, value))
    if isinstance(value, dict):
        return all(map(finite, value.values()))
    return True


def coerce(text: str, types: set[str]):
    """`text` as the first of `types` (any spelling, `ALIASES`) that reads it, in `_PRIORITY`'s
    order; failing all, JSON where it is, else the text."""
    types = {ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in (k for k in _PRIORITY if k in types):
        if kind == "string":
            return text
        if kind == "null" and text.lower() == "null":
            return None
        if kind == "integer":
            try:
                return int(text)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        if kind == "boolean" and text.lower().strip() in ("true", "1", "false", "0"):
            return text.lower().strip() in ("true", "1")
        if kind in ("object", "array"):
            try:
                parsed = json.loads(text)
            except ValueError:
                continue
            if finite(parsed):
                return parsed
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    return parsed if finite(parsed) else text
