"""Poolside's Laguna tool calls (pure): GLM-4.5's calls, each value typed as vLLM's poolside_v1 types it.

    Let me add them.<tool_call>add
    <arg_key>a</arg_key>
    <arg_value>2</arg_value>
    <arg_key>note</arg_key>
    <arg_value> keep  spaces </arg_value>
    </tool_call>

- `poolside_v1` (Laguna XS/S): each closed `<tool_call>NAME` then `<arg_key>KEY</arg_key><arg_value>VALUE
  </arg_value>` pairs (whitespace between a key and its value) `</tool_call>`; the name, on one line,
  runs to the first tag. A value the request's tool declares `"type": "string"` is kept verbatim;
  any other (or every one, without the request's tools) is stripped and read as JSON, else as a
  Python literal (`True`, `'a'`, `(1, 2)`), else kept as the stripped text (`read_poolside_v1`).
  The text before the first `<tool_call>` is the content.

The syntax is `glm45`'s (`xml_calls`), the reading not: `glm45` keeps every value as text (typed by
the schema's declared non-string types only) and makes the whole text content for a malformed call.

As vLLM 0.32 reads them, a call it cannot read (no name, a name over two lines, text before its
first key) is passed over, and so is text between pairs; a value read as no JSON value (a Python
set, bytes) or a schema property that is not an object makes the whole text content. Unlike vLLM,
a call whose name is blank (`<tool_call> <arg_key>...`) is passed over too, once its values are read
(vLLM returns a call named `""`).
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from collections.abc import Callable

from rlhf_core.rl.tool_formats.common import END, START, Calls, _NotACall
from rlhf_core.rl.tool_formats.xml_calls import _GLM_ARGUMENT

POOLSIDE_TOOLS = "<available_tools>"  # where Laguna's templates list the request's tools
ARG_KEY = "<arg_key>"
_CLOSED_CALL = re.compile(re.escape(START) + "(.*?)" + re.escape(END), re.DOTALL)
Properties = Callable[[str], dict | None]  # a tool's name -> its parameters' schemas in the request


def _name_and_pairs(body: str) -> tuple[str, str] | None:
    """(the name, the pairs from the first `<arg_key>`) of a call's body, or None where it reads as
    no call; a `<tool_call>` inside the body starts the call again, as vLLM's search does."""
    starts = [0] + [m.end() for m in re.finditer(re.escape(START), body)]
    for start in starts:
        head, tag, rest = body[start:].partition("<")
        if tag and not (tag + rest).startswith(ARG_KEY):
            continue  # the name ends at a tag, which must be the first key
        name = head.strip()
        if "\n" in name:
            continue
        if name or head.strip("\n"):
            return name, tag + rest  # a blank name too (a space): vLLM's call `""`
    return None


def _read_value(text: str):
    """A value not declared a string: JSON, else a Python literal, else the text. Any other failure
    (an integer over Python's digit limit) is let through: vLLM then makes the whole text content."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _declared_string(properties: dict | None, key: str) -> bool:
    schema = (properties or {}).get(key, {})
    if not isinstance(schema, dict):
        raise _NotACall(schema)  # vLLM fails on it, making the whole text content
    return schema.get("type") == "string"


def read_poolside_v1(text: str, properties_of: Properties | None = None) -> Calls:
    """`text`'s calls; `properties_of(name)`: the schemas of that tool's parameters in the request
    (None where it gives none): a parameter declared a string keeps its value verbatim."""
    if START not in text:
        return text, []
    calls = []
    try:
        for body in _CLOSED_CALL.findall(text):
            found = _name_and_pairs(body)
            if found is None:
                continue
            name, pairs = found
            properties = properties_of(name) if properties_of else None
            arguments = {}
            for key, value in _GLM_ARGUMENT.findall(pairs):
                key = key.strip()
                arguments[key] = value if _declared_string(properties, key) else _read_value(value.strip())
            arguments = json.dumps(arguments, ensure_ascii=False)
            if name:  # a call named `""` is passed over once read (its values may fail the text)
                calls.append((name, arguments))
    except (ValueError, TypeError, RecursionError):  # a set, bytes or complex number is no JSON value
        return text, []
    if not calls:
        return text, []
    return text[: text.index(START)].strip() or None, calls


def parse_poolside_v1(text: str) -> Calls:
    return read_poolside_v1(text)
