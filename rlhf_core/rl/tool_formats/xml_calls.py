"""Formats whose calls are XML-like tags, each argument value written as text (pure); `read_calls`
types the values by the request's tool schemas (`TEXT_VALUED`, `typed_arguments`).

- `qwen3_coder` (Qwen3-Coder, Qwen3.5): XML calls, `<tool_call><function=NAME><parameter=KEY>
  VALUE</parameter>...</function></tool_call>`; each value is a string unless the request's tools
  declare the parameter otherwise (`typed_arguments`); the text before the first call is the content.
- `glm45` (GLM-4.5, 4.6): `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...
  </tool_call>` (newlines allowed between the tags); `glm47` (GLM-4.7): the same calls, a literal
  `\n` (backslash, n) also allowed between a key and its value; `minimax_m2` (MiniMax-M2): between
  `<minimax:tool_call>` and `</minimax:tool_call>`, each call `<invoke name="NAME"><parameter
  name="KEY">VALUE</parameter>...</invoke>`. All write each value as text (typed like
  `qwen3_coder`'s) and keep it verbatim; the text before the first call is the content.
- `seed_oss` (Seed-OSS): `qwen3_coder`'s calls between `<seed:tool_call>` and `</seed:tool_call>`,
  after any `<seed:think>...</seed:think>` (the thinking and the text before the calls are the
  content); `step3` (Step-3): `<｜tool_calls_begin｜>`, calls `function<｜tool_sep｜><steptml:invoke
  name="NAME">` with `<steptml:parameter name="KEY">VALUE</steptml:parameter>`, `<｜tool_calls_end｜>`
  (the text around the section is the content). Both write values as text, typed as above.
- `deepseek_v32` (DeepSeek-V3.2's DSML): between `<｜DSML｜function_calls>` and `</｜DSML｜function_calls>`,
  each call `<｜DSML｜invoke name="NAME">` with `<｜DSML｜parameter name="KEY" string="true|false">VALUE
  </｜DSML｜parameter>`s, `</｜DSML｜invoke>`; `deepseek_v4` (DeepSeek-V4): the same calls between
  `<｜DSML｜tool_calls>` and `</｜DSML｜tool_calls>`; `deepseek_v41` (DeepSeek-V4.1): V4's calls with a
  space after the marker in every tag, `<｜DSML｜ calls>`, `<｜DSML｜ invoke name=...>`, `<｜DSML｜
  parameter ...>`. A `string="true"` value is a string as written; a `string="false"` one (the
  template writes it as JSON), or one without the attribute (vLLM 0.32 reads it so), is text typed
  by the request's tool schema, as above (`read_dsml`, which `read_calls` gives the typing). The
  text before the calls is the content.
- `hy_v3` (Hy3, Hunyuan v3): in `<tool_calls>`, each call `<tool_call>NAME<tool_sep>` then GLM's
  `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` pairs, `</tool_call>`; `hy_v4` (Hunyuan v4):
  `<tool_calls>` then GLM-4.5's calls, `<tool_call>NAME<arg_key>...</tool_call>`, `</tool_calls>`
  (each tag may carry the checkpoint's suffix, `<tool_calls:SUFFIX>`). Values are text, typed as
  above; the text before `<tool_calls>` is the content.
- `dots` (dots.llm): `<dots_function_call>` blocks, each MiniMax-M2's `<invoke name="NAME"><parameter
  name="KEY">VALUE</parameter></invoke>`s (values stripped text, typed as above: `read_dots`) or one
  JSON call object; the text before the first block is the content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from rlhf_core.rl.tool_formats.common import _BLOCK, START, TOOL_CALLS, TOOL_CALLS_END, Calls, _NotACall

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


_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
# GLM-4.7's: a literal backslash-n may stand between a key and its value, as vLLM's glm47 reads it
_GLM47_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _pairs_call(name: str, pairs: str, argument: re.Pattern) -> tuple[str, str]:
    """A call of GLM's kind (GLM, Hunyuan): `name`, then key/value pairs each matched by `argument`
    (groups: key, value; values verbatim). _NotACall for no name, or anything but pairs after it."""
    if not name.strip() or argument.sub("", pairs).strip():
        raise _NotACall(pairs)
    arguments = {key.strip(): value for key, value in argument.findall(pairs)}
    return name.strip(), json.dumps(arguments, ensure_ascii=False)


def _glm(text: str, argument: re.Pattern) -> Calls:
    """GLM's `<tool_call>NAME` then key/value pairs (each matched by `argument`) `</tool_call>` calls."""
    if START not in text:
        return text, []
    try:
        calls = [_pairs_call(*_split_at(block, "<arg_key>"), argument) for block in _BLOCK.findall(text)]
    except _NotACall:
        return text, []
    return text[: text.index(START)].strip() or None, calls


def _split_at(block: str, key_tag: str) -> tuple[str, str]:
    """`(name, pairs)`: the text before the first `key_tag`, and the rest from it."""
    name, tag, pairs = block.partition(key_tag)
    return name, tag + pairs


def parse_glm45(text: str) -> Calls:
    return _glm(text, _GLM_ARGUMENT)


def parse_glm47(text: str) -> Calls:
    return _glm(text, _GLM47_ARGUMENT)


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


DSML = "｜DSML｜"  # fullwidth bars, as DeepSeek's markup writes them
DSML_V41 = DSML + " "  # DeepSeek-V4.1's tags: a space after the marker
DSML_FUNCTION_CALLS, DSML_TOOL_CALLS = f"<{DSML}function_calls>", f"<{DSML}tool_calls>"
DSML_V41_CALLS = f"<{DSML_V41}calls>"
Typing = Callable[[str, str], str]  # (name, arguments as JSON) -> the arguments typed by the request's schema


def _dsml_tags(tag: str) -> tuple[re.Pattern, re.Pattern]:
    """A DSML dialect's invoke and parameter (the `string` attribute optional, as vLLM 0.32 reads it)."""
    return (re.compile(rf'<{tag}invoke\s+name="([^"]+)"\s*>(.*?)</{tag}invoke>', re.DOTALL),
            re.compile(rf'<{tag}parameter\s+name="([^"]+)"(?:\s+string="(true|false)")?\s*>(.*?)</{tag}parameter>',
                       re.DOTALL))


# each section marker's invoke and parameter tags
_DSML_DIALECTS = {DSML_FUNCTION_CALLS: _dsml_tags(DSML), DSML_TOOL_CALLS: _dsml_tags(DSML),
                  DSML_V41_CALLS: _dsml_tags(DSML_V41)}


def _dsml_call(name: str, body: str, typed: Typing | None, parameter: re.Pattern) -> tuple[str, str]:
    """An invoke's (name, arguments): `string="true"` values as written; the others (`string="false"`
    or no attribute), text, typed by `typed` where it is given. Anything but parameters in the body:
    _NotACall."""
    if parameter.sub("", body).strip():
        raise _NotACall(body)
    written = [(key, as_string == "true", value) for key, as_string, value in parameter.findall(body)]
    strings = {key: value for key, as_string, value in written if as_string}
    others = {key: value for key, as_string, value in written if not as_string}
    if typed is not None and others:
        others = json.loads(typed(name, json.dumps(others, ensure_ascii=False)))
    arguments = {key: strings[key] if key in strings else others[key] for key, _, _ in written}
    return name, json.dumps(arguments, ensure_ascii=False)


def read_dsml(text: str, begin: str, typed: Typing | None = None) -> Calls:
    """DeepSeek's DSML calls in each closed section from `begin` (`<｜DSML｜function_calls>`,
    `<｜DSML｜tool_calls>` or V4.1's `<｜DSML｜ calls>`) to its closing tag, a section left open passed
    over, as vLLM does; each section holds invokes and nothing else, each invoke parameters in the
    section's dialect. The text before the first section is the content."""
    end = "</" + begin[1:]
    invoke, parameter = _DSML_DIALECTS[begin]
    sections = re.findall(re.escape(begin) + "(.*?)" + re.escape(end), text, re.DOTALL)
    calls = []
    try:
        for section in sections:
            if invoke.sub("", section).strip():
                raise _NotACall(section)  # a section holds calls and nothing else
            calls += [_dsml_call(name.strip(), body, typed, parameter) for name, body in invoke.findall(section)]
    except ValueError:
        return text, []
    return (text[: text.index(begin)].strip() or None, calls) if calls else (text, [])


def parse_deepseek_v32(text: str) -> Calls:
    return read_dsml(text, DSML_FUNCTION_CALLS)


def parse_deepseek_v4(text: str) -> Calls:
    return read_dsml(text, DSML_TOOL_CALLS)


def parse_deepseek_v41(text: str) -> Calls:
    return read_dsml(text, DSML_V41_CALLS)


HY_SEP = "<tool_sep>"


def parse_hy_v3(text: str) -> Calls:
    """Hy3: in the first `<tool_calls>` (to `</tool_calls>` or the end), calls and nothing else, each
    `<tool_call>NAME<tool_sep>` then key/value pairs (whitespace between a key and its value) up to
    `</tool_call>` (the last may be left open, as vLLM reads it); values kept verbatim. A call
    without a name or separator, or with anything but pairs after it, is malformed. The text before
    `<tool_calls>` is the content."""
    if TOOL_CALLS not in text:
        return text, []
    section = text.split(TOOL_CALLS, 1)[1].split(TOOL_CALLS_END, 1)[0]
    blocks = _BLOCK.findall(section)
    if not blocks or _BLOCK.sub("", section).strip():
        return text, []
    if any(HY_SEP not in block for block in blocks):
        return text, []
    try:
        calls = [_pairs_call(*block.split(HY_SEP, 1), _GLM_ARGUMENT) for block in blocks]
    except _NotACall:
        return text, []
    return text[: text.index(TOOL_CALLS)].strip() or None, calls


_HY4_CALLS = re.compile(r"<tool_calls(:[^\s>]+)?>")


def _hy4_tags(suffix: str, *names: str) -> list[str]:
    return [tag for name in names for tag in (f"<{name}{suffix}>", f"</{name}{suffix}>")]


def parse_hy_v4(text: str) -> Calls:
    """Hunyuan v4, as vLLM's strict reading takes it: a closed `<tool_calls>...</tool_calls>`
    section (its tags, and all the others, carrying the suffix its opening tag has, if any) whose
    `<tool_call>` tags all pair with their ends, each call `<tool_call>NAME` then pairs
    `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` (nothing between a key and its value;
    whitespace between pairs) and `</tool_call>`, values verbatim. A call without a name, or with
    anything but pairs after it, is malformed, as is a section without calls. The text before the
    section is the content."""
    opening = _HY4_CALLS.search(text)
    if opening is None:
        return text, []
    suffix = opening[1] or ""
    _, calls_end, call, call_end, key, key_end, value, value_end = _hy4_tags(
        suffix, "tool_calls", "tool_call", "arg_key", "arg_value")
    end = text.find(calls_end, opening.end())
    if end < 0:
        return text, []
    section = text[opening.end(): end]
    bodies = re.findall(re.escape(call) + "(.*?)" + re.escape(call_end), section, re.DOTALL)
    if not bodies or section.count(call) != len(bodies) or section.count(call_end) != len(bodies):
        return text, []
    argument = re.compile("".join(re.escape(tag) + "(.*?)" if tag in (key, value) else re.escape(tag)
                                  for tag in (key, key_end, value, value_end)), re.DOTALL)
    try:
        calls = [_pairs_call(*_split_at(body, key), argument) for body in bodies]
    except _NotACall:
        return text, []
    return text[: opening.start()].strip() or None, calls


DOTS_CALLS, DOTS_CALLS_END = "<dots_function_call>", "</dots_function_call>"
_DOTS_BLOCK = re.compile(re.escape(DOTS_CALLS) + r"\s*(.*?)\s*" + re.escape(DOTS_CALLS_END), re.DOTALL)


def _dots_json_call(block: str) -> list[tuple[str, str]]:
    """A block's JSON call object `{"name": ..., "arguments"|"parameters": {...}}` as a call; none
    where it is not one (vLLM passes it over)."""
    try:
        obj = json.loads(block)
    except ValueError:
        return []
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return []
    arguments = obj.get("arguments", obj.get("parameters", {})) or {}
    return [(obj["name"], json.dumps(arguments, ensure_ascii=False))] if isinstance(arguments, dict) else []


def read_dots(text: str, typed: Typing | None = None) -> Calls:
    """dots.llm's calls: each closed `<dots_function_call>` block, invokes (their values stripped
    text, typed by `typed` where it is given) or a JSON call object; a block or invoke that reads as
    no call (not JSON, no name) is passed over, as vLLM does. vLLM also drops a call to a tool the
    request does not declare; this reads it. The text before the first block is the content."""
    if DOTS_CALLS not in text:
        return text, []
    calls = []
    for block in _DOTS_BLOCK.findall(text):
        if not block.startswith("<invoke"):
            calls += _dots_json_call(block)
            continue
        for *name, body in _INVOKE.findall(block):
            name = "".join(name).strip()
            arguments = json.dumps({"".join(key).strip(): value.strip()
                                    for *key, value in _MINIMAX_PARAMETER.findall(body)}, ensure_ascii=False)
            if name:
                calls.append((name, typed(name, arguments) if typed is not None else arguments))
    return (text[: text.index(DOTS_CALLS)].strip() or None, calls) if calls else (text, [])


def parse_dots(text: str) -> Calls:
    return read_dots(text)
