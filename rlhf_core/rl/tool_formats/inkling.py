"""Inkling's tool calls (pure): the completion a run of typed blocks, each opened by its kind's
marker and closed by `<|end_message|>` (or `<|content_model_end_sampling|>`); a model block may
start with `<|message_model|>` and a header (the called tool's name). Each tool block holds one
JSON object, the tool's name and its `args`.

    <|content_thinking|>The weather, then.<|end_message|>
    <|message_model|><|content_text|>Checking.<|end_message|>
    <|message_model|>get_weather<|content_invoke_tool_json|>
    {"name":"get_weather","args":{"city":"SF"}}<|end_message|>
    <|content_model_end_sampling|>

Read as vLLM 0.32's inkling reads a whole completion, from between blocks: a `<|content_thinking|>`
block is thinking, not content (a tool block may open in it); the text of the other blocks and
between them is content, and so is a header closed without a block kind, while a header before a
kind (the tool's name) is dropped. vLLM's tool parser starts between blocks, not in the header the
prompt's `<|message_model|>` opens: a name the model writes first, without its own
`<|message_model|>`, is content. In a tool block the other markers are text; the last block may be
left open at the end. The content is the text, stripped (None when blank).

A tool block's JSON names the tool (`name`, stripped) and gives its arguments as an object, or a
string holding one, under `args` (none: `{}`; vLLM reads no `arguments` or `parameters` key where
`args` is missing). A block without a name (or an empty or null one) is passed over, as vLLM does.
Not JSON (text after the object too), not an object, a name that is blank or not text, arguments
that are no object (vLLM passes them on as written), a number that is not finite: malformed, no
call, the whole text content (vLLM reads what it can of a block, its name the first
`"name": "..."` written in it, at whatever depth, and passes over one where it finds none).
With no call the whole text is the content (vLLM gives the text of the blocks).

The request's tool schema types the arguments as vLLM does (`typed`): a value whose parameter it
describes is read as its types (`schema_types.coerce`; a value that is not text from its JSON), nested where
the schema gives the `properties` of an object or the `items` of an array. vLLM also drops every
special token of the tokenizer that is not Inkling's, and reads no call where the request has
tools and its `tool_choice` is `none`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from rlhf_core.rl.tool_formats.common import Calls, _NotACall
from rlhf_core.rl.tool_formats.schema_types import coerce, schema_types

MESSAGE_MODEL = "<|message_model|>"
CONTENT_TEXT, CONTENT_THINKING = "<|content_text|>", "<|content_thinking|>"
INKLING_CALL, INKLING_TOOL_TEXT, INKLING_TOOL_ERROR = (
    "<|content_invoke_tool_json|>", "<|content_invoke_tool_text|>", "<|content_tool_error|>")
END_MESSAGE, END_SAMPLING = "<|end_message|>", "<|content_model_end_sampling|>"
_MARKER = re.compile("|".join(map(re.escape, (MESSAGE_MODEL, CONTENT_TEXT, CONTENT_THINKING, INKLING_CALL,
                                               INKLING_TOOL_TEXT, INKLING_TOOL_ERROR, END_MESSAGE, END_SAMPLING))))
_ENDS = (END_MESSAGE, END_SAMPLING)
_BETWEEN, _HEADER, _THINKING, _TOOL = "between", "header", "thinking", "tool"


def _blocks(text: str) -> tuple[list[str], list[str]]:
    """(the content's pieces, each tool block's text) of a completion read from between blocks."""
    content, tools, state, header, at = [], [], _BETWEEN, "", 0
    for marker in _MARKER.finditer(text):
        written, kind = text[at: marker.start()], marker[0]
        at = marker.end()
        if state == _TOOL:
            if kind not in _ENDS:
                tools[-1] += written + kind  # another marker is text in a tool block
                continue
            tools[-1] += written
        elif state == _HEADER:
            header += written
        elif state == _BETWEEN:
            content.append(written)
        if state == _THINKING and kind not in _ENDS + (INKLING_CALL,):
            continue  # the other markers are thinking too
        if state == _HEADER and kind in _ENDS:
            content.append(header)  # a header closed without a block kind is text
        state = (_HEADER if kind == MESSAGE_MODEL else _THINKING if kind == CONTENT_THINKING
                 else _TOOL if kind == INKLING_CALL else _BETWEEN)
        header = ""
        if state == _TOOL:
            tools.append("")
    rest = text[at:]
    if state == _TOOL:
        tools[-1] += rest
    elif state in (_HEADER, _BETWEEN):
        content.append(header + rest)
    return content, tools


def typed(value: Any, schema: dict):
    """A JSON value as its parameter's schema types it: text read as the schema's types, another
    scalar from its JSON; an object's values by the schema's `properties`, an array's by its `items`."""
    if isinstance(value, dict):
        properties = schema.get("properties")
        return typed_object(value, properties) if isinstance(properties, dict) else value
    if isinstance(value, list):
        items = schema.get("items")
        return [typed(item, items) for item in value] if isinstance(items, dict) else value
    written = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return coerce(written, schema_types(schema))


def typed_object(values: dict, properties: dict) -> dict:
    return {key: typed(value, properties[key]) if isinstance(properties.get(key), dict) else value
            for key, value in values.items()}


def _inkling_call(block: str, properties_of: Callable[[str], dict | None] | None) -> tuple[str, str] | None:
    """A tool block's call; None where it names no tool."""
    call = json.loads(block.strip())  # ValueError when it is not JSON
    if not isinstance(call, dict) or not isinstance(call.get("name") or "", str):
        raise _NotACall(block)
    if not call.get("name"):
        return None  # no name, or an empty or null one: vLLM passes it over
    name = call["name"].strip()
    arguments = call.get("args", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not name or not isinstance(arguments, dict):
        raise _NotACall(block)
    properties = properties_of(name) if properties_of else None
    if properties:
        arguments = typed_object(arguments, properties)
    return name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)


def read_inkling(text: str, properties_of: Callable[[str], dict | None] | None = None) -> Calls:
    """`text`'s calls; `properties_of(name)`: the properties of that tool's parameters in the
    request (None or {} where it gives none)."""
    if INKLING_CALL not in text:
        return text, []
    content, blocks = _blocks(text)
    try:
        calls = [call for block in blocks if (call := _inkling_call(block, properties_of)) is not None]
    except ValueError:  # not a call (_NotACall), not JSON, or a number that is not finite
        return text, []
    return ("".join(content).strip() or None, calls) if calls else (text, [])


def parse_inkling(text: str) -> Calls:
    return read_inkling(text)
