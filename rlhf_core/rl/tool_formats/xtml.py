"""Kimi K3's XTML format (pure): the completion a run of channels, each `<|open|>KIND ATTRS<|sep|>`
BODY `<|close|>KIND<|sep|>`; the calls are the `tools` channel's.

- `kimi_k3` (Kimi K3): in `<|open|>tools<|sep|>...<|close|>tools<|sep|>` (or to the end), each call
  `<|open|>call tool="NAME" index="N"<|sep|>` then its arguments, each `<|open|>argument key="KEY"
  type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>`, then `<|close|>call<|sep|>`. A `string` value (or
  one without a type) is the text as written; any other is JSON (the text where it is not). The
  content is the `response` channel's text, or the text before the calls without its channel markers.
"""

from __future__ import annotations

import json
import re

from rlhf_core.rl.tool_formats.common import Calls, _NotACall

XTML_OPEN, XTML_CLOSE, XTML_SEP = "<|open|>", "<|close|>", "<|sep|>"
_O, _C, _S = map(re.escape, (XTML_OPEN, XTML_CLOSE, XTML_SEP))
_UNTIL_SEP = rf"(?:(?!{_S}).)*?"


def _marker(opens: bool, kind: str) -> re.Pattern:
    """`<|open|>KIND<|sep|>` or `<|close|>KIND<|sep|>`, spaces allowed inside (vLLM's spacing of
    special tokens may leave them)."""
    return re.compile((_O if opens else _C) + rf"\s*{kind}\s*" + _S)


_TOOLS, _TOOLS_END = _marker(True, "tools"), _marker(False, "tools")
_RESPONSE, _RESPONSE_END, _MESSAGE_END = _marker(True, "response"), _marker(False, "response"), _marker(False, "message")
_RESPONSE_BLOCK = re.compile(_RESPONSE.pattern + "(.*?)" + _RESPONSE_END.pattern, re.DOTALL)
_CALL = re.compile(rf"{_O}\s*call\s+({_UNTIL_SEP}){_S}(.*?){_C}\s*call\s*{_S}", re.DOTALL)
_ARGUMENT = re.compile(rf"{_O}\s*argument\s+({_UNTIL_SEP}){_S}(.*?){_C}\s*argument\s*{_S}", re.DOTALL)
_ATTRIBUTE = re.compile(r'(\w+)="([^"]*)"')


def _attributes(written: str) -> dict[str, str]:
    """A tag's `key="value"` attributes, `&quot;` and `&amp;` unescaped (the template escapes them)."""
    return {key: value.replace("&quot;", '"').replace("&amp;", "&") for key, value in _ATTRIBUTE.findall(written)}


def _argument_value(value: str, kind: str):
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value  # vLLM keeps a value that is not JSON as written


def _kimi_k3_call(header: str, body: str) -> tuple[str, str]:
    name = _attributes(header).get("tool", "")
    if not name or _ARGUMENT.sub("", body).strip():
        raise _NotACall(body)  # no name (vLLM drops the call), or something other than arguments in it
    arguments = {}
    for written, value in _ARGUMENT.findall(body):
        attributes = _attributes(written)
        if not attributes.get("key"):
            raise _NotACall(written)  # vLLM names it ""
        arguments[attributes["key"]] = _argument_value(value, attributes.get("type", "string"))
    return name, json.dumps(arguments, ensure_ascii=False)


def _kimi_k3_content(text: str, before: str) -> str | None:
    """The `response` channel's text; else the text before the calls, from after an opening
    `<|open|>response<|sep|>` (its prompt may have written it) and without closing markers."""
    block = _RESPONSE_BLOCK.search(text)
    if block is not None:
        content = block[1]
    elif (opening := _RESPONSE.search(before)) is not None:
        content = before[opening.end():]
    else:
        content = _RESPONSE_END.sub("", before)
    return _MESSAGE_END.sub("", content).strip() or None


def parse_kimi_k3(text: str) -> Calls:
    """Kimi K3: the calls of the first `tools` channel (to its close, or the end); it holds calls and
    nothing else, each of `argument`s with a key (vLLM passes over what it cannot read). The
    content as `_kimi_k3_content` finds it."""
    tools = _TOOLS.search(text)
    if tools is None:
        return text, []
    closing = _TOOLS_END.search(text, tools.end())
    section = text[tools.end(): closing.start() if closing else len(text)]
    if _CALL.sub("", section).strip():
        return text, []
    try:
        calls = [_kimi_k3_call(header, body) for header, body in _CALL.findall(section)]
    except _NotACall:
        return text, []
    return (_kimi_k3_content(text, text[: tools.start()]), calls) if calls else (text, [])
