"""Hermes-format tool calls in a completion's text (`rl/tool_calls.py`), parsed as vLLM's `hermes`
parser reads them."""

from rlhf_core.rl.tool_calls import parse_hermes


def test_calls_and_the_content_before_them():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "é"}}\n</tool_call>\n'
            '<tool_call>{"name": "mul", "parameters": {"x": 2}}</tool_call>')
    assert parse_hermes(text) == ("Let me add.", [("add", '{"a": 1, "b": "é"}'), ("mul", '{"x": 2}')])


def test_no_call_a_blank_content_and_a_call_left_open_at_the_end():
    assert parse_hermes("just text") == ("just text", [])
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}') == (None, [("f", '{"k": 1}')])


def test_a_malformed_call_makes_the_whole_text_content():
    for text in ('<tool_call>{"name": "f", "arguments": {}</tool_call>',  # not JSON
                 '<tool_call>["f"]</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f"}</tool_call><tool_call>oops</tool_call>'):
        assert parse_hermes(text) == (text, [])
    assert parse_hermes('<tool_call>{"name": "f"}</tool_call>') == (None, [("f", "{}")])
