"""What the tool-call formats share (pure): the `Calls` a parser returns, the error that makes a
text no call, Hermes' `<tool_call>` block and the `<tool_calls>` section's markers (which several
formats reuse) and the reading of a JSON call object `{"name": ..., "arguments"|"parameters": ...}`."""

from __future__ import annotations

import json
import re

Calls = tuple[str | None, list[tuple[str, str]]]
START, END = "<tool_call>", "</tool_call>"
TOOL_CALLS, TOOL_CALLS_END = "<tool_calls>", "</tool_calls>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.DOTALL)
_DECODER = json.JSONDecoder()


class _NotACall(ValueError):
    pass


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _named_call(obj) -> tuple[str, str]:
    """(name, arguments) of a call object `{"name": str, "arguments"|"parameters": ...}`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise _NotACall(obj)
    return obj["name"], _arguments(obj.get("arguments", obj.get("parameters", {})))
