"""Tool calls in a completion's text, in the formats chat templates teach (pure).

Each parser returns `(content, [(name, arguments as a JSON string), ...])`, read as vLLM's parser
of the same name reads a whole completion: if any call is malformed, nothing is a call and the
whole text is content.

- `hermes` (Qwen2.5/Qwen3, Hermes and many others): each call a JSON object `{"name": ...,
  "arguments": {...}}` between `<tool_call>` and `</tool_call>` (the last may be left open at the
  end); the text before the first call is the content (None when blank).
- `llama3_json` (Llama 3.1/3.2/3.3's JSON tool calling): JSON objects with `name` and `arguments`
  (or `parameters`), optionally after `<|python_tag|>` and separated by `;`; with calls, no
  content.
- `mistral`: `[TOOL_CALLS]` then either a JSON list of `{"name", "arguments"}` objects (the older
  tokenizers) or `name[ARGS]{...}` per call (v11 and later); the text before it is the content.
- `pythonic` (Llama 3.2/4's Python-list calls): the whole completion a list of calls with
  keyword arguments of literal values, `[get_weather(city="Paris"), add(a=1, b=2)]`, optionally
  between `<|python_start|>` and `<|python_end|>`; with calls, no content.

`detect(chat_template)` names the format a template teaches, by the markers it writes (Llama 3.2's
pythonic templates show the model `[func_name1(params_name1=params_value1, ...)]`).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable

Calls = tuple[str | None, list[tuple[str, str]]]
START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
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


def parse_hermes(text: str) -> Calls:
    if START not in text:
        return text, []
    try:
        calls = [_named_call(json.loads(body)) for body in _BLOCK.findall(text)]
    except ValueError:  # not JSON, or not a call (_NotACall is a ValueError)
        return text, []
    content = text[: text.index(START)].strip()
    return content or None, calls


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


def parse_pythonic(text: str) -> Calls:
    body = text.replace("<|python_start|>", "").replace("<|python_end|>", "").strip()
    if not (body.startswith("[") and body.endswith("]") and "(" in body):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise _NotACall(body)
        calls = []
        for call in tree.elts:
            if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
                raise _NotACall(body)  # keyword arguments only, as the format has it
            arguments = {k.arg: _literal(k.value) for k in call.keywords}
            calls.append((_dotted(call.func), json.dumps(arguments, ensure_ascii=False)))
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return text, []
    return None, calls


PARSERS: dict[str, Callable[[str], Calls]] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json,
                                               "mistral": parse_mistral, "pythonic": parse_pythonic}
# The marker each format's chat templates write, in the order they are looked for.
_MARKERS = (("hermes", START), ("mistral", MISTRAL_CALLS), ("pythonic", "<|python_start|>"),
            ("pythonic", "[func_name1("), ("llama3_json", PYTHON_TAG))


def detect(chat_template: str | None) -> str | None:
    """The format a chat template teaches (the first of its markers it writes), or None."""
    return next((name for name, marker in _MARKERS if chat_template and marker in chat_template), None)
