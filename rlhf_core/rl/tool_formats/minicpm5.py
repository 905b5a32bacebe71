"""MiniCPM5's tool calls (pure): XML `<function>` elements anywhere in the text, each argument a
`<param>` whose value is JSON or a Python literal (else text), CDATA-wrapped where it holds `<`, `&`
or a newline, as its chat template writes them.

    Checking.<function name="weather"><param name="city">Paris</param><param name="days">3</param></function>
    <function name="note"><param name="text"><![CDATA[a < b
    & c]]></param></function>

Each `<function ... </function>` (from `<function` to the first `</function>`) is read as vLLM
0.32's `minicpm5` parser reads a whole completion: as XML first (quotes either way; the params
the `<function>`'s own `<param>` children, else those of its `<arguments>` child; a value its text
before any child element, unstripped, entities and CDATA read); where that does not parse or names
no function, by its tags (`<function name="...">`, then each `<param name="...">VALUE</param>`, a
value stripped, or the inside of a CDATA that is all of it). A value is the JSON or Python literal
it reads as (`5`, `true`, `[1]`, `{'a': 1}`), else the text, except where the request's tool schema
declares it a string (`read_minicpm5`; `"type": "string"` itself, not a list of types): there it
stays text. Where the schema lists properties, a
param it does not list is dropped, and a `properties` or `arguments` param it does not list is read
as an object of the params, those it lists taken. A block is malformed, and stays text, for a
function without a name, a param without one (`<param>` with no `name=`), a param named twice, or
a `properties`/`arguments` object giving none of the listed params. The tokenizer's byte marks (`Ġ`
for a space, `Ċ` for a newline) and the run-together `<functionname=`/`<paramname=` are read as
their plain spelling, as vLLM does.

As vLLM, well-formed blocks are calls even beside malformed ones, and the content is None wherever a
call is read (vLLM drops all the text around the calls, malformed blocks with it); where none is, the
whole text is content (vLLM strips it and drops the thinking up to the last `</think>`). A value that
makes no JSON (a Python set, bytes) makes the whole text content, as vLLM's failing serialization
does. vLLM also drops a call to a tool the request does not declare (without tools, every call),
renames a few tau-bench telecom tools' aliases to the declared tool, and drops a call missing a
required parameter; this reads every call as written (and a property whose schema is no object as
untyped, where vLLM's lookup fails and drops the call). vLLM reads the XML with lxml where that is
installed (it is not beside vLLM here: the standard library's reader, as this one's).
"""

from __future__ import annotations

import ast
import json
import re
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

from rlhf_core.rl.tool_formats.common import Calls, _NotACall

MINICPM5_CALL, MINICPM5_CALL_END = "<function", "</function>"
MINICPM5_PARAM = "<param name="  # what MiniCPM5's templates write for each argument (its `detect` marker)
_CDATA, _CDATA_END = "<![CDATA[", "]]>"
# tokenizer marks and run-together tags, spelled as they read
_DETOKENIZED = (("\u0120", " "), ("\u010a", "\n"), ("<functionname=", "<function name="),
                ("<paramname=", "<param name="))
_WRAPPERS = ("properties", "arguments")  # params that may hold the arguments as one object

_SPACE = r"[^\S\x1c-\x1f]"  # whitespace as vLLM's `regex` module reads `\s` (not the separators \x1c-\x1f)
_BLOCK = re.compile(re.escape(MINICPM5_CALL) + ".*?" + re.escape(MINICPM5_CALL_END), re.DOTALL)
_FUNCTION_NAME = re.compile(rf"<function{_SPACE}+name=[\"']([^\"']+)[\"'][^>]*>")
_PARAM = re.compile(rf"<param{_SPACE}+name=[\"']([^\"']+)[\"']>(.*?)</param>", re.DOTALL)
_UNNAMED_PARAM = re.compile(r"<param(?![^>]*\bname=)[^>]*>")

Params = list[tuple[str | None, Any]]  # (a param's name, None where it has none; its value)
PropertiesOf = Callable[[str], dict | None]


def _detokenized(text: str) -> str:
    for written, meant in _DETOKENIZED:
        text = text.replace(written, meant)
    return text


def _literal(text: str) -> tuple[Any, bool]:
    """`text` read as JSON, else as a Python literal: (the value, True); (text, False) where neither
    reads it (a JSON error other than a syntax error, such as too many digits, tries no literal)."""
    try:
        return json.loads(text), True
    except json.JSONDecodeError:
        pass
    except Exception:
        return text, False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            return ast.literal_eval(text), True
    except Exception:
        return text, False


def _typed(value: Any, schema: Any) -> Any:
    """A value as its property's schema has it: text (a value read from an object as JSON) where it
    declares a string, else the JSON or Python literal a text reads as."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return _literal(value)[0] if isinstance(value, str) else value


def _arguments(params: Params, properties: dict) -> dict:
    """The arguments of a function's params, given its tool's declared `properties` ({} for none)."""
    arguments: dict[Any, Any] = {}

    def add(name: Any, value: Any) -> None:
        if name in arguments:
            raise _NotACall(name)  # a param named twice
        arguments[name] = _typed(value, properties.get(name))

    for key, value in params:
        if key is None:
            raise _NotACall(value)  # a param without a name
        if properties and key in _WRAPPERS and key not in properties:
            wrapped, read = _literal(value)
            if not read or not isinstance(wrapped, dict) or not any(name in properties for name in wrapped):
                raise _NotACall(value)  # an object giving none of the tool's params
            for name, inner in wrapped.items():
                if name in properties:
                    add(name, inner)
        elif not properties or key in properties:
            add(key, value)  # (a param the tool does not declare is dropped)
    return arguments


def _as_xml(block: str) -> tuple[str, Params] | None:
    """The block read as an XML `<function>` element: (its name, its params), or None where it does
    not parse as one or names no function."""
    try:
        root = ET.fromstring(block)
    except Exception:
        return None
    name = (root.attrib.get("name") or "").strip() if root.tag == "function" else ""
    if not name:
        return None
    params = root.findall("param")
    held = root.find("arguments")
    if not params and held is not None:
        params = held.findall("param")
    return name, [(param.attrib.get("name") or None, param.text or "") for param in params]


def _param_value(written: str) -> str:
    """A tag-read value: the inside of a CDATA section that is all of it, else the value stripped."""
    if written.startswith(_CDATA) and written.endswith(_CDATA_END):
        return written[len(_CDATA): -len(_CDATA_END)]
    return written.strip()


def _as_tags(block: str, name: str = "") -> tuple[str, Params] | None:
    """The block read by its tags: the first `<function name=...>`'s name (`name` where there is
    none), and each `<param name=...>VALUE</param>` (a `<param>` without a name a param named None)."""
    found = _FUNCTION_NAME.search(block)
    name = found[1].strip() if found else name
    if not name:
        return None
    params: Params = [(key.strip(), _param_value(value)) for key, value in _PARAM.findall(block)]
    if _UNNAMED_PARAM.search(block):
        params.append((None, ""))
    return name, params


def _call(block: str, properties_of: PropertiesOf | None) -> tuple[str, dict] | None:
    """A `<function ... </function>` block's (name, arguments), or None where it is malformed. Read
    as XML where it parses so; a value failing to type there (vLLM's error) reads the tags instead."""
    def arguments_of(name: str, params: Params) -> tuple[str, dict]:
        return name, _arguments(params, (properties_of(name) if properties_of else None) or {})

    read = _as_xml(block)
    if read is not None:
        try:
            return arguments_of(*read)
        except _NotACall:
            return None
        except Exception:
            pass
    read = _as_tags(block, read[0] if read is not None else "")
    try:
        return arguments_of(*read) if read is not None else None
    except Exception:
        return None


def read_minicpm5(text: str, properties_of: PropertiesOf | None = None) -> Calls:
    """`text`'s calls; `properties_of(name)`: the properties of that tool's parameters in the request
    (None or {} where it gives none), which type its values and choose its params."""
    calls = [call for block in _BLOCK.findall(_detokenized(text)) if (call := _call(block, properties_of))]
    try:
        written = [(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in calls]
    except (TypeError, ValueError, RecursionError):
        return text, []  # a value JSON cannot write
    return (None, written) if written else (text, [])


def parse_minicpm5(text: str) -> Calls:
    return read_minicpm5(text)
