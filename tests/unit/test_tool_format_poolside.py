"""Poolside's Laguna tool calls (`rl/tool_formats/poolside.py`): GLM-4.5's `<tool_call>NAME<arg_key>...`
calls, values typed as vLLM's poolside_v1 types them (checked against vLLM 0.32 on these texts, which
it reads alike but for a blank-named call: vLLM names it `""`, this passes it over)."""

from rlhf_core.rl.tool_calls import tool_properties
from rlhf_core.rl.tool_formats.poolside import parse_poolside_v1, read_poolside_v1

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}]


def _schema(name):
    return tool_properties(name, TOOLS)


def test_calls_after_the_content_every_value_read_as_json_or_a_python_literal():
    text = ("Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value> New York </arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
            "<tool_call>note<arg_key>flags</arg_key><arg_value>[true, null]</arg_value><arg_key>opts</arg_key>"
            "<arg_value>{\"a\": 1}</arg_value><arg_key>on</arg_key><arg_value>True</arg_value>"
            "<arg_key>pair</arg_key><arg_value>(1, 'b')</arg_value><arg_key>none</arg_key><arg_value>None</arg_value>"
            "</tool_call><tool_call>now</tool_call>")
    assert parse_poolside_v1(text) == ("Let me look.", [
        ("get_weather", '{"city": "New York", "days": 3}'),
        ("note", '{"flags": [true, null], "opts": {"a": 1}, "on": true, "pair": [1, "b"], "none": null}'),
        ("now", "{}")])


def test_a_value_declared_a_string_stays_verbatim_the_others_are_typed():
    text = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value> Paris </arg_value><arg_key>zip</arg_key>"
            "<arg_value>75001</arg_value><arg_key>days</arg_key><arg_value> 2 </arg_value><arg_key>unit</arg_key>"
            "<arg_value>'C'</arg_value></tool_call>")
    assert read_poolside_v1(text, _schema) == (None, [
        ("get_weather", '{"city": " Paris ", "zip": "75001", "days": 2, "unit": "C"}')])
    assert parse_poolside_v1(text) == (None, [("get_weather", '{"city": "Paris", "zip": 75001, "days": 2, "unit": "C"}')])


def test_calls_vllm_cannot_read_are_passed_over_and_so_is_text_between_pairs():
    text = ("Two tries.<tool_call>get\nweather<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
            "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value> stray <arg_key>b</arg_key>x<arg_value>2"
            "</arg_value></tool_call>")
    assert parse_poolside_v1(text) == ("Two tries.", [("f", '{"a": 1}')])


def test_a_blank_named_call_is_passed_over_where_vllm_calls_it_an_empty_name():
    blank = "<tool_call> <arg_key>a</arg_key><arg_value>1</arg_value></tool_call><tool_call>g</tool_call>"
    assert parse_poolside_v1(blank) == (None, [("g", "{}")])
    for alone in ("<tool_call> </tool_call>", "Hm.<tool_call>\t<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"):
        assert parse_poolside_v1(alone) == (alone, []), alone


def test_no_readable_call_or_a_value_that_is_no_json_leaves_the_whole_text_content():
    good = "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    for bad in ("no calls", "<tool_call></tool_call>", "<tool_call>\n</tool_call>",
                "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # no name
                "<tool_call>f stray\n<b>x</b></tool_call>",  # a tag other than a key after the name
                "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>",  # left open
                good + "<tool_call>g<arg_key>s</arg_key><arg_value>{1, 2}</arg_value></tool_call>",  # a set
                good + "<tool_call>g<arg_key>b</arg_key><arg_value>b'x'</arg_value></tool_call>",
                "<tool_call>f<arg_key>n</arg_key><arg_value>" + "9" * 5000 + "</arg_value></tool_call>"):
        assert parse_poolside_v1(bad) == (bad, []), bad
    odd = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": True}}}}]
    assert read_poolside_v1(good, lambda name: tool_properties(name, odd)) == (good, [])  # vLLM fails on it

