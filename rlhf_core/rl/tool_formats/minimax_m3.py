"""MiniMax-M3's tool calls (pure): XML-like elements, every tag after the `]<]minimax[>[` marker.

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="create_order">
    ]<]minimax[>[<user_id>42]<]minimax[>[</user_id>
    ]<]minimax[>[<items>]<]minimax[>[<item>book]<]minimax[>[</item>]<]minimax[>[</items>
    ]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

Each `<invoke>` (its name in double, single or no quotes) is a call; its parameters are elements
named after the arguments, which may nest. The request's tool schema shapes the arguments, as
vLLM 0.32's reader does: an element with children is an object (a name repeated collects into a
list), or an array of its children where the schema says array (the template writes list items as
`<item>`); a text value is coerced to the schema's type (null, integer, number, boolean, object,
array, string: the first that reads), an empty element is `[]` or `{}` where the schema wants a
container and no string; without a schema a text stays text. Text beside child elements is kept
under `$text`. The text before `<tool_call>` is the content; after `</tool_call>` nothing is read.
A malformed element or an invoke left open makes the whole text content (vLLM keeps the
parameters before the fault).
"""

from __future__ import annotations

import json
from typing import Any

from rlhf_core.rl.tool_formats.common import Calls, _NotACall
from rlhf_core.rl.tool_formats.schema_types import coerce, schema_types

MINIMAX_M3_NS = "]<]minimax[>["
MINIMAX_M3_CALLS, MINIMAX_M3_CALLS_END = f"{MINIMAX_M3_NS}<tool_call>", f"{MINIMAX_M3_NS}</tool_call>"
_INVOKE, _INVOKE_END = f"{MINIMAX_M3_NS}<invoke name=", f"{MINIMAX_M3_NS}</invoke>"
_OPEN, _CLOSE = f"{MINIMAX_M3_NS}<", f"{MINIMAX_M3_NS}</"
MIXED_TEXT = "$text"
MAX_DEPTH = 128

Element = str | list  # a text, or (name, Element) children in order


def _element(text: str, at: int, depth: int) -> tuple[str, Element, int]:
    """The element whose tag starts at `at`: (name, value, the position after its closing tag)."""
    if depth > MAX_DEPTH:
        raise _NotACall(text)
    start = at + len(_OPEN)
    end = text.find(">", start)
    name = text[start:end] if end > start else ""
    if not name.strip() or name.startswith("/"):
        raise _NotACall(text)
    close, at, texts, children = f"{_CLOSE}{name}>", end + 1, [], []
    while True:
        marker = text.find(MINIMAX_M3_NS, at)
        if marker < 0:
            raise _NotACall(text)  # never closed
        texts.append(text[at:marker])
        if text.startswith(close, marker):
            at = marker + len(close)
            break
        if not text.startswith(_OPEN, marker) or text.startswith(_CLOSE, marker):
            raise _NotACall(text)
        child, value, at = _element(text, marker, depth + 1)
        children.append((child, value))
    body = "".join(texts)
    if not children:
        return name, body, at
    if body.strip():  # mixed text, under a name no child has
        field = MIXED_TEXT
        while any(child == field for child, _ in children):
            field = "$" + field
        children.append((field, body))
    return name, children, at


def _parameters(body: str) -> list[tuple[str, Element]]:
    out, at = [], 0
    while body[at:].strip():
        at += len(body[at:]) - len(body[at:].lstrip())
        if not body.startswith(_OPEN, at) or body.startswith(_CLOSE, at):
            raise _NotACall(body)
        name, value, at = _element(body, at, 1)
        out.append((name, value))
    return out


def _container(schema: dict) -> tuple[str, dict] | None:
    """The schema's first array or object alternative, and which."""
    kind = schema.get("type")
    for name in ("array", "object"):
        if kind == name or (isinstance(kind, list) and name in kind):
            return name, schema
    if kind is None:
        if "items" in schema:
            return "array", schema
        if "properties" in schema or "additionalProperties" in schema:
            return "object", schema
    for choices in ("anyOf", "oneOf"):
        for choice in schema.get(choices) or ():
            found = _container(choice) if isinstance(choice, dict) else None
            if found:
                return found
    return None


def convert(value: Element, schema: Any):
    schema = schema if isinstance(schema, dict) else None
    container = _container(schema) if schema is not None else None
    if isinstance(value, str):
        if schema is None:
            return value
        types = schema_types(schema)
        if container is not None and "string" not in types and not value.strip():
            return [] if container[0] == "array" else {}
        return coerce(value, types)
    if container is not None and container[0] == "array":
        return [convert(child, container[1].get("items")) for _, child in value]
    return convert_object(value, container[1] if container is not None else None)


def convert_object(elements: list, schema: dict | None) -> dict:
    properties = (schema or {}).get("properties") or {}
    additional = (schema or {}).get("additionalProperties")
    out: dict[str, Any] = {}
    listed: set[str] = set()
    for name, element in elements:
        value = convert(element, properties.get(name, additional))
        if name not in out:
            out[name] = value
        elif name in listed:
            out[name].append(value)
        else:
            out[name], listed = [out[name], value], listed | {name}
    return out


def _invoke_name(text: str) -> tuple[str, str]:
    """(the name, the invoke's body) of the text after `<invoke name=`."""
    quote = text[:1] if text[:1] in "\"'" else ""
    end = text.find(quote + ">", len(quote)) if quote else text.find(">")
    name = text[len(quote):end] if end >= 0 else ""
    if not name.strip():
        raise _NotACall(text)
    return name.strip(), text[end + len(quote) + 1:]


def read_minimax_m3(text: str, properties_of=None) -> Calls:
    """`text`'s calls; `properties_of(name)`: the properties of that tool's parameters in the
    request (None or {} where it gives none)."""
    if MINIMAX_M3_CALLS not in text:
        return text, []
    section = text.split(MINIMAX_M3_CALLS, 1)[1].split(MINIMAX_M3_CALLS_END, 1)[0]
    calls, rest = [], section.strip()
    try:
        while rest:
            if not rest.startswith(_INVOKE) or _INVOKE_END not in rest:
                raise _NotACall(rest)
            name, after = _invoke_name(rest[len(_INVOKE):])
            body, rest = after.split(_INVOKE_END, 1)
            properties = (properties_of(name) if properties_of else None) or {}
            calls.append((name, json.dumps(convert_object(_parameters(body), {"properties": properties}),
                                           ensure_ascii=False)))
            rest = rest.strip()
    except ValueError:
        return text, []
    return (text.split(MINIMAX_M3_CALLS, 1)[0].strip() or None, calls) if calls else (text, [])


def parse_minimax_m3(text: str) -> Calls:
    return read_minimax_m3(text)
