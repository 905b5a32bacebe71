"""K2 Horizon's IFM tool calls (`rl/tool_formats/k2_horizon.py`), read as vLLM 0.32's k2_horizon
reads a whole completion in each of its formats (xml, xml_typed, json), values typed by the
request's tool schema as vLLM types them."""

import json

import pytest

from rlhf_core.rl.tool_calls import tool_properties
from rlhf_core.rl.tool_formats.k2_horizon import parse_k2_horizon, read_k2_horizon, xml_value
from rlhf_core.rl.tool_formats.schema_types import coerce, schema_types

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}}, "note": {"type": ["string", "null"]},
    "mixed": {"type": ["integer", "string"]}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


def properties_of(name):
    return tool_properties(name, TOOLS)


def known(name):
    return any(tool["function"]["name"] == name for tool in TOOLS)


def pair(key, value, kind=None):
    written = f"<ifm|arg_type>{kind}</ifm|arg_type>" if kind is not None else ""
    return f"<ifm|arg_key>{key}</ifm|arg_key>{written}<ifm|arg_value>{value}</ifm|arg_value>"


def group(*calls):
    return "<ifm|tool_calls>" + "".join(f"<ifm|tool_call>{call}</ifm|tool_call>" for call in calls) + "</ifm|tool_calls>"


def test_xml_calls_with_the_content_around_them_and_values_verbatim():
    text = ("Let me look.\n<ifm|tool_calls><ifm|tool_call>get_weather\n" + pair("city", " Paris ") + "\n"
            + pair("days", "3") + "</ifm|tool_call>\n<ifm|tool_call>\n now \n</ifm|tool_call></ifm|tool_calls> Done.")
    calls = [("get_weather", '{"city": " Paris ", "days": "3"}'), ("now", "{}")]
    assert parse_k2_horizon(text) == ("Let me look.\n Done.", calls)
    assert read_k2_horizon(group("now")) == (None, [("now", "{}")])
    # only the first group is read; the text after it, a second group too, is content
    assert parse_k2_horizon(group("now") + " then " + group("get_weather")) == (
        "then " + group("get_weather"), [("now", "{}")])


def test_xml_values_typed_by_the_tool_schema():
    text = group("get_weather" + pair("city", " Paris ") + pair("days", " 3 ") + pair("metric", "1")
                 + pair("tags", '["a", "b"]') + pair("note", "null") + pair("mixed", "5"))
    typed = {"city": " Paris ", "days": 3, "metric": True, "tags": ["a", "b"], "note": None, "mixed": 5}
    assert read_k2_horizon(text, properties_of) == (None, [("get_weather", json.dumps(typed))])
    # a value that reads as none of its types: JSON where it is, else the text (stripped)
    assert read_k2_horizon(group("get_weather" + pair("days", " three ")), properties_of) == (
        None, [("get_weather", '{"days": "three"}')])


def test_xml_typed_values_by_their_written_type_or_the_schema():
    text = group("run" + pair("a", " 1 ", "integer") + pair("b", " 1 ", "any") + pair("c", " [1, 2] ", "array[int]")
                 + pair("d", " x ", "str") + pair("e", " 5 ", "int64") + pair("f", "null", "null"))
    assert read_k2_horizon(text, tool_format="xml_typed") == (
        None, [("run", '{"a": 1, "b": " 1 ", "c": [1, 2], "d": "x", "e": 5, "f": null}')])
    # the schema's types win, narrowed to the written one where it is among several
    text = group("get_weather" + pair("days", " 3 ", "string") + pair("mixed", "5", "string"))
    assert read_k2_horizon(text, properties_of, "xml_typed") == (None, [("get_weather", '{"days": 3, "mixed": "5"}')])
    assert read_k2_horizon(text, None, "xml_typed") == (None, [("get_weather", '{"days": " 3 ", "mixed": "5"}')])


def test_json_calls_typed_from_their_json_by_the_schema():
    text = ('Sure. <ifm|tool_calls><ifm|tool_call>{"name": "get_weather", "arguments": {"city": 5, "days": "3", '
            '"tags": "[\\"a\\"]", "note": null}}</ifm|tool_call><ifm|tool_call>\n{"name": "now"}\n</ifm|tool_call>'
            '</ifm|tool_calls>')
    as_written = [("get_weather", '{"city": 5, "days": "3", "tags": "[\\"a\\"]", "note": null}'), ("now", "{}")]
    assert parse_k2_horizon(text, "json") == ("Sure.", as_written)
    assert read_k2_horizon(text, properties_of, "json") == (
        "Sure.", [("get_weather", '{"city": "5", "days": 3, "tags": ["a"], "note": null}'), ("now", "{}")])


def test_a_tool_the_request_does_not_declare_is_malformed_where_it_declares_tools():
    text = group("foo" + pair("a", "1"))
    assert read_k2_horizon(text, properties_of) == (None, [("foo", '{"a": "1"}')])
    assert read_k2_horizon(text, properties_of, known=known) == (text, [])


@pytest.mark.parametrize("text", [
    "no calls", group("now")[:-len("</ifm|tool_calls>")],  # the group never closed
    "<ifm|tool_calls></ifm|tool_calls>", group("now").replace("</ifm|tool_call><", "</ifm|tool_call>stray<"),
    group("get weather"), group(""), group("get_weather" + pair(" ", "x")),
    group("get_weather" + pair("city", "a") + pair("city", "b")), group("get_weather" + pair("city", "a") + "junk"),
    group("get_weather<ifm|arg_value>1</ifm|arg_value>"), group("get_weather" + pair("city", "a", "string")),
    "<ifm|tool_calls><ifm|tool_call>now</ifm|tool_calls>"])
def test_malformed_xml_is_all_content(text):
    assert parse_k2_horizon(text) == (text, [])


@pytest.mark.parametrize(("fmt", "text"), [
    ("xml_typed", group("get_weather" + pair("city", "Paris"))), ("xml_typed", group("get_weather" + pair("city", "x", " "))),
    ("json", group('{"name": "now", "arguments": null}')), ("json", group('{"arguments": {}}')),
    ("json", group('{"name": "now", "arguments": {}')), ("json", group('["now"]')),
    ("json", group('{"name": "now", "arguments": {"a": NaN}}')), ("json", group("now"))])
def test_malformed_typed_or_json_calls_are_all_content(fmt, text):
    assert read_k2_horizon(text, properties_of, fmt) == (text, [])


def test_vllms_coercion_of_a_text_value():
    assert schema_types({"anyOf": [{"type": "integer"}, {"enum": ["a", None]}]}) == {"integer", "string", "null"}
    assert schema_types(None) == schema_types({}) == {"string"}
    assert json.dumps(coerce("1.0", {"number"})) == "1" and coerce("1", {"bool"}) is True
    assert coerce("x", {"integer"}) == "x" and coerce("inf", {"float"}) == "inf" and coerce(" 7 ", {"int64"}) == 7
    assert json.dumps(xml_value(" 2 ", {"type": "integer"}, None)) == "2" and xml_value(" 2 ", None, None) == " 2 "
