"""Formats whose calls are each one JSON object `{"name": ..., "arguments"|"parameters": ...}`, in
or after a marker (pure).

- `hermes` (Qwen2.5/Qwen3, Hermes and many others): each call a JSON object `{"name": ...,
  "arguments": {...}}` between `<tool_call>` and `</tool_call>` (the last may be left open at the
  end); the text before the first call is the content (None when blank).
- `llama3_json` (Llama 3.1/3.2/3.3's JSON tool calling): JSON objects with `name` and `arguments`
  (or `parameters`), optionally after `<|python_tag|>` and separated by `;`; with calls, no
  content.
- `internlm2`: one call, `<|action_start|><|plugin|>{"name": ..., "parameters": ...}<|action_end|>`;
  `longcat` (LongCat-Flash): Hermes' calls in `<longcat_tool_call>`; `ernie45` (ERNIE-4.5): JSON
  call objects in `<tool_call>` (blocks holding no object passed over). The text before is the content.
- `granite4` (Granite 4): Hermes' closed `<tool_call>` blocks; all the text outside them is the content.
- `gigachat3` (GigaChat 3, 3.1): one call object, the rest of the completion after `function
  call<|role_sep|>` (3) or `<|function_call|>` (3.1); the text before is the content.
- `granite-20b-fc` (granite-20b-functioncalling): each call a JSON object after its own
  `<function_call>`; the text before the first is the content.
"""

from __future__ import annotations

import json
import re

from rlhf_core.rl.tool_formats.common import (
    _BLOCK,
    _DECODER,
    END,
    START,
    Calls,
    _arguments,
    _named_call,
    _NotACall,
)

PYTHON_TAG = "<|python_tag|>"


def _json_blocks(text: str, start: str, block: re.Pattern) -> Calls:
    """Calls each a JSON call object in a `block` opened by `start` (the last may be left open);
    the text before the first is the content."""
    if start not in text:
        return text, []
    try:
        calls = [_named_call(json.loads(body)) for body in block.findall(text)]
    except ValueError:  # not JSON, or not a call (_NotACall is a ValueError)
        return text, []
    content = text[: text.index(start)].strip()
    return content or None, calls


def parse_hermes(text: str) -> Calls:
    return _json_blocks(text, START, _BLOCK)


LONGCAT_CALL, LONGCAT_CALL_END = "<longcat_tool_call>", "</longcat_tool_call>"
_LONGCAT_BLOCK = re.compile(re.escape(LONGCAT_CALL) + r"(.*?)(?:" + re.escape(LONGCAT_CALL_END) + r"|\Z)", re.DOTALL)


def parse_longcat(text: str) -> Calls:
    """LongCat-Flash: Hermes' calls between `<longcat_tool_call>` and `</longcat_tool_call>`."""
    return _json_blocks(text, LONGCAT_CALL, _LONGCAT_BLOCK)


_ERNIE_CALL = re.compile(re.escape(START) + r"\s*(\{.*?\})\s*" + re.escape(END), re.DOTALL)


def parse_ernie45(text: str) -> Calls:
    """ERNIE-4.5: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks (one not closed,
    or not holding an object, is passed over, as vLLM does); the text before the first
    `<tool_call>` is the content. A call without a name is malformed (vLLM names it "")."""
    if START not in text:
        return text, []
    calls = []
    try:
        for body in _ERNIE_CALL.findall(text):
            obj = json.loads(body)
            if not isinstance(obj.get("name"), str) or not obj["name"]:
                raise _NotACall(obj)
            calls.append((obj["name"], _arguments(obj.get("arguments", {}))))
    except ValueError:
        return text, []
    return (text[: text.index(START)].strip() or None, calls) if calls else (text, [])


def parse_llama3_json(text: str) -> Calls:
    body = text.replace(PYTHON_TAG, "")
    if "{" not in body:
        return text, []
    calls, end = [], -1
    try:
        for match in re.finditer(r"\{", body):
            if match.start() < end:
                continue  # inside the object just read
            obj, length = _DECODER.raw_decode(body[match.start():])
            if "arguments" not in obj and "parameters" not in obj:
                raise _NotACall(obj)
            calls.append(_named_call(obj))
            end = match.start() + length
    except (ValueError, TypeError):
        return text, []
    return None, calls


INTERNLM_CALL, INTERNLM_CALL_END = "<|action_start|><|plugin|>", "<|action_end|>"


def parse_internlm2(text: str) -> Calls:
    """InternLM2: one call, `<|action_start|><|plugin|>` then a JSON object `{"name": ...,
    "parameters"|"arguments": ...}` up to `<|action_end|>` (or the end); the text before is the
    content. A second call is malformed (vLLM reads only one)."""
    if text.count(INTERNLM_CALL) != 1:
        return text, []
    before, action = text.split(INTERNLM_CALL)
    action = action.split(INTERNLM_CALL_END)[0]
    try:
        obj = json.loads(action[action.index("{"):])  # what comes before the object is passed over
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise _NotACall(obj)
    except ValueError:
        return text, []
    return before.strip() or None, [(obj["name"], _arguments(obj.get("parameters", obj.get("arguments", {}))))]


_TAGS = re.compile(re.escape(START) + "|" + re.escape(END))


def parse_granite4(text: str) -> Calls:
    """Granite 4: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks, each closed and
    holding a call object with both keys; the text outside them (before, between and after) is the
    content. A block opened twice, closed unopened or left open is malformed, as in vLLM."""
    outside, calls, at, inside = [], [], 0, False
    try:
        for tag in _TAGS.finditer(text):
            if (tag[0] == START) == inside:
                raise _NotACall(text)
            if inside:
                obj = json.loads(text[at:tag.start()])
                if not isinstance(obj, dict) or obj.get("arguments") is None:
                    raise _NotACall(obj)
                calls.append(_named_call(obj))
            else:
                outside.append(text[at:tag.start()])
            inside, at = not inside, tag.end()
        if inside:
            raise _NotACall(text)
    except ValueError:
        return text, []
    return ("".join(outside + [text[at:]]).strip() or None, calls) if calls else (text, [])


GIGACHAT_CALL, GIGACHAT3_CALL, GIGACHAT_MESSAGE_SEP = "<|function_call|>", "function call<|role_sep|>\n", "<|message_sep|>"
_GIGACHAT_CALL = re.compile("(?:" + re.escape(GIGACHAT3_CALL) + "|" + re.escape(GIGACHAT_CALL) + ")(.*)", re.DOTALL)
_GIGACHAT_CONTENT_END = re.compile(re.escape(GIGACHAT_MESSAGE_SEP) + "|" + re.escape(GIGACHAT_CALL))
GIGACHAT_EOS = "</s>"


def parse_gigachat3(text: str) -> Calls:
    """GigaChat 3 (and 3.1): one call, the rest of the completion after `function call<|role_sep|>`
    and a newline (3; after a `<|message_sep|>`) or after `<|function_call|>` (3.1), a JSON object
    `{"name": ..., "arguments": {...}}` (raw control characters allowed in its strings; a final
    `</s>` dropped). Arguments that are not an object, or text after the object, are malformed. The
    text before the first `<|message_sep|>` or `<|function_call|>` (or before the call) is the content."""
    body = text.rstrip()
    body = body[: -len(GIGACHAT_EOS)] if body.endswith(GIGACHAT_EOS) else text
    call = _GIGACHAT_CALL.search(body)
    if call is None:
        return text, []
    try:
        obj = json.loads(call[1], strict=False)
    except ValueError:
        return text, []
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
        return text, []
    end = _GIGACHAT_CONTENT_END.search(body)
    content = body[: end.start() if end else call.start()].strip() or None
    return content, [(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))]


GRANITE_FC_CALL = "<function_call>"
_GRANITE_FC_CALL = re.compile(re.escape(GRANITE_FC_CALL) + r"\s*")


def parse_granite_20b_fc(text: str) -> Calls:
    """granite-20b-functioncalling: each call `<function_call>` then a JSON object with both `name`
    and `arguments` (what follows the object, up to the next `<function_call>`, is passed over, as
    vLLM's reader does); the text before the first marker is the content."""
    marks = list(_GRANITE_FC_CALL.finditer(text))
    if not marks:
        return text, []
    calls = []
    try:
        for mark, after in zip(marks, [*marks[1:], None], strict=True):
            obj, _ = _DECODER.raw_decode(text[mark.end() : after.start() if after else None])
            if not isinstance(obj, dict) or "arguments" not in obj:
                raise _NotACall(obj)
            calls.append(_named_call(obj))
    except ValueError:
        return text, []
    return text[: marks[0].start()].strip() or None, calls
