"""Tool calls in a completion's text, in the Hermes format (pure).

The format the chat templates of Qwen2.5/Qwen3, Hermes and many others teach: each call is a JSON
object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>` (the last one
may be left open when the completion ends there). The policy endpoint returns such calls as OpenAI
`tool_calls`, as vLLM's `hermes` parser does: the text before the first call is the message's
content (None when blank), and if any call is not a JSON object with a string `name`, nothing is a
call and the whole text is content.
"""

from __future__ import annotations

import json
import re

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments as a JSON string), ...]) of a completion's text."""
    if START not in text:
        return text, []
    calls = []
    for body in _BLOCK.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append((call["name"], arguments if isinstance(arguments, str)
                      else json.dumps(arguments, ensure_ascii=False)))
    content = text[: text.index(START)].strip()
    return content or None, calls
