"""Gemma 4's format (pure): each call `call:NAME{ARGUMENTS}` between `<|tool_call>` and `<tool_call|>`,
its arguments written in Gemma's own notation.

- `gemma4` (Gemma 4): `<|tool_call>call:NAME{KEY:VALUE,...}<tool_call|>`, calls one after another;
  keys bare, a string between `<|"|>` marks, an object `{KEY:VALUE,...}`, a list `[VALUE,...]`, and a
  bare `true`, `false`, `null` (or `none`, `nil`) or number (any other bare text a string); the text
  before the first call is the content.
"""

from __future__ import annotations

import json
import re

from rlhf_core.rl.tool_formats.common import Calls, _NotACall

GEMMA_CALL, GEMMA_CALL_END, GEMMA_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_GEMMA_CALL = re.compile(re.escape(GEMMA_CALL) + r"call:([\w\-.]+)\{(.*?)\}" + re.escape(GEMMA_CALL_END), re.DOTALL)
_SPACE = " \n\t"
_KEY = re.compile(r"[ \n\t]*([^:,{}\[\]]+?)[ \n\t]*:")
_BARE = re.compile(r"[^,}\]]*")


def _bare(written: str):
    """A value written without quotes, as vLLM reads it: `true`, `false`, a null, a number (a float
    where it has a `.`), else the text."""
    written = written.strip()
    if written in ("true", "false"):
        return written == "true"
    if written.lower() in ("null", "none", "nil"):
        return None
    try:
        return float(written) if "." in written else int(written)
    except ValueError:
        return written


def _skip(text: str, at: int, chars: str) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def _value(text: str, at: int) -> tuple[object, int]:
    """The value written at `at` and where it ends; _NotACall where a string, object or list is never closed."""
    if text.startswith(GEMMA_QUOTE, at):
        end = text.find(GEMMA_QUOTE, at + len(GEMMA_QUOTE))
        if end < 0:
            raise _NotACall(text[at:])
        return text[at + len(GEMMA_QUOTE): end], end + len(GEMMA_QUOTE)
    if text.startswith("{", at):
        return _pairs(text, at + 1, "}")
    if text.startswith("[", at):
        items, at = [], _skip(text, at + 1, _SPACE + ",")
        while not text.startswith("]", at):
            if at >= len(text):
                raise _NotACall(text)
            item, at = _value(text, at)
            items.append(item)
            at = _after(text, at, "]")
        return items, at + 1
    bare = _BARE.match(text, at)
    return _bare(bare[0]), bare.end()


def _after(text: str, at: int, close: str | None) -> int:
    """Past the separator after a value: spaces and commas, up to the next key or item, or the close."""
    after = _skip(text, at, _SPACE)
    if after < len(text) and text[after] not in "," + (close or ""):
        raise _NotACall(text[after:])  # something else right after a value
    return _skip(text, after, _SPACE + ",")


def _pairs(text: str, at: int, close: str | None) -> tuple[dict, int]:
    """The `KEY:VALUE` pairs from `at` to `close` (None: the end of the text), and where they end."""
    pairs, at = {}, _skip(text, at, _SPACE + ",")
    while not (text.startswith(close, at) if close else at >= len(text)):
        key = _KEY.match(text, at)
        if key is None:
            raise _NotACall(text[at:])  # no key, or a bracket never closed
        at = _skip(text, key.end(), _SPACE)
        pairs[key[1]], at = _value(text, at)
        at = _after(text, at, close)
    return pairs, at + (1 if close else 0)


def parse_gemma4(text: str) -> Calls:
    """Gemma 4: each `<|tool_call>` opens a whole call, `call:NAME{...}<tool_call|>`, whose
    arguments read to their end (a string, object or list never closed, text that is no key, or
    text after a value that is not a separator is malformed; vLLM reads what it can; a key without
    a value is "", as in vLLM). The text
    before the first call is the content; the text between and after the calls is passed over, as vLLM does."""
    if GEMMA_CALL not in text:
        return text, []
    calls, at = [], text.index(GEMMA_CALL)
    try:
        while at >= 0:
            call = _GEMMA_CALL.match(text, at)
            if call is None:
                raise _NotACall(text[at:])
            arguments, _ = _pairs(call[2], 0, None)
            calls.append((call[1], json.dumps(arguments, ensure_ascii=False)))
            at = text.find(GEMMA_CALL, call.end())
    except _NotACall:
        return text, []
    return text[: text.index(GEMMA_CALL)].strip() or None, calls
