"""K2 Horizon's IFM tool calls (pure): one `<ifm|tool_calls>` group of `<ifm|tool_call>` calls,
written in the format the request's `tool_call_format` chat-template argument names (`xml`, the
default, `xml_typed` or `json`).

    Let me look.<ifm|tool_calls><ifm|tool_call>get_weather
    <ifm|arg_key>city</ifm|arg_key><ifm|arg_value>Paris</ifm|arg_value>
    <ifm|arg_key>days</ifm|arg_key><ifm|arg_value>3</ifm|arg_value></ifm|tool_call></ifm|tool_calls>

- `xml`: each call the tool's name, then `<ifm|arg_key>KEY</ifm|arg_key><ifm|arg_value>VALUE
  </ifm|arg_value>` pairs (whitespace between the tags), or the name alone; `xml_typed`: each pair
  `<ifm|arg_key>KEY</ifm|arg_key><ifm|arg_type>TYPE</ifm|arg_type><ifm|arg_value>VALUE</ifm|arg_value>`;
  `json`: each call `{"name": ..., "arguments": {...}}` (no arguments: `{}`).

Read as vLLM 0.32's k2_horizon reads a whole completion: the first `<ifm|tool_calls>`, closed by
`</ifm|tool_calls>`, holds calls and whitespace only; a name is non-empty and without whitespace
(and names a tool of the request's, where `known` says which); a key is non-empty and not repeated;
`xml` writes no type and `xml_typed` one for each pair. Anything else is malformed: no call, the
whole text content. The content is the text before and after the group (its thinking,
`<ifm|think>...</ifm|think>`, with it), stripped (vLLM keeps its whitespace; None when blank).

Values are typed as vLLM types them (`xml_value`, `json_value`): by the types the request's
schema gives the parameter (one of them where the written type is among several), else by the
written type (`any`: the text as written), else the text as written (`xml` values without a
schema stay verbatim). A value is read as the first of null, integer, number, boolean, object,
array, string that reads it (`schema_types.coerce`), stripped unless a string is allowed, failing all JSON
where it reads, else the text. A JSON value with a schema is read so from its JSON (a string from
its text). A number that is not finite is malformed.

vLLM also reads no call where the request's `tool_choice` is `none` (as it is without tools) or
names another tool; the request's choice is not known here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from rlhf_core.rl.tool_formats.common import Calls, _NotACall
from rlhf_core.rl.tool_formats.schema_types import coerce, schema_types

K2_HORIZON_CALLS, K2_HORIZON_CALLS_END = "<ifm|tool_calls>", "</ifm|tool_calls>"
K2_HORIZON_CALL, K2_HORIZON_CALL_END = "<ifm|tool_call>", "</ifm|tool_call>"
ARG_KEY, ARG_KEY_END = "<ifm|arg_key>", "</ifm|arg_key>"
ARG_TYPE, ARG_TYPE_END = "<ifm|arg_type>", "</ifm|arg_type>"
ARG_VALUE, ARG_VALUE_END = "<ifm|arg_value>", "</ifm|arg_value>"
XML, XML_TYPED, JSON = "xml", "xml_typed", "json"
TOOL_FORMATS = (XML, XML_TYPED, JSON)

_ARG_TAGS = (ARG_KEY, ARG_KEY_END, ARG_TYPE, ARG_TYPE_END, ARG_VALUE, ARG_VALUE_END)
_CALL = re.compile(re.escape(K2_HORIZON_CALL) + "(.*?)" + re.escape(K2_HORIZON_CALL_END), re.DOTALL)
_PAIR = re.compile(rf"{re.escape(ARG_KEY)}(.*?){re.escape(ARG_KEY_END)}\s*"
                   rf"(?:{re.escape(ARG_TYPE)}(.*?){re.escape(ARG_TYPE_END)}\s*)?"
                   rf"{re.escape(ARG_VALUE)}(.*?){re.escape(ARG_VALUE_END)}", re.DOTALL)

PropertiesOf = Callable[[str], dict | None]


def xml_value(text: str, schema: Any, written: str | None):
    """An XML value as its schema (a dict, or None) and its written type (`xml_typed`) type it."""
    base = written.split("[", 1)[0].strip().lower() if written else None
    types = schema_types(schema)
    if isinstance(schema, dict):
        if base in types and len(types) > 1:
            types = {base}
    elif base == "any":
        return text
    elif base:
        types = {base}
    return coerce(text if "string" in types else text.strip(), types)


def json_value(value: Any, schema: Any):
    """A JSON call's value as its schema types it: as written where there is none."""
    if not isinstance(schema, dict):
        return value
    return coerce(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, allow_nan=False),
                  schema_types(schema))


def _name(written: Any, known: Callable[[str], bool] | None) -> str:
    if not isinstance(written, str) or not written or any(c.isspace() for c in written):
        raise _NotACall(written)
    if known is not None and not known(written):
        raise _NotACall(written)  # vLLM: a tool the request does not declare
    return written


def _xml_call(body: str, tool_format: str, properties_of: PropertiesOf | None,
              known: Callable[[str], bool] | None) -> tuple[str, dict]:
    first = body.find(ARG_KEY)
    if first < 0:
        if any(tag in body for tag in _ARG_TAGS):
            raise _NotACall(body)
        return _name(body.strip(), known), {}
    name = _name(body[:first].strip(), known)
    properties = (properties_of(name) if properties_of else None) or {}
    arguments, at = {}, first
    while at == first or body[at:].strip():
        at += len(body[at:]) - len(body[at:].lstrip())
        pair = _PAIR.match(body, at)
        if pair is None:
            raise _NotACall(body)
        key, written, value = pair[1].strip(), pair[2], pair[3]
        written = written.strip() if written is not None else None
        if not key or key in arguments or (tool_format == XML and written is not None) or (
                tool_format == XML_TYPED and not written):
            raise _NotACall(body)
        arguments[key] = xml_value(value, properties.get(key), written)
        at = pair.end()
    return name, arguments


def _json_call(body: str, properties_of: PropertiesOf | None, known: Callable[[str], bool] | None) -> tuple[str, dict]:
    call = json.loads(body.strip())  # ValueError when it is not JSON
    if not isinstance(call, dict):
        raise _NotACall(body)
    name = _name(call.get("name"), known)
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        raise _NotACall(body)
    properties = (properties_of(name) if properties_of else None) or {}
    return name, {key: json_value(value, properties.get(key)) for key, value in arguments.items()}


def read_k2_horizon(text: str, properties_of: PropertiesOf | None = None, tool_format: str = XML,
                    known: Callable[[str], bool] | None = None) -> Calls:
    """`text`'s calls written in `tool_format`; `properties_of(name)`: the properties of that tool's
    parameters in the request (None or {} where it gives none); `known(name)`: whether the request
    declares that tool (None: any name, as where it declares none)."""
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"tool_format {tool_format!r} is not one of {TOOL_FORMATS}")
    start = text.find(K2_HORIZON_CALLS)
    end = text.find(K2_HORIZON_CALLS_END, start + len(K2_HORIZON_CALLS)) if start >= 0 else -1
    if end < 0:
        return text, []
    group = text[start + len(K2_HORIZON_CALLS): end]
    bodies = _CALL.findall(group)
    if not bodies or _CALL.sub("", group).strip():
        return text, []
    try:
        calls = [_json_call(body, properties_of, known) if tool_format == JSON
                 else _xml_call(body, tool_format, properties_of, known) for body in bodies]
        calls = [(name, json.dumps(arguments, ensure_ascii=False, allow_nan=False))
                 for name, arguments in calls]
    except ValueError:  # not a call (_NotACall), not JSON, or a number that is not finite
        return text, []
    return (text[:start] + text[end + len(K2_HORIZON_CALLS_END):]).strip() or None, calls


def parse_k2_horizon(text: str, tool_format: str = XML) -> Calls:
    return read_k2_horizon(text, tool_format=tool_format)
