"""Formats whose calls stand in one section, each call between its own begin and end tokens and
its arguments a JSON object (pure).

- `deepseek_v3` (DeepSeek-V3, R1): between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, each
  call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, a newline and its arguments in a ```json
  fence, then `<｜tool▁call▁end｜>`; `deepseek_v31` (V3.1 and later): `<｜tool▁call▁begin｜>NAME
  <｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`; the text before the calls is the content.
- `kimi_k2`: between `<|tool_calls_section_begin|>` and `<|tool_calls_section_end|>`, each call
  `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>`
  (the name is the header's last dotted part before `:INDEX`); the text before is the content.
- `plamo3` (PLaMo 3): between `<|plamo:begin_tool_requests:plamo|>` and its `end_` tag, each call
  `<|plamo:begin_tool_request:plamo|>`, the name between `begin_tool_name` and `end_tool_name`, the
  arguments (JSON) after `<|plamo:begin_tool_arguments:plamo|><|plamo:constrain|>json<|plamo:msg|>`
  up to `end_tool_arguments`, then `<|plamo:end_tool_request:plamo|>`; the text before is the
  content (the thinking in it, as the other formats keep theirs).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from rlhf_core.rl.tool_formats.common import Calls, _NotACall

DEEPSEEK_CALLS, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL, DEEPSEEK_SEP, DEEPSEEK_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def _sectioned(text: str, begin: str, end: str, call: str, call_end: str,
               read: Callable[[str], tuple[str, str]]) -> Calls:
    """Calls in a section from `begin` to `end` (or the text's end), each `call` BODY `call_end`
    and read by `read(BODY)`; the text before `begin` is the content. Anything else in the section,
    no call at all, or a body `read` refuses (ValueError): no call, the whole text content."""
    if begin not in text:
        return text, []
    section = text[text.index(begin) + len(begin):]
    rest, calls = (section[: section.index(end)] if end in section else section).strip(), []
    try:
        while rest:
            if not rest.startswith(call) or call_end not in rest:
                raise _NotACall(rest)
            body, rest = rest[len(call):].split(call_end, 1)
            calls.append(read(body))
            rest = rest.strip()
    except ValueError:
        return text, []
    return (text[: text.index(begin)].strip() or None, calls) if calls else (text, [])


def _json_arguments(raw: str) -> str:
    arguments = json.loads(raw)  # ValueError when it is not JSON
    if not isinstance(arguments, dict):
        raise _NotACall(raw)
    return json.dumps(arguments, ensure_ascii=False)


def _deepseek_v3_call(body: str) -> tuple[str, str]:
    match = re.fullmatch(r"(\w+)" + re.escape(DEEPSEEK_SEP) + r"([^\n]+)\n```json\n(.*)\n```", body, re.DOTALL)
    if match is None:
        raise _NotACall(body)
    return match[2].strip(), _json_arguments(match[3])


def _deepseek_v31_call(body: str) -> tuple[str, str]:
    name, sep, arguments = body.partition(DEEPSEEK_SEP)
    if not sep or not name.strip():
        raise _NotACall(body)
    return name.strip(), _json_arguments(arguments)


def parse_deepseek_v3(text: str) -> Calls:
    return _sectioned(text, DEEPSEEK_CALLS, DEEPSEEK_CALLS_END, DEEPSEEK_CALL, DEEPSEEK_CALL_END, _deepseek_v3_call)


def parse_deepseek_v31(text: str) -> Calls:
    return _sectioned(text, DEEPSEEK_CALLS, DEEPSEEK_CALLS_END, DEEPSEEK_CALL, DEEPSEEK_CALL_END, _deepseek_v31_call)


KIMI_CALLS, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def _kimi_call(body: str) -> tuple[str, str]:
    header, sep, arguments = body.partition(KIMI_ARGS)
    match = re.fullmatch(r"(?:[\w\-]+\.)*([\w\-]+):\d+", header.strip())
    if not sep or match is None:
        raise _NotACall(body)
    return match[1], _json_arguments(arguments)


def parse_kimi_k2(text: str) -> Calls:
    return _sectioned(text, KIMI_CALLS, KIMI_CALLS_END, KIMI_CALL, KIMI_CALL_END, _kimi_call)


PLAMO_CALLS, PLAMO_CALLS_END = "<|plamo:begin_tool_requests:plamo|>", "<|plamo:end_tool_requests:plamo|>"
PLAMO_CALL, PLAMO_CALL_END = "<|plamo:begin_tool_request:plamo|>", "<|plamo:end_tool_request:plamo|>"
_PLAMO_CALL = re.compile(r"\s*<\|plamo:begin_tool_name:plamo\|>(.*?)<\|plamo:end_tool_name:plamo\|>\s*"
                         r"<\|plamo:begin_tool_arguments:plamo\|><\|plamo:constrain\|>json<\|plamo:msg\|>"
                         r"(.*?)<\|plamo:end_tool_arguments:plamo\|>\s*", re.DOTALL)


def _plamo_call(body: str) -> tuple[str, str]:
    match = _PLAMO_CALL.fullmatch(body)
    if match is None or not match[1].strip():
        raise _NotACall(body)
    return match[1].strip(), _json_arguments(match[2].strip() or "{}")


def parse_plamo3(text: str) -> Calls:
    return _sectioned(text, PLAMO_CALLS, PLAMO_CALLS_END, PLAMO_CALL, PLAMO_CALL_END, _plamo_call)
