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

- `qwen3_coder` (Qwen3-Coder, Qwen3.5): XML calls, `<tool_call><function=NAME><parameter=KEY>
  VALUE</parameter>...</function></tool_call>`; each value is a string unless the request's tools
  declare the parameter otherwise (`typed_arguments`); the text before the first call is the content.
- `deepseek_v3` (DeepSeek-V3, R1): between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, each
  call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, a newline and its arguments in a ```json
  fence, then `<｜tool▁call▁end｜>`; `deepseek_v31` (V3.1 and later): `<｜tool▁call▁begin｜>NAME
  <｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`; the text before the calls is the content.
- `kimi_k2`: between `<|tool_calls_section_begin|>` and `<|tool_calls_section_end|>`, each call
  `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>`
  (the name is the header's last dotted part before `:INDEX`); the text before is the content.
- `granite` (Granite 3.0/3.1): `<|tool_call|>` (3.0) or `<tool_call>` (3.1) then a JSON list of
  call objects; the text before the marker is the content.
- `glm45` (GLM-4.5, 4.6, 4.7): `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...
  </tool_call>` (newlines allowed between the tags); `minimax_m2` (MiniMax-M2): between
  `<minimax:tool_call>` and `</minimax:tool_call>`, each call `<invoke name="NAME"><parameter
  name="KEY">VALUE</parameter>...</invoke>`. Both write each value as text (typed like
  `qwen3_coder`'s) and keep it verbatim; the text before the first call is the content.
- `seed_oss` (Seed-OSS): `qwen3_coder`'s calls between `<seed:tool_call>` and `</seed:tool_call>`,
  after any `<seed:think>...</seed:think>` (the thinking and the text before the calls are the
  content); `step3` (Step-3): `<｜tool_calls_begin｜>`, calls `function<｜tool_sep｜><steptml:invoke
  name="NAME">` with `<steptml:parameter name="KEY">VALUE</steptml:parameter>`, `<｜tool_calls_end｜>`
  (the text around the section is the content). Both write values as text, typed as above.
- `xlam` (Salesforce xLAM): a JSON list of `{"name", "arguments"}`, bare, fenced, after
  `[TOOL_CALLS]`, in `<tool_call>` or after `</think>` (the rest is the content); `phi4_mini_json`
  (Phi-4-mini): `functools[...]`, a JSON list of calls, no content.
- `internlm2`: one call, `<|action_start|><|plugin|>{"name": ..., "parameters": ...}<|action_end|>`;
  `longcat` (LongCat-Flash): Hermes' calls in `<longcat_tool_call>`; `ernie45` (ERNIE-4.5): JSON
  call objects in `<tool_call>` (blocks holding no object passed over). The text before is the content.
- `jamba`: the first closed `<tool_calls>...</tool_calls>`, a JSON list of call objects;
  `hunyuan_a13b`: the same section, the first outside `<think>...</think>` holding JSON. The text
  before it is the content.
- `olmo3` (Olmo 3): pythonic calls one a line, in `<function_calls>...</function_calls>` or the
  whole completion; no content.
- `openai` (gpt-oss's harmony format, from the text decoded with its special tokens): each message
  to a function, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGUMENTS<|call|>`
  (after `<|start|>assistant` but the first), is a call; the final channel's text and the commentary
  channel's without a recipient are the content (not the analysis channel's).
- `granite4` (Granite 4): Hermes' closed `<tool_call>` blocks; all the text outside them is the content.
- `lfm2` (LFM2/LFM2.5): a pythonic list between `<|tool_call_start|>` and `<|tool_call_end|>`; the
  text before and after it is the content.
- `apertus` (Apertus): `<|tools_prefix|>[{"NAME": {ARGUMENTS}}, ...]<|tools_suffix|>`; the text
  around it is the content.
- `cohere_command3` (Command A) and `cohere_command4` (Command A Reasoning, Vision): in
  `<|START_ACTION|>...<|END_ACTION|>`, a JSON list of `{"tool_call_id", "tool_name", "parameters"}`;
  the content is the answer (outside the thinking, in `<|START_RESPONSE|>`, or cmd4's `<|START_TEXT|>`),
  citations unwrapped.

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


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _one_newline_off(value: str) -> str:
    """A value without the one newline the template writes on each side of it."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _xml_functions(blocks: list[str]) -> list[tuple[str, str]]:
    """The calls of blocks each holding exactly one `<function=NAME>` of `<parameter=KEY>`s
    (values without the newline on each side); _NotACall when a block holds anything else."""
    calls = []
    for block in blocks:
        functions = _FUNCTION.findall(block)
        if len(functions) != 1 or _FUNCTION.sub("", block).strip():
            raise _NotACall(block)  # a call is exactly one <function=...>...</function>
        name, body = functions[0]
        if _PARAMETER.sub("", body).strip():
            raise _NotACall(body)  # something other than parameters inside the function
        arguments = {key.strip(): _one_newline_off(value) for key, value in _PARAMETER.findall(body)}
        calls.append((name.strip(), json.dumps(arguments, ensure_ascii=False)))
    return calls


def parse_qwen3_coder(text: str) -> Calls:
    if START not in text:
        return text, []
    try:
        calls = _xml_functions(_BLOCK.findall(text))
    except _NotACall:
        return text, []
    content = text[: text.index(START)].strip()
    return content or None, calls


SEED_CALL, SEED_CALL_END, SEED_THINK, SEED_THINK_END = ("<seed:tool_call>", "</seed:tool_call>", "<seed:think>",
                                                        "</seed:think>")
_SEED_BLOCK = re.compile(re.escape(SEED_CALL) + r"(.*?)(?:" + re.escape(SEED_CALL_END) + r"|\Z)", re.DOTALL)


def parse_seed_oss(text: str) -> Calls:
    """Seed-OSS: Qwen3-Coder's calls between `<seed:tool_call>` and `</seed:tool_call>` (or each
    `<function=...>` alone where no section is written, as vLLM backs off), after the thinking."""
    thinking = text[: text.index(SEED_THINK_END) + len(SEED_THINK_END)] if (
        SEED_THINK in text and SEED_THINK_END in text) else ""
    answer = text[len(thinking):]
    blocks = _SEED_BLOCK.findall(answer) if SEED_CALL in answer else [m[0] for m in _FUNCTION.finditer(answer)]
    if not blocks:
        return text, []
    try:
        calls = _xml_functions(blocks)
    except _NotACall:
        return text, []
    start = answer.index(SEED_CALL) if SEED_CALL in answer else answer.index("<function=")
    return (thinking + answer[:start]).strip() or None, calls


def typed_arguments(name: str, arguments: str, tools: list[dict] | None) -> str:
    """A text-valued format's (TEXT_VALUED) string values as the request's tool schema types them (a
    number, a boolean, an object or array as JSON); a value that does not read as its type stays a string."""
    schema = next((t.get("function", {}).get("parameters") for t in tools or ()
                   if isinstance(t, dict) and isinstance(t.get("function"), dict)
                   and t["function"].get("name") == name), None)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict):
        return arguments
    values = json.loads(arguments)
    for key, value in values.items():
        kind = (properties.get(key) or {}).get("type") if isinstance(properties.get(key), dict) else None
        kinds = set(kind) if isinstance(kind, list) else {kind}
        if not isinstance(value, str) or "string" in kinds or not kinds & {"integer", "number", "boolean",
                                                                            "object", "array", "null"}:
            continue
        try:
            typed = json.loads(value)
        except ValueError:
            continue
        if (("integer" in kinds and isinstance(typed, int) and not isinstance(typed, bool))
                or ("number" in kinds and isinstance(typed, int | float) and not isinstance(typed, bool))
                or ("boolean" in kinds and isinstance(typed, bool)) or ("object" in kinds and isinstance(typed, dict))
                or ("array" in kinds and isinstance(typed, list)) or ("null" in kinds and typed is None)):
            values[key] = typed
    return json.dumps(values, ensure_ascii=False)


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


TOOL_CALLS, TOOL_CALLS_END = "<tool_calls>", "</tool_calls>"
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


_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_glm45(text: str) -> Calls:
    if START not in text:
        return text, []
    calls = []
    for block in _BLOCK.findall(text):
        name, _, body = block.partition("<arg_key>")
        body = "<arg_key>" + body if body else ""
        if not name.strip() or _GLM_ARGUMENT.sub("", body).strip():
            return text, []  # no name, or something other than key/value pairs after it
        arguments = {key.strip(): value for key, value in _GLM_ARGUMENT.findall(body)}
        calls.append((name.strip(), json.dumps(arguments, ensure_ascii=False)))
    return text[: text.index(START)].strip() or None, calls


MINIMAX_CALLS, MINIMAX_CALLS_END = "<minimax:tool_call>", "</minimax:tool_call>"
_MINIMAX_SECTION = re.compile(re.escape(MINIMAX_CALLS) + r"(.*?)(?:" + re.escape(MINIMAX_CALLS_END) + r"|\Z)",
                              re.DOTALL)
_NAME = r"\s*=\s*(?:\"([^\"]*)\"|'([^']*)'|([^>\s]+))\s*>"  # quoted either way or bare: one group matches
_INVOKE = re.compile(r"<invoke\s+name" + _NAME + r"(.*?)</invoke>", re.DOTALL)
_MINIMAX_PARAMETER = re.compile(r"<parameter\s+name" + _NAME + r"(.*?)</parameter>", re.DOTALL)


def parse_minimax_m2(text: str) -> Calls:
    if MINIMAX_CALLS not in text:
        return text, []
    calls = []
    for section in _MINIMAX_SECTION.findall(text):
        invokes = _INVOKE.findall(section)
        if not invokes or _INVOKE.sub("", section).strip():
            return text, []  # a section holds calls and nothing else
        for *name, body in invokes:
            name = "".join(name).strip()
            if not name or _MINIMAX_PARAMETER.sub("", body).strip():
                return text, []
            arguments = {"".join(key).strip(): value for *key, value in _MINIMAX_PARAMETER.findall(body)
                         if "".join(key).strip()}  # a parameter without a name is skipped, as vLLM does
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    return text[: text.index(MINIMAX_CALLS)].strip() or None, calls


STEP3_CALLS, STEP3_CALLS_END = "<｜tool_calls_begin｜>", "<｜tool_calls_end｜>"
STEP3_CALL, STEP3_SEP, STEP3_CALL_END = "<｜tool_call_begin｜>", "<｜tool_sep｜>", "<｜tool_call_end｜>"
_STEP3_INVOKE = re.compile(r'<steptml:invoke name="([^"]+)">(.*?)</steptml:invoke>', re.DOTALL)
_STEP3_PARAMETER = re.compile(r'<steptml:parameter name="([^"]+)">([^<]*)</steptml:parameter>')


def parse_step3(text: str) -> Calls:
    """Step-3: a closed `<｜tool_calls_begin｜>` ... `<｜tool_calls_end｜>` section; each call
    `<｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="NAME"><steptml:parameter
    name="KEY">VALUE</steptml:parameter>...</steptml:invoke><｜tool_call_end｜>`, values stripped
    text; a call of another type than `function` is passed over, as vLLM does. The text before and
    after the section is the content."""
    if STEP3_CALLS not in text:
        return text, []
    before, rest = text.split(STEP3_CALLS, 1)
    if STEP3_CALLS_END not in rest:
        return text, []
    section, after = rest.split(STEP3_CALLS_END, 1)
    calls = []
    for part in section.split(STEP3_CALL)[1:]:
        kind, sep, invoke = part.split(STEP3_CALL_END, 1)[0].partition(STEP3_SEP)
        match = _STEP3_INVOKE.search(invoke)
        if STEP3_CALL_END not in part or not sep or kind.strip() != "function" or match is None:
            continue
        arguments = {key: value.strip() for key, value in _STEP3_PARAMETER.findall(match[2])}
        calls.append((match[1], json.dumps(arguments, ensure_ascii=False)))
    return ((before + after).strip() or None, calls) if calls else (text, [])


THINK_END = "</think>"
_XLAM_BLOCKS = (re.compile(r"```(?:json)?\s*([\s\S]*?)```"), re.compile(r"\[TOOL_CALLS\]([\s\S]*?)(?=\n|$)"),
                re.compile(re.escape(START) + r"([\s\S]*?)" + re.escape(END)))


_UNPARSED = object()


def _json_or_unparsed(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return _UNPARSED


def _first_json(raws) -> object:
    return next((v for v in map(_json_or_unparsed, raws) if v is not _UNPARSED), _UNPARSED)


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


_TAGS = re.compile(re.escape(START) + "|" + re.escape(END))
GRANITE_ROLE = "<|start_of_role|>"  # what Granite's templates write before each role


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


COHERE_THINKING, COHERE_THINKING_END = "<|START_THINKING|>", "<|END_THINKING|>"
COHERE_ACTION, COHERE_ACTION_END = "<|START_ACTION|>", "<|END_ACTION|>"
COHERE_RESPONSE, COHERE_RESPONSE_END = "<|START_RESPONSE|>", "<|END_RESPONSE|>"
COHERE_TEXT, COHERE_TEXT_END = "<|START_TEXT|>", "<|END_TEXT|>"
_CITATION = re.compile(r"<co(?::[^>]*)?>(.*?)</co:[^>]*>", re.DOTALL)


def _stretches(text: str, opens: dict[str, str], first: str) -> list[tuple[str, str]]:
    """(kind, text) of each stretch of `text` between its markers, `opens` naming the kind of
    stretch each marker opens (`first` the kind of the text before any)."""
    stretches, kind, at = [], first, 0
    for marker in re.finditer("|".join(map(re.escape, opens)), text):
        stretches.append((kind, text[at:marker.start()]))
        kind, at = opens[marker[0]], marker.end()
    return stretches + [(kind, text[at:])]


def _cohere_call(item) -> tuple[str, str]:
    if not isinstance(item, dict) or not all(isinstance(item.get(k), str) for k in ("tool_call_id", "tool_name")):
        raise _NotACall(item)
    parameters = item.get("parameters", {})
    if not isinstance(parameters, dict):
        raise _NotACall(item)
    return item["tool_name"], json.dumps(parameters, ensure_ascii=False)


def _cohere_command(text: str, answer: tuple[str, ...], answer_end: tuple[str, ...], first: str) -> Calls:
    """Cohere Command's calls and answer as cohere_melody's filter reads them (vLLM's parser): each
    `<|START_ACTION|>` section a JSON list of `{"tool_call_id": str, "tool_name": str, "parameters":
    {...}}` (or one such object); the content is the answer's text (`first` being the kind of the
    text before any marker), citations `<co>SPAN</co: ...>` unwrapped, not the thinking nor the text
    after an action or answer ends. A section that is not such JSON is malformed (melody's streaming
    reader takes what it finds in it); parameters left out are `{}` (melody gives no text)."""
    if COHERE_ACTION not in text:
        return text, []
    opens = {COHERE_THINKING: "thinking", COHERE_THINKING_END: "answer", COHERE_ACTION: "action",
             COHERE_ACTION_END: "after", **dict.fromkeys(answer, "answer"), **dict.fromkeys(answer_end, "after")}
    stretches, calls = _stretches(text, opens, first), []
    try:
        for kind, body in stretches:
            if kind == "action":
                listed = json.loads(body)
                calls += [_cohere_call(item) for item in (listed if isinstance(listed, list) else [listed])]
    except ValueError:
        return text, []
    content = _CITATION.sub(r"\1", "".join(body for kind, body in stretches if kind == "answer")).strip()
    return (content or None, calls) if calls else (text, [])


def parse_cohere_command3(text: str) -> Calls:
    """Command A (melody's cmd3): the answer is the text outside other sections and in
    `<|START_RESPONSE|>...<|END_RESPONSE|>`."""
    return _cohere_command(text, (COHERE_RESPONSE,), (COHERE_RESPONSE_END,), "answer")


def parse_cohere_command4(text: str) -> Calls:
    """Command A Reasoning/Vision (melody's cmd4): the completion opens thinking; the answer is in
    `<|START_TEXT|>` or `<|START_RESPONSE|>` sections and after `<|END_THINKING|>`."""
    return _cohere_command(text, (COHERE_TEXT, COHERE_RESPONSE), (COHERE_TEXT_END, COHERE_RESPONSE_END), "thinking")


HARMONY_START, HARMONY_MESSAGE, HARMONY_CHANNEL, HARMONY_CONSTRAIN = ("<|start|>", "<|message|>", "<|channel|>",
                                                                      "<|constrain|>")
_HARMONY_STOP = re.compile(r"<\|(?:end|call|return)\|>")
_HARMONY_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_HARMONY_BUILT_IN = frozenset({"python", "browser", "container"})  # tools that are not the request's functions
Header = tuple[str, str | None, str | None, str | None]  # role, channel, recipient, content type


def _harmony_header(header: str, role: str | None) -> Header:
    """A harmony message header as openai_harmony reads it: `<|channel|>CHANNEL` anywhere, then
    (unless `role` is known) the role, a recipient (`to=NAME`) and a content type (`json`,
    `<|constrain|>json`); _NotACall for one it refuses."""
    channel = None
    if HARMONY_CHANNEL in header:
        before, _, after = header.partition(HARMONY_CHANNEL)
        channel = re.match(r"[^\s<]*", after)[0]
        if not channel:
            raise _NotACall(header)
        header = before + after[len(channel):]
    parts = re.findall(r"[^ \t\n\r\f]+", header.replace(HARMONY_CONSTRAIN, " " + HARMONY_CONSTRAIN))
    if role is None:
        if parts and parts[0] in _HARMONY_ROLES:
            role = parts[0]
        elif len(parts) > 1 or (parts and parts[0].startswith("to=")):
            role = "tool"  # an unknown role before a recipient: a tool's message
            parts.pop(0)
        else:
            raise _NotACall(header)
    if parts and parts[0] == role:
        parts.pop(0)
    recipient = content_type = None
    if parts:
        last = parts.pop()
        if last.startswith("to=") or not parts:
            recipient = last.removeprefix("to=")
        else:
            content_type, recipient = last, parts.pop().removeprefix("to=")
    if parts:
        raise _NotACall(header)
    if recipient is not None:  # vLLM cuts a constrained format that older harmony left in it
        recipient = recipient.split(HARMONY_CONSTRAIN)[0].rstrip() or None
    return role, channel, recipient, content_type


def _harmony_messages(text: str) -> tuple[list[tuple[Header, str]], str]:
    """(each message's header and text, the raw text of a header the completion ends in) of a
    completion whose first message's role, assistant, its prompt wrote. A message ends at
    `<|end|>`, `<|call|>`, `<|return|>` or the end; the text from there to the next `<|start|>` is
    passed over, and so is a message whose header is refused (its header's text kept with the
    unfinished one, as vLLM's token buffer keeps it)."""
    messages, unread, at, head, role = [], "", 0, 0, "assistant"
    while True:
        mark = text.find(HARMONY_MESSAGE, head)
        if mark < 0:
            return messages, unread + text[at:]
        body = mark + len(HARMONY_MESSAGE)
        try:
            header = _harmony_header(text[head:mark], role)
        except _NotACall:
            unread += text[at:mark]
        else:
            stop = _HARMONY_STOP.search(text, body)
            messages.append((header, text[body: stop.start() if stop else len(text)]))
            if stop is None:
                return messages, ""
            unread, body = "", stop.end()
        at = text.find(HARMONY_START, body)
        if at < 0:
            return messages, ""
        head, role = at + len(HARMONY_START), None


def _harmony_function(recipient: str) -> bool:
    """Whether a recipient is one of the request's functions (`functions.NAME`, or a bare name
    that is not a built-in tool's), as vLLM tells."""
    if recipient.startswith("<|") or recipient == "assistant":
        return False
    if recipient.startswith("functions."):
        return len(recipient) > len("functions.")
    return recipient.split(".", 1)[0] not in _HARMONY_BUILT_IN


def _harmony_arguments(text: str, content_type: str | None) -> str:
    if content_type is not None and "json" not in content_type:
        return text
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text  # vLLM passes arguments that are not JSON on as written


def parse_openai(text: str) -> Calls:
    """gpt-oss's harmony format, read from the completion decoded with its special tokens. vLLM
    reads the token ids with openai_harmony's StreamableParser (its prompt ends `<|start|>assistant`);
    this reads the same messages from their text: a message to a function (`<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>ARGUMENTS<|call|>`) is a call (arguments as JSON
    when they read as JSON and the content type is JSON or none, else as written); the final
    channel's text and the commentary channel's without a recipient are the content, one line
    apart (the analysis channel is reasoning, not content), and so is the raw text of a header the
    completion ends in, as vLLM recovers it."""
    messages, unfinished = _harmony_messages(text)
    calls, content = [], []
    for (role, channel, recipient, content_type), body in messages:
        if role != "assistant":
            continue
        if recipient is not None and _harmony_function(recipient):
            calls.append((recipient.removeprefix("functions."), _harmony_arguments(body, content_type)))
        elif body and (channel == "final" or (channel == "commentary" and recipient is None)):
            content.append(body)
    content += [unfinished] if unfinished else []
    return ("\n".join(content).strip() or None, calls) if calls else (text, [])


PARSERS: dict[str, Callable[[str], Calls]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral, "pythonic": parse_pythonic,
    "qwen3_coder": parse_qwen3_coder, "deepseek_v3": parse_deepseek_v3, "deepseek_v31": parse_deepseek_v31,
    "kimi_k2": parse_kimi_k2, "granite": parse_granite, "glm45": parse_glm45, "minimax_m2": parse_minimax_m2,
    "seed_oss": parse_seed_oss, "step3": parse_step3, "xlam": parse_xlam, "phi4_mini_json": parse_phi4_mini_json,
    "internlm2": parse_internlm2, "jamba": parse_jamba, "hunyuan_a13b": parse_hunyuan_a13b, "longcat": parse_longcat,
    "olmo3": parse_olmo3, "ernie45": parse_ernie45, "openai": parse_openai, "granite4": parse_granite4,
    "lfm2": parse_lfm2, "apertus": parse_apertus, "cohere_command3": parse_cohere_command3,
    "cohere_command4": parse_cohere_command4}
# formats that write every argument value as text
TEXT_VALUED = frozenset({"qwen3_coder", "glm45", "minimax_m2", "seed_oss", "step3"})


def read_calls(fmt: str, text: str, tools: list[dict] | None = None) -> Calls:
    """`text`'s calls in format `fmt` (a name of PARSERS); a format that writes values as text
    has them typed by the request's tool schemas (`typed_arguments`)."""
    content, calls = PARSERS[fmt](text)
    if fmt in TEXT_VALUED:
        calls = [(name, typed_arguments(name, arguments, tools)) for name, arguments in calls]
    return content, calls


# The marker each format's chat templates write, in the order they are looked for (Qwen3-Coder's
# and GLM's templates write <tool_call> too; DeepSeek-V3's write V3.1's markers and a ```json fence;
# Jamba's write <tool_calls> as Hunyuan-A13B's do, found by their <tool_definitions>; a template
# writing both <tool_call> and <tool_calls> stays Hermes'). ERNIE-4.5 writes only Hermes' <tool_call>;
# Granite 4's write it with Granite's <|start_of_role|> (`detect`). Cohere's cmd4 templates write
# <|START_TEXT|> besides the <|START_ACTION|> of cmd3's; LFM2's write their tool list's marker.
_MARKERS = (("seed_oss", SEED_CALL), ("step3", STEP3_CALLS), ("qwen3_coder", "<parameter="), ("glm45", "<arg_key>"),
            ("minimax_m2", MINIMAX_CALLS), ("longcat", LONGCAT_CALL), ("internlm2", INTERNLM_CALL),
            ("openai", HARMONY_CHANNEL), ("lfm2", "<|tool_list_start|>"), ("apertus", APERTUS_CALLS),
            ("cohere_command4", COHERE_TEXT), ("cohere_command3", COHERE_ACTION), ("jamba", "<tool_definitions>"), ("hermes", START), ("hunyuan_a13b", TOOL_CALLS),
            ("olmo3", OLMO3_CALLS), ("deepseek_v31", DEEPSEEK_CALLS), ("kimi_k2", KIMI_CALLS),
            ("granite", GRANITE_MARKERS[0]), ("mistral", MISTRAL_CALLS), ("phi4_mini_json", PHI4_CALLS + "["),
            ("pythonic", "<|python_start|>"), ("pythonic", "[func_name1("), ("llama3_json", PYTHON_TAG))


def detect(chat_template: str | None) -> str | None:
    """The format a chat template teaches (the first of its markers it writes), or None."""
    found = next((name for name, marker in _MARKERS if chat_template and marker in chat_template), None)
    if found == "deepseek_v31" and "```json" in chat_template:
        return "deepseek_v3"
    if found == "hermes" and GRANITE_ROLE in chat_template:
        return "granite4"
    return found
