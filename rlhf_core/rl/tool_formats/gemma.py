"""Gemma's formats (pure): each call `call:NAME{ARGUMENTS}` between its markers, its arguments
written in Gemma's own notation.

- `gemma4` (Gemma 4): `<|tool_call>call:NAME{KEY:VALUE,...}<tool_call|>`, calls one after another;
  keys bare, a string between `<|"|>` marks, an object `{KEY:VALUE,...}`, a list `[VALUE,...]`, and a
  bare `true`, `false`, `null` (or `none`, `nil`) or number (any other bare text a string); the text
  before the first call is the content.
- `functiongemma` (FunctionGemma): the same notation between `<start_function_call>` and
  `<end_function_call>`, a string between `<escape>` marks (the last call may be left open at the end).
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


def _value(text: str, at: int, quote: str) -> tuple[object, int]:
    """The value written at `at` (a string between `quote` marks) and where it ends; _NotACall where
    a string, object or list is never closed."""
    if text.startswith(quote, at):
        end = text.find(quote, at + len(quote))
        if end < 0:
            raise _NotACall(text[at:])
        return text[at + len(quote): end], end + len(quote)
    if text.startswith("{", at):
        return _pairs(text, at + 1, "}", quote)
    if text.startswith("[", at):
        items, at = [], _skip(text, at + 1, _SPACE + ",")
        while not text.startswith("]", at):
            if at >= len(text):
                raise _NotACall(text)
            item, at = _value(text, at, quote)
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


def _pairs(text: str, at: int, close: str | None, quote: str = GEMMA_QUOTE) -> tuple[dict, int]:
    """The `KEY:VALUE` pairs from `at` to `close` (None: the end of the text), and where they end."""
    pairs, at = {}, _skip(text, at, _SPACE + ",")
    while not (text.startswith(close, at) if close else at >= len(text)):
        key = _KEY.match(text, at)
        if key is None:
            raise _NotACall(text[at:])  # no key, or a bracket never closed
        at = _skip(text, key.end(), _SPACE)
        pairs[key[1]], at = _value(text, at, quote)
        at = _after(text, at, close)
    return pairs, at + (1 if close else 0)


def parse_gemma4(text: str) -> Calls:
    """Gemma 4: each `<|tool_call>` opens a whole call, `call:NAME{...}<tool_call|>`, whose
    arguments read to their end (a string, object or list never closed, text that is no key, or
    text after a value that is not a separator is malformed; vLLM reads what it can; a key without
    a value is "", as in vLLM). The text
    before the first call is the content; the text between and after the calls is passed over, as vLLM does."""
    return _read_calls(text, GEMMA_CALL, _GEMMA_CALL, GEMMA_QUOTE)


def _read_calls(text: str, opener: str, call_pattern: re.Pattern, quote: str) -> Calls:
    """Every call from the first `opener` on, each matched by `call_pattern` (groups: name, arguments)
    at its opener, its arguments in Gemma's notation with `quote` for string marks; the text before
    the first call the content. A call that does not read: no calls, the whole text content."""
    if opener not in text:
        return text, []
    calls, at = [], text.index(opener)
    try:
        while at >= 0:
            call = call_pattern.match(text, at)
            if call is None:
                raise _NotACall(text[at:])
            arguments, _ = _pairs(call[2], 0, None, quote)
            calls.append((call[1], json.dumps(arguments, ensure_ascii=False)))
            at = text.find(opener, call.end())
    except _NotACall:
        return text, []
    return text[: text.index(opener)].strip() or None, calls


FUNCTIONGEMMA_CALL, FUNCTIONGEMMA_CALL_END, FUNCTIONGEMMA_QUOTE = ("<start_function_call>", "<end_function_call>",
                                                                  "<escape>")
_FUNCTIONGEMMA_CALL = re.compile(re.escape(FUNCTIONGEMMA_CALL) + r"call:(\w+)\{(.*?)\}(?:"
                                 + re.escape(FUNCTIONGEMMA_CALL_END) + r"|\s*\Z)", re.DOTALL)


def parse_functiongemma(text: str) -> Calls:
    """FunctionGemma: each `<start_function_call>` opens a whole call, `call:NAME{...}<end_function_call>`
    (the last may end the completion without its end marker), read as Gemma 4's with `<escape>` for
    its string marks. Where vLLM reads only the `<escape>`d values (as JSON where they read as it), this
    reads the notation the template writes: a string as written, bare numbers, booleans, objects and
    lists typed. The text before the first call is the content; the text between and after the
    calls (the model writing a response to its call) is passed over, as vLLM does."""
    return _read_calls(text, FUNCTIONGEMMA_CALL, _FUNCTIONGEMMA_CALL, FUNCTIONGEMMA_QUOTE)
