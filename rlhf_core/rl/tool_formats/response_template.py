"""Tool calls in the format a tokenizer's `response_template` declares (pure), read as vLLM 0.32's
`hf` parser reads a whole completion (no reasoning parser). The template (transformers' chat
parsing) names the regions of an assistant message, each by the delimiters around it, how its
text is parsed and how the value is shaped; Qwen3's:

    {"start_anchor": "<|im_start|>assistant\\n",
     "fields": {"thinking": {"open": "<think>", "close": "</think>"},
                "tool_calls": {"open_pattern": "\\\\s*<tool_call>", "close": "</tool_call>", "repeats": true,
                               "content": "json", "transform": {"type": "function", "function": "{content}"}},
                "content": {"close_pattern": "\\\\s*(?:<\\\\|im_end\\\\|>|<\\\\|endoftext\\\\|>)"}}}

reads `<think>plan</think>Adding.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>`
as content `planAdding.` and the call add({"a": 1}). vLLM serves only `thinking`, `content` and
`tool_calls` fields (the first two plain text) and `role` defaults; every field is optional, and
where there is no content field and each field has an opening delimiter, a plain `content` field
takes the text outside them. transformers' template loader and content parsers do the parsing
(imported at first use).

The text is read after the prompt's tail (from its last start anchor), as the model continues it,
so a prefill such as `<think>\\n` opens its region. Delimiters are found as a stream parser finds
them: a delimiter that more text could still extend (a pattern, or a literal that another of its
literals extends) is only taken once the text goes on past it or ends; the prompt's tail is read
without an end, the completion with one (where it is not empty). A call is a `tool_calls` region
that closes while the completion is read (one that closed within the prompt is not); one left open
at the end closes there. A region that does not parse, or whose value has an item without a
function name or arguments, gives no call and its text is lost; the other regions keep theirs.
A text argument is typed as the first of the types the request's tool schema lists for it
(anyOf/oneOf included) that reads it as an integer, number, boolean, null, object or array; else it
stays text. The content is the text of the thinking and content regions, delimiters dropped, as
written (None where empty); a tool region's text is never content.
"""

from __future__ import annotations

import functools
import json
import math

from rlhf_core.rl.tool_formats.common import Calls

THINKING, CONTENT, TOOL_CALLS = "thinking", "content", "tool_calls"
SERVED_FIELDS = (THINKING, CONTENT, TOOL_CALLS)


def response_template_of(tokenizer) -> dict | None:
    """The tokenizer's `response_template` (its attribute, else the one in its `init_kwargs`), None
    where it has none."""
    template = getattr(tokenizer, "response_template", None)
    if not isinstance(template, dict):
        template = (getattr(tokenizer, "init_kwargs", None) or {}).get("response_template")
    return template if isinstance(template, dict) else None


def _loaded(template):
    from transformers.utils.chat_parsing.response_templates import load_response_template

    try:
        return load_response_template(template)
    except (TypeError, ValueError) as error:
        raise ValueError(f"response_template: {error}") from error


def check_response_template(template) -> None:
    """ValueError, naming what is wrong, unless `template` can serve `hf` tool calls: a valid
    template (a start anchor included) whose fields are only thinking, content and tool_calls (a
    tool_calls field among them), thinking and content plain text, with no default but `role`."""
    spec = _loaded(template)
    if unsupported := sorted(set(spec.fields) - set(SERVED_FIELDS)):
        raise ValueError(f"response_template: unsupported fields {unsupported} "
                         f"(vLLM serves {list(SERVED_FIELDS)})")
    if defaults := sorted(set(spec.defaults) - {"role"}):
        raise ValueError(f"response_template: unsupported defaults {defaults} (only 'role' may have one)")
    if TOOL_CALLS not in spec.fields:
        raise ValueError("response_template has no tool_calls field, so no tool calls to read")
    for name in (THINKING, CONTENT):
        field = spec.fields.get(name)
        if field is not None and (field.content != "text" or field.transform is not None
                                  or field.join is not None):
            raise ValueError(f"response_template field {name!r} is not plain text "
                             "(content 'text', no transform or join)")


def _served(template: dict):
    """The template as vLLM serves it: a `content` field for the text outside every region, where
    each field has an opening delimiter. Checked and compiled once per template (the endpoint reads
    every completion with the same one)."""
    return _served_json(json.dumps(template, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _served_json(written: str):
    template = json.loads(written)
    check_response_template(template)
    fields = template["fields"]
    if CONTENT not in fields and all("open" in f or "open_pattern" in f for f in fields.values()):
        fields[CONTENT] = {}
    return _loaded(template)


def _schema_types(schema) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    types = [t for t in (kind if isinstance(kind, list) else [kind]) if isinstance(t, str)]
    for choices in ("anyOf", "oneOf"):
        for choice in schema.get(choices) or ():
            types += _schema_types(choice)
    return types + ["null"] if schema.get("nullable") and "null" not in types else types


def _typed(text: str, types: list[str]):
    """`text` as the first of `types` that reads it, else the text."""
    for kind in types:
        try:
            if kind == "integer":
                return int(text)
            if kind == "number" and math.isfinite(number := float(text)):
                return int(number) if number.is_integer() and "." not in text else number
            if kind == "boolean" and text.strip().lower() in ("true", "1", "false", "0"):
                return text.strip().lower() in ("true", "1")
            if kind == "null" and text.strip() in ("null", "None"):
                return None
            if kind in ("object", "array"):
                value = json.loads(text)
                if isinstance(value, dict if kind == "object" else list):
                    return value
        except ValueError:
            continue
    return text


def _type_arguments(value, properties_of: dict[str, dict]) -> None:
    """Types, in place, the text arguments of the calls in a tool region's value."""
    if isinstance(value, list):
        for item in value:
            _type_arguments(item, properties_of)
        return
    function = value.get("function") if isinstance(value, dict) else None
    name, arguments = (function.get("name"), function.get("arguments")) if isinstance(function, dict) else (None,) * 2
    if not isinstance(name, str) or not isinstance(arguments, dict) or not (properties := properties_of.get(name)):
        return
    for key, argument in arguments.items():
        if key not in properties or not (types := _schema_types(properties[key])):
            continue
        if isinstance(argument, str):
            arguments[key] = _typed(argument, types)
        elif isinstance(argument, list) and "array" not in types:  # a key repeated, collected
            arguments[key] = [_typed(item, types) if isinstance(item, str) else item for item in argument]


def _calls(value) -> list[tuple[str, str]]:
    """The (name, arguments) of each call in a tool region's value; none if any item lacks either."""
    calls = []
    for item in value if isinstance(value, list) else [value]:
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict):
            return []
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name or arguments is None:
            return []
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append((name, arguments or "{}"))
    return calls


def _properties_of(tools: list[dict] | None) -> dict[str, dict]:
    """The properties of each request tool's parameters, by name ({} where it declares none)."""
    out = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            out[function["name"]] = properties if isinstance(properties, dict) else {}
    return out


class _Reader:
    """The prompt's tail then the completion, read region by region."""

    def __init__(self, spec, properties_of: dict[str, dict]):
        self.spec, self.properties_of = spec, properties_of
        self.text, self.at = "", 0
        self.generated: int | None = None  # where the completion starts, once the prompt is read
        self.content: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self._enter(spec.implicit)

    def _enter(self, region: str | None, captures: dict | None = None) -> None:
        self.region, self.captures, self.body, self.opened = region, captures or {}, "", captures is not None

    def _delimiters(self):
        """The delimiters that can end the current region: its close in an explicit region; every
        opening and the implicit region's close otherwise."""
        fields = self.spec.fields
        if self.region is not None and self.region != self.spec.implicit:
            field = fields[self.region]
            return [("close", field)] if field.close_re is not None else []
        found = [("open", f) for f in fields.values() if f.open_re is not None]
        implicit = fields.get(self.spec.implicit) if self.spec.implicit else None
        return found + ([("close", implicit)] if implicit is not None and implicit.close_re is not None else [])

    def _can_grow(self, kind: str, field, match) -> bool:
        """Whether a whole delimiter ending at the text's end could still change with more text."""
        if match.end() != len(self.text):
            return False
        if match.start() == match.end():
            return True
        literals, extends = ((field.open_literals, field.open_literal_can_extend) if kind == "open"
                             else (field.close_literals, field.close_literal_can_extend))
        return literals is None or extends

    def _next(self, ended: bool):
        """The first delimiter that can be taken now (the longest at a place, an opening before a
        close), and where text must be held back from for one that may still be forming."""
        best, hold = None, len(self.text)
        for kind, field in self._delimiters():
            pattern = field.open_re if kind == "open" else field.close_re
            match = pattern.search(self.text, self.at, partial=not ended)
            if match is None:
                continue
            if not ended and (match.partial or self._can_grow(kind, field, match)):
                hold = min(hold, match.start())
                continue
            key = (match.start(), match.start() - match.end(), kind != "open", field.name)
            if best is None or key < best[0]:
                best = (key, kind, field, match)
        return (best[1:] if best is not None and best[3].start() < hold else None), hold

    def _take(self, end: int) -> None:
        """The text up to `end` into the current region."""
        if end > self.at and self.region is not None:
            self.opened = True
            self.body += self.text[self.at:end]
            if self.generated is not None and self.region in (THINKING, CONTENT) and end > self.generated:
                self.content.append(self.text[max(self.at, self.generated):end])
        self.at = max(self.at, end)

    def _close(self) -> None:
        if self.region == TOOL_CALLS and self.opened:
            from transformers.utils.chat_parsing.content_parsers import process_field

            try:
                value = process_field(self.body, self.spec.fields[TOOL_CALLS], self.captures)
                if self.properties_of:
                    _type_arguments(value, self.properties_of)
            except (KeyError, TypeError, ValueError, RecursionError):  # (vLLM fails the request on the last)
                value = None  # malformed: dropped, reading goes on
            if self.generated is not None and value is not None and self.spec.fields[TOOL_CALLS].join is None:
                self.calls += _calls(value)
        self._enter(self.spec.implicit)

    def read(self, text: str, ended: bool) -> None:
        self.text += text
        while True:
            found, hold = self._next(ended)
            if found is not None:
                kind, field, match = found
                self._take(match.start())
                self.at = match.end()
                had_text = self.opened
                self._close()
                if kind == "open":
                    self._enter(field.name, {k: v for k, v in match.groupdict().items() if v is not None})
                elif not had_text and match.start() == match.end():
                    break  # an empty close of an empty region: nothing more is read this time
                continue
            if ended:
                self._take(len(self.text))
                self._close()
            else:
                self._take(hold)
            break


def read_response_template(text: str, template: dict, prefix: str = "", tools: list[dict] | None = None) -> Calls:
    """`text`'s content and calls in `template`'s format; `prefix`: the prompt it continues (decoded
    with its special tokens), `tools`: the request's tools (OpenAI chat form), whose schemas type
    text values. ValueError where the template cannot serve tool calls."""
    spec = _served(template)
    reader = _Reader(spec, _properties_of(tools))
    if prefix:
        reader.read(spec.truncate_past_last_anchor(prefix), ended=False)
    reader.generated = len(reader.text)
    reader.read(text, ended=False)
    if text:
        reader.read("", ended=True)
    return "".join(reader.content) or None, reader.calls
