"""MiniCPM5's tool calls (`rl/tool_formats/minicpm5.py`): `<function name=...>` elements of `<param>`s,
read as vLLM 0.32's minicpm5 parser reads a whole completion (checked against it on these texts)."""

import json

from rlhf_core.rl.tool_calls import tool_properties
from rlhf_core.rl.tool_formats.minicpm5 import parse_minicpm5, read_minicpm5

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "filters": {"type": "object"}}}}},
         {"type": "function", "function": {"name": "now"}}]


def typed(text):
    return read_minicpm5(text, lambda name: tool_properties(name, TOOLS))


def test_calls_anywhere_in_the_text_values_read_as_json_or_python_literals():
    """Each `<function>` block is a call; a value is the JSON or Python literal it reads as, else
    text; a CDATA value is kept as written. The content is None wherever a call is read."""
    text = ('Let me look.\n<function name="search"><param name="query">weather Paris</param>'
            '<param name="limit">3</param><param name="filters">{\'days\': (1, 2), \'fresh\': True}</param></function>\n'
            "<function name='note'><param name=\"text\"><![CDATA[a < b\n& c]]></param><param name=\"done\">True"
            '</param><param name="extra">None</param></function>')
    assert parse_minicpm5(text) == (None, [
        ("search", json.dumps({"query": "weather Paris", "limit": 3, "filters": {"days": [1, 2], "fresh": True}})),
        ("note", json.dumps({"text": "a < b\n& c", "done": True, "extra": None}))])
    mixed = '<function name="f"><param name="x">{\'a\': true}</param><param name="y">[1,</param></function>'
    assert parse_minicpm5(mixed) == (None, [("f", '{"x": "{\'a\': true}", "y": "[1,"}')])  # neither: text
    assert parse_minicpm5('<function name="now"></function>') == (None, [("now", "{}")])
    assert parse_minicpm5('<function name="now"><arguments><param name="tz">"UTC"</param></arguments></function>') \
        == (None, [("now", '{"tz": "UTC"}')])


def test_the_tool_schema_keeps_strings_and_chooses_the_params():
    """A param the schema declares a string stays text (unstripped, as the XML has it); a param it
    does not declare is dropped; an undeclared `properties`/`arguments` object gives the declared params."""
    text = ('<function name="search"><param name="query"> 42 </param><param name="limit"> 7 </param>'
            '<param name="page">2</param></function>')
    assert typed(text) == (None, [("search", '{"query": " 42 ", "limit": 7}')])
    assert parse_minicpm5(text) == (None, [("search", '{"query": 42, "limit": 7, "page": 2}')])
    wrapped = '<function name="search"><param name="arguments">{"query": 5, "limit": "9", "x": 1}</param></function>'
    assert typed(wrapped) == (None, [("search", '{"query": "5", "limit": 9}')])
    assert parse_minicpm5(wrapped) == (None, [("search", '{"arguments": {"query": 5, "limit": "9", "x": 1}}')])
    assert typed('<function name="now"><param name="tz">1</param></function>') == (None, [("now", '{"tz": 1}')])


def test_a_block_that_is_not_xml_is_read_by_its_tags():
    """A raw `&` or `<` makes no XML: the tags are read, each value stripped (a CDATA that is all of
    it unwrapped); the tokenizer's `Ġ`/`Ċ` marks read as a space and a newline."""
    text = ('<function name="search"><param name="query"> fish & chips </param><param name="limit">\n5\n</param>'
            '<param name="filters"><![CDATA[ {"a": 1} ]]></param></function>')
    assert parse_minicpm5(text) == (None, [("search", '{"query": "fish & chips", "limit": 5, "filters": {"a": 1}}')])
    assert parse_minicpm5('<functionĠname="f"><paramname="q">aĠbĊc</param></function>') \
        == (None, [("f", '{"q": "a b\\nc"}')])


def test_well_formed_calls_are_read_beside_malformed_ones():
    """As vLLM: a malformed block is passed over (dropped with all the text: the content is None)."""
    text = ('<function name="f"><param>1</param></function> and <function name="g"><param name="x">[1]</param>'
            '</function> then <function name="h"><param name="y">2')
    assert parse_minicpm5(text) == (None, [("g", '{"x": [1]}')])


def test_malformed_texts_are_content():
    for bad in ("no calls", "", '<function name="f">left open', "<function><param name=\"a\">1</param></function>",
                '<function name=" "></function>', '<function name="f"><param>1</param></function>',
                '<function name="f"><param name="">1</param></function>',
                '<function name="f"><param name="a">1</param><param name="a">2</param></function>',
                '<function name="f"><param name="a">{1, 2}</param></function>',  # a set: no JSON
                '<function id="1" name="f"><param name="a">x & y</param></function>'):  # no tag-read name
        assert parse_minicpm5(bad) == (bad, []) and typed(bad) == (bad, []), bad
    for bad in ('<function name="search"><param name="properties">{"x": 1}</param></function>',  # none declared
                '<function name="search"><param name="arguments">[1]</param></function>'):
        assert typed(bad) == (bad, []), bad

