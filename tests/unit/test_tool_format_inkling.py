"""Inkling's tool calls (`rl/tool_formats/inkling.py`), read as vLLM 0.32's inkling reads a whole
completion: typed blocks, the calls its `<|content_invoke_tool_json|>` blocks' JSON objects,
arguments typed by the request's tool schema as vLLM types them."""

import json

import pytest

from rlhf_core.rl.tool_calls import tool_properties
from rlhf_core.rl.tool_formats.inkling import parse_inkling, read_inkling, typed

M, TEXT, THINK, CALL = "<|message_model|>", "<|content_text|>", "<|content_thinking|>", "<|content_invoke_tool_json|>"
END, END_SAMPLING = "<|end_message|>", "<|content_model_end_sampling|>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
    "tags": {"type": "array", "items": {"type": "string"}}}}}}]


def tool(payload, header=""):
    return M + header + CALL + payload + END


def properties_of(name):
    return tool_properties(name, TOOLS)


def test_calls_of_the_tool_blocks_and_the_text_blocks_content():
    text = (THINK + "The weather, then." + END + M + TEXT + "Checking." + END
            + tool('{"name":"get_weather","args":{"city":"SF","days":2}}', "get_weather") + tool('{"name":"now"}', "now")
            + M + TEXT + " And the time." + END + END_SAMPLING)
    calls = [("get_weather", '{"city": "SF", "days": 2}'), ("now", "{}")]
    assert parse_inkling(text) == ("Checking. And the time.", calls)
    # arguments as a string holding an object; the last block left open; a name stripped
    assert parse_inkling(CALL + '{"name": " f ", "args": "{\\"a\\": 1}"}') == (None, [("f", '{"a": 1}')])


def test_headers_thinking_and_the_other_blocks():
    # a header closed without a block kind is text; one before a kind is dropped
    assert parse_inkling(M + "hello" + END + tool('{"name":"now"}', "now")) == ("hello", [("now", "{}")])
    # from between blocks: a name written without its own <|message_model|> is text
    assert parse_inkling("now" + CALL + '{"name":"now"}' + END) == ("now", [("now", "{}")])
    # markers in thinking are thinking; a tool block may open in it
    assert parse_inkling(THINK + "maybe " + M + TEXT + "this" + CALL + '{"name":"now"}' + END + "after") == (
        "after", [("now", "{}")])
    raw = M + "<|content_invoke_tool_text|>raw" + END + M + "<|content_tool_error|>error" + END
    assert parse_inkling(raw + tool('{"name":"now"}')) == ("rawerror", [("now", "{}")])
    # in a tool block, another marker is text
    assert parse_inkling(tool('{"name":"f","args":{"s":"<|content_text|>"}}')) == (None, [("f", '{"s": "<|content_text|>"}')])


def test_arguments_typed_by_the_tool_schema_nested():
    text = tool('{"name":"get_weather","args":{"city":5,"days":"3","metric":"true","where":{"lat":"1.5"},'
                '"tags":[1,"b"],"other":"7"}}')
    as_written = {"city": 5, "days": "3", "metric": "true", "where": {"lat": "1.5"}, "tags": [1, "b"], "other": "7"}
    shaped = {"city": "5", "days": 3, "metric": True, "where": {"lat": 1.5}, "tags": ["1", "b"], "other": "7"}
    assert parse_inkling(text) == (None, [("get_weather", json.dumps(as_written))])
    assert read_inkling(text, properties_of) == (None, [("get_weather", json.dumps(shaped))])
    assert json.dumps(typed(2.0, {"type": "number"})) == "2" and typed(None, {"type": "string"}) == "null"


def test_args_only_and_blocks_without_a_name_passed_over():
    # vLLM reads `args` alone: `arguments` is not read
    assert parse_inkling(tool('{"name":"f","arguments":{"a":1}}')) == (None, [("f", "{}")])
    text = tool('{"args":{"a":1}}') + tool('{"name":"","args":{}}') + tool('{"name":null}') + tool('{"name":"now"}')
    assert parse_inkling(text) == (None, [("now", "{}")])
    only = tool('{"args":{"a":1}}')
    assert parse_inkling(only) == (only, [])


@pytest.mark.parametrize("text", [
    "plain text", M + TEXT + "No tools here." + END + END_SAMPLING, tool("not json"), tool('{"name":"f"} trailing'),
    tool('{"name":"f","args":[1]}'), tool('{"name":"f","args":null}'), tool('{"name":"f","args":"not json"}'),
    tool('{"name":5}'), tool('{"name":"  "}'), tool('{"name":"f","args":{"a":1}'), tool('[{"name":"f"}]'),
    tool('{"name":"f","args":{"x":NaN}}'), tool('{"name":"now"}') + tool("oops")])
def test_malformed_is_all_content(text):
    assert parse_inkling(text) == (text, [])
