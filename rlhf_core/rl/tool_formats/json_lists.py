"""Formats whose calls are a JSON list after or inside a marker (pure).

- `mistral`: `[TOOL_CALLS]` then either a JSON list of `{"name", "arguments"}` objects (the older
  tokenizers) or `name[ARGS]{...}` per call (v11 and later); the text before it is the content.
- `granite` (Granite 3.0/3.1): `<|tool_call|>` (3.0) or `<tool_call>` (3.1) then a JSON list of
  call objects; the text before the marker is the content.
- `jamba`: the first closed `<tool_calls>...</tool_calls>`, a JSON list of call objects;
  `hunyuan_a13b`: the same section, the first outside `<think>...</think>` holding JSON. The text
  before it is the content.
- `xlam` (Salesforce xLAM): a JSON list of `{"name", "arguments"}`, bare, fenced, after
  `[TOOL_CALLS]`, in `<tool_call>` or after `</think>` (the rest is the content); `phi4_mini_json`
  (Phi-4-mini): `functools[...]`, a JSON list of calls, no content.
- `apertus` (Apertus): `<|tools_prefix|>[{"NAME": {ARGUMENTS}}, ...]<|tools_suffix|>`; the text
  around it is the content.
- `minimax` (MiniMax-M1): call objects one a line in `<tool_calls>...</tool_calls>` outside the
  thinking; the text before is the content. `qwen2_5_coder` (Qwen2.5-Coder): a call object, a JSON
  list of them or one a line in `<tools>...</tools>`; the text outside the blocks is the content.
"""

from __future__ import annotations

import json
import re

from rlhf_core.rl.tool_formats.common import (
    _DECODER,
    END,
    START,
    TOOL_CALLS,
    TOOL_CALLS_END,
    Calls,
    _arguments,
    _named_call,
    _NotACall,
)

MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def parse_mistral(text: str) -> Calls:
    if MISTRAL_CALLS not in text:
        return text, []
    content = text[: text.index(MISTRAL_CALLS)].strip() or None
    calls = []
    try:
        for part in text.split(MISTRAL_CALLS)[1:]:
            part = part.strip()
            if part.startswith("["):  # a JSON list of call objects
                listed, _ = _DECODER.raw_decode(part)
                if not isinstance(listed, list) or not listed:
                    raise _NotACall(listed)
                calls += [_named_call(obj) for obj in listed]
                continue
            while part:  # name[ARGS]{...}, one after another
                name, sep, rest = part.partition(MISTRAL_ARGS)
                if not sep or not re.fullmatch(r"[\w.\-]+", name.strip()):
                    raise _NotACall(part)
                arguments, length = _DECODER.raw_decode(rest.lstrip())
                calls.append((name.strip(), _arguments(arguments)))
                part = rest.lstrip()[length:].strip()
    except ValueError:
        return text, []
    return (content, calls) if calls else (text, [])


GRANITE_MARKERS = ("<|tool_call|>", START)


def parse_granite(text: str) -> Calls:
    marker = next((m for m in GRANITE_MARKERS if m in text), None)
    if marker is None:
        return text, []
    try:
        listed, _ = _DECODER.raw_decode(text[text.index(marker) + len(marker):].lstrip())
        if not isinstance(listed, list) or not listed:
            raise _NotACall(listed)
        calls = [_named_call(obj) for obj in listed]
    except ValueError:
        return text, []
    return text[: text.index(marker)].strip() or None, calls


_UNPARSED = object()


def _json_or_unparsed(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return _UNPARSED


def _first_json(raws) -> object:
    return next((v for v in map(_json_or_unparsed, raws) if v is not _UNPARSED), _UNPARSED)


_TOOL_CALLS_SECTION = re.compile(re.escape(TOOL_CALLS) + r"(.*?)" + re.escape(TOOL_CALLS_END), re.DOTALL)


def parse_jamba(text: str) -> Calls:
    """Jamba: the first closed `<tool_calls>...</tool_calls>`, a JSON list of `{"name", "arguments"}`
    objects, every one a call; the text before it is the content."""
    section = _TOOL_CALLS_SECTION.search(text)
    if section is None:
        return text, []
    try:
        listed = json.loads(section[1])
        if not isinstance(listed, list) or not listed or any(
                not isinstance(obj, dict) or "arguments" not in obj for obj in listed):
            raise _NotACall(listed)
        calls = [_named_call(obj) for obj in listed]
    except ValueError:
        return text, []
    return text[: section.start()].strip() or None, calls


_THINKING = re.compile(r"<think>.*?</think>", re.DOTALL)


def _hunyuan_listing(text: str) -> tuple[int, object]:
    """(where it starts, its JSON) of the first closed `<tool_calls>` section that is not inside a
    `<think>...</think>` and holds JSON; (-1, _UNPARSED) when there is none."""
    thinking = [m.span() for m in _THINKING.finditer(text)]
    for section in _TOOL_CALLS_SECTION.finditer(text):
        if any(begin < section.start() and section.end() < end for begin, end in thinking):
            continue
        found = _json_or_unparsed(section[1])
        if found is not _UNPARSED:
            return section.start(), found
    return -1, _UNPARSED


def parse_hunyuan_a13b(text: str) -> Calls:
    """Hunyuan-A13B: `<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>`, the first
    such section outside the thinking whose text is JSON; an item without a name or arguments is
    passed over, as vLLM does. The text before the section (the thinking with it) is the content."""
    start, listed = _hunyuan_listing(text)
    if not isinstance(listed, list):
        return text, []
    calls = []
    for item in listed:
        if not isinstance(item, dict) or "name" not in item or "arguments" not in item:
            continue
        if not isinstance(item["name"], str) or not isinstance(item["arguments"], dict | str):
            return text, []  # vLLM's call would not validate: all content
        calls.append((item["name"], _arguments(item["arguments"])))
    return (text[:start].strip() or None, calls) if calls else (text, [])


THINK_END = "</think>"
_XLAM_BLOCKS = (re.compile(r"```(?:json)?\s*([\s\S]*?)```"), re.compile(r"\[TOOL_CALLS\]([\s\S]*?)(?=\n|$)"),
                re.compile(re.escape(START) + r"([\s\S]*?)" + re.escape(END)))


def _xlam_listing(text: str) -> tuple[str | None, object]:
    """(content, the parsed JSON of the calls) as xLAM writes them: the text after `</think>`, or a
    ```json fence, a `[TOOL_CALLS]` line or a `<tool_call>` block (the first that parses), or the
    whole completion as a JSON list; (text, _UNPARSED) when there is none. Each candidate is parsed once."""
    if THINK_END in text:
        cut = text.index(THINK_END) + len(THINK_END)
        head, tail = text[:cut].strip(), text[cut:].strip()
        for candidates in ([tail], *(block.findall(tail) for block in _XLAM_BLOCKS)):
            found = _first_json(candidates)
            if found is not _UNPARSED:
                return head, found
    for block in _XLAM_BLOCKS:
        found = _first_json(block.findall(text))
        if found is not _UNPARSED:
            return block.sub("", text).strip(), found
    return None, _json_or_unparsed(text) if text.strip().startswith("[") else _UNPARSED


def parse_xlam(text: str) -> Calls:
    """xLAM (Salesforce): a JSON list of `{"name", "arguments"}` objects, bare or in a ```json
    fence, after `[TOOL_CALLS]`, in a `<tool_call>` block or after `</think>`; the text around it
    is the content. An item without a name or arguments is passed over, as vLLM does."""
    content, listed = _xlam_listing(text)
    if not isinstance(listed, list):
        return text, []
    calls = [(item["name"], _arguments(item["arguments"])) for item in listed
             if isinstance(item, dict) and isinstance(item.get("name"), str) and "arguments" in item]
    return (content or None, calls) if calls else (text, [])


PHI4_CALLS = "functools"


def parse_phi4_mini_json(text: str) -> Calls:
    """Phi-4-mini: `functools[{"name": ..., "arguments"|"parameters": ...}, ...]`; with calls, no
    content. The list is read as JSON to its own end, so arguments holding `]` read whole (vLLM's
    reading stops at the first `]`)."""
    at = text.find(PHI4_CALLS + "[")
    if at < 0:
        return text, []
    try:
        listed, _ = _DECODER.raw_decode(text[at + len(PHI4_CALLS):])
        if not isinstance(listed, list) or not listed or any(
                not isinstance(obj, dict) or ("arguments" not in obj and "parameters" not in obj) for obj in listed):
            raise _NotACall(listed)
        return None, [_named_call(obj) for obj in listed]
    except ValueError:
        return text, []


APERTUS_CALLS, APERTUS_CALLS_END = "<|tools_prefix|>", "<|tools_suffix|>"


def parse_apertus(text: str) -> Calls:
    """Apertus: after the first `<|tools_prefix|>`, a JSON list of one-key objects `{"NAME":
    ARGUMENTS}` (or one such object) up to `<|tools_suffix|>` or the end; an item that is not a
    non-empty object is passed over, and any value is its arguments, as vLLM does. The content is
    the text before, any text after the JSON inside the section, and the text after the section,
    one line apart. Cut-off JSON is malformed (vLLM reads what it can of it)."""
    if APERTUS_CALLS not in text:
        return text, []
    before, rest = text.split(APERTUS_CALLS, 1)
    section, _, after = rest.partition(APERTUS_CALLS_END)
    try:
        listed, length = _DECODER.raw_decode(section.lstrip())
    except ValueError:
        return text, []
    items = listed if isinstance(listed, list) else [listed] if listed else []
    calls = [(name, json.dumps(arguments, ensure_ascii=False))
             for item in items if isinstance(item, dict) and item for name, arguments in [next(iter(item.items()))]]
    parts = (before.strip(), section.lstrip()[length:].strip(), after.replace(APERTUS_CALLS_END, "").strip())
    return ("\n".join(part for part in parts if part) or None, calls) if calls else (text, [])


_MINIMAX_M1_SECTION = re.compile(re.escape(TOOL_CALLS) + r"(.*?)(?:" + re.escape(TOOL_CALLS_END) + r"|\Z)", re.DOTALL)


def parse_minimax(text: str) -> Calls:
    """MiniMax-M1: `<tool_calls>...</tool_calls>` sections (the last may be left open), each holding
    calls one a line, `{"name": ..., "arguments": {...}}`; a section inside the thinking
    (`<think>...</think>`) is not read, and a line that is no such object is passed over, as vLLM does
    (a name that is not text is malformed: vLLM's call would not validate). The text before the first
    section read is the content (the thinking with it)."""
    thinking = [m.span() for m in _THINKING.finditer(text)]
    sections = [section for section in _MINIMAX_M1_SECTION.finditer(text)
                if not any(begin < section.start() and section.end() <= end for begin, end in thinking)]
    calls = []
    for section in sections:
        for line in section[1].splitlines():
            line = line.strip()
            item = _json_or_unparsed(line) if line.startswith("{") and line.endswith("}") else None
            if not isinstance(item, dict) or "name" not in item or "arguments" not in item:
                continue
            if not isinstance(item["name"], str):
                return text, []
            calls.append((item["name"], _arguments(item["arguments"])))
    return (text[: sections[0].start()].strip() or None, calls) if calls else (text, [])


QWEN25_CALLS, QWEN25_CALLS_END = "<tools>", "</tools>"
_QWEN25_BLOCK = re.compile(re.escape(QWEN25_CALLS) + r"\s*(.*?)\s*(?:" + re.escape(QWEN25_CALLS_END) + r"|\Z)",
                           re.DOTALL)


def _named(items: list) -> list:
    return [item for item in items if isinstance(item, dict) and isinstance(item.get("name"), str)]


def _qwen25_items(body: str) -> list:
    """The call objects a `<tools>` block holds, read as vLLM's qwen2_5_coder reads them: one JSON
    object or list; else one object a line (a trailing comma allowed); else objects separated by
    commas. Items without a name are passed over."""
    whole = _json_or_unparsed(body)
    if whole is not _UNPARSED:
        return _named(whole if isinstance(whole, list) else [whole])
    lines = [line.strip().rstrip(",") for line in body.splitlines()]
    items = _named([_json_or_unparsed(line) for line in lines if line])
    if items:
        return items
    wrapped = _json_or_unparsed("[" + body + "]")
    return _named(wrapped) if isinstance(wrapped, list) else []


def parse_qwen2_5_coder(text: str) -> Calls:
    """Qwen2.5-Coder (as its few-shot template teaches): `<tools>` blocks (the last may be left open),
    each a JSON call object `{"name": ..., "arguments": {...}}`, a JSON list of them or one a line;
    a block holding none is passed over, as vLLM does, and so is its JSON written with doubled
    escapes (`\\\\"`) read again with them undone. All the text outside the blocks is the content."""
    if QWEN25_CALLS not in text:
        return text, []
    calls, outside, at = [], [], 0
    for block in _QWEN25_BLOCK.finditer(text):
        outside.append(text[at: block.start()])
        at = block.end()
        body = block[1]
        items = _qwen25_items(body) or (_qwen25_items(body.replace('\\\\"', '\\"')) if "\\" in body else [])
        calls += [_named_call(item) for item in items]
    return ("".join(outside + [text[at:]]).strip() or None, calls) if calls else (text, [])
