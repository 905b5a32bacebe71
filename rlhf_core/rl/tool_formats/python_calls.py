"""Formats whose calls are written as Python: a list of calls with keyword arguments of literal
values (pure).

- `pythonic` (Llama 3.2/4's Python-list calls): the whole completion a list of calls with
  keyword arguments of literal values, `[get_weather(city="Paris"), add(a=1, b=2)]`, optionally
  between `<|python_start|>` and `<|python_end|>`; with calls, no content.
- `olmo3` (Olmo 3): pythonic calls one a line, in `<function_calls>...</function_calls>` or the
  whole completion; no content.
- `lfm2` (LFM2/LFM2.5): a pythonic list between `<|tool_call_start|>` and `<|tool_call_end|>`; the
  text before and after it is the content.
"""

from __future__ import annotations

import ast
import json
import re

from rlhf_core.rl.tool_formats.common import Calls, _NotACall

_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr):
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            raise _NotACall(node)
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    value = ast.literal_eval(node)  # ValueError for anything but a literal
    if value is not None and not isinstance(value, str | int | float | bool):
        raise _NotACall(node)
    return value


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise _NotACall(node)


_NOT_PYTHON_CALLS = (SyntaxError, ValueError, TypeError, RecursionError)


def _python_calls(listing: str) -> list[tuple[str, str]]:
    """The calls of a Python list of calls with literal keyword arguments; one of
    _NOT_PYTHON_CALLS for anything else."""
    tree = ast.parse(listing, mode="eval").body
    if not isinstance(tree, ast.List) or not tree.elts:
        raise _NotACall(listing)
    calls = []
    for call in tree.elts:
        if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
            raise _NotACall(listing)  # keyword arguments only, as the format has it
        arguments = {k.arg: _literal(k.value) for k in call.keywords}
        calls.append((_dotted(call.func), json.dumps(arguments, ensure_ascii=False)))
    return calls


def parse_pythonic(text: str) -> Calls:
    body = text.replace("<|python_start|>", "").replace("<|python_end|>", "").strip()
    if not (body.startswith("[") and body.endswith("]") and "(" in body):
        return text, []
    try:
        return None, _python_calls(body)
    except _NOT_PYTHON_CALLS:
        return text, []


OLMO3_CALLS, OLMO3_CALLS_END = "<function_calls>", "</function_calls>"
_OLMO3_SECTION = re.compile(re.escape(OLMO3_CALLS) + r"(.*?)" + re.escape(OLMO3_CALLS_END), re.DOTALL)


def parse_olmo3(text: str) -> Calls:
    """Olmo 3: pythonic calls one a line, inside the first `<function_calls>...</function_calls>`
    (the text outside it dropped, as vLLM does) or making up the whole completion; no content."""
    section = _OLMO3_SECTION.search(text)
    lines = [line.strip() for line in (section[1] if section else text).splitlines() if line.strip()]
    try:
        return None, _python_calls("[" + ", ".join(lines) + "]")
    except _NOT_PYTHON_CALLS:
        return text, []


LFM2_CALL, LFM2_CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"
_ESCAPED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_controls_in_strings(code: str) -> str:
    """Python source with the raw newlines, carriage returns and tabs inside its string literals
    escaped (what they mean kept; the rest of the source unchanged)."""
    out, quote, at = [], None, 0
    while at < len(code):
        char = code[at]
        if quote is None:
            quote = char if char in "'\"" else None
        elif char == "\\":
            out.append(code[at: at + 2])
            at += 2
            continue
        elif char == quote:
            quote = None
        else:
            char = _ESCAPED.get(char, char)
        out.append(char)
        at += 1
    return "".join(out)


def parse_lfm2(text: str) -> Calls:
    """LFM2/LFM2.5 (Liquid AI): a pythonic list of calls between `<|tool_call_start|>` and
    `<|tool_call_end|>` (or the end); raw newlines or tabs inside its strings are read as escaped,
    as vLLM does. The text before and after the block, one line apart, is the content; after the
    block, text up to a last stray `<|tool_call_end|>` (the model echoing its call) is dropped, as
    vLLM does. Read like `pythonic` calls: a positional argument (vLLM passes it over) is malformed."""
    if LFM2_CALL not in text:
        return text, []
    before, rest = text.split(LFM2_CALL, 1)
    listing, _, after = rest.partition(LFM2_CALL_END)
    listing = listing.strip()
    if not (listing.startswith("[") and listing.endswith("]")):
        return text, []
    try:
        calls = _python_calls(listing)
    except _NOT_PYTHON_CALLS:
        try:
            calls = _python_calls(_escape_controls_in_strings(listing))
        except _NOT_PYTHON_CALLS:
            return text, []
    parts = (before.strip(), after.rpartition(LFM2_CALL_END)[2].strip())
    return "\n".join(part for part in parts if part) or None, calls
