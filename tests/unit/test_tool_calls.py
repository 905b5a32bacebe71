"""Tool calls in a completion's text (`rl/tool_calls.py`, the parsers in `rl/tool_formats/`), each
format read as vLLM's parser of the same name reads a whole completion; a template's format found
by its markers."""

import json

import pytest

from rlhf_core.rl.tool_calls import PARSERS, detect, read_calls, typed_arguments
from rlhf_core.rl.tool_formats.cohere import parse_cohere_command3, parse_cohere_command4
from rlhf_core.rl.tool_formats.gemma import parse_functiongemma, parse_gemma4
from rlhf_core.rl.tool_formats.harmony import parse_openai
from rlhf_core.rl.tool_formats.json_lists import (
    parse_apertus,
    parse_granite,
    parse_hunyuan_a13b,
    parse_jamba,
    parse_minimax,
    parse_mistral,
    parse_phi4_mini_json,
    parse_qwen2_5_coder,
    parse_xlam,
)
from rlhf_core.rl.tool_formats.json_objects import (
    parse_ernie45,
    parse_gigachat3,
    parse_granite4,
    parse_granite_20b_fc,
    parse_hermes,
    parse_internlm2,
    parse_llama3_json,
    parse_longcat,
)
from rlhf_core.rl.tool_formats.python_calls import parse_lfm2, parse_olmo3, parse_pythonic
from rlhf_core.rl.tool_formats.sectioned import (
    parse_deepseek_v3,
    parse_deepseek_v31,
    parse_kimi_k2,
    parse_plamo3,
)
from rlhf_core.rl.tool_formats.xml_calls import (
    parse_deepseek_v4,
    parse_deepseek_v32,
    parse_deepseek_v41,
    parse_dots,
    parse_glm45,
    parse_glm47,
    parse_hy_v3,
    parse_hy_v4,
    parse_minimax_m2,
    parse_qwen3_coder,
    parse_seed_oss,
    parse_step3,
)
from rlhf_core.rl.tool_formats.xtml import parse_kimi_k3


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


def test_llama3_json_calls_after_the_python_tag_and_separated_by_semicolons():
    one = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}'
    assert parse_llama3_json(one) == (None, [("get_weather", '{"city": "Paris", "days": [1, 2]}')])
    two = '{"name": "a", "arguments": {"x": {"y": 1}}}; {"name": "b", "parameters": {}}'
    assert parse_llama3_json(two) == (None, [("a", '{"x": {"y": 1}}'), ("b", "{}")])
    for text in ("The sum is 3.", "a set {1, 2} in prose", '{"name": "a"}',  # no arguments: not a call
                 '{"name": "a", "parameters": {}} and {"oops": 1}', '{"name": 3, "parameters": {}}',
                 '{"name": "a", "parameters": {"x": 1}'):  # never closed
        assert parse_llama3_json(text) == (text, []), text


def test_mistral_calls_in_both_of_its_forms():
    listed = 'Checking.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "neg", "arguments": {"x": 2}}]'
    assert parse_mistral(listed) == ("Checking.", [("add", '{"a": 1}'), ("neg", '{"x": 2}')])
    newer = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]neg[ARGS]{"x": 2}'
    assert parse_mistral(newer) == (None, [("add", '{"a": 1, "b": 2}'), ("neg", '{"x": 2}')])
    assert parse_mistral('[TOOL_CALLS]add[ARGS]{"a": 1} sub[ARGS]{}') == (None, [("add", '{"a": 1}'), ("sub", "{}")])
    for text in ("no calls", "[TOOL_CALLS]", "[TOOL_CALLS][]", '[TOOL_CALLS][{"arguments": {}}]',
                 "[TOOL_CALLS]add{}", '[TOOL_CALLS]add[ARGS]{"a": ', '[TOOL_CALLS]two words[ARGS]{}'):
        assert parse_mistral(text) == (text, []), text


def test_pythonic_calls_take_literal_keyword_arguments_only():
    text = '[get_weather(city="Paris", units=None, days=[1, -2]), tools.add(a=1.5, b=true, opts={"k": null})]'
    assert parse_pythonic(text) == (None, [
        ("get_weather", '{"city": "Paris", "units": null, "days": [1, -2]}'),
        ("tools.add", '{"a": 1.5, "b": true, "opts": {"k": null}}')])
    assert parse_pythonic("<|python_start|>[f()]<|python_end|>") == (None, [("f", "{}")])
    for text in ("[1, 2]", "no calls", "[f(1)]", "[f(x=y)]", "[f(x=1)", "[f(**kw)]", "[f(x={1, 2})]",
                 "[f(x=1), 3]", "[(lambda: 1)(x=1)]", "[]"):
        assert parse_pythonic(text) == (text, []), text


def test_qwen3_coder_xml_calls_with_text_values():
    text = ("I'll add.\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=note>\ntwo\nlines\n"
            "</parameter>\n</function>\n</tool_call>\n<tool_call><function=noop></function></tool_call>")
    assert parse_qwen3_coder(text) == ("I'll add.", [("add", '{"a": "1", "note": "two\\nlines"}'), ("noop", "{}")])
    for bad in ("no calls", '<tool_call>{"name": "add", "arguments": {}}</tool_call>',  # Hermes' JSON: not this format
                "<tool_call><function=f><parameter=a>1</parameter>stray</function></tool_call>",
                "<tool_call><function=f></function><function=g></function></tool_call>",
                "<tool_call><function=f><parameter=a>1</function></tool_call>"):  # parameter never closed
        assert parse_qwen3_coder(bad) == (bad, []), bad


def test_qwen3_coder_values_are_typed_by_the_requests_tool_schema():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "opts": {"type": "object"},
        "xs": {"type": "array"}, "s": {"type": "string"}, "maybe": {"type": ["integer", "null"]}}}}}]
    raw = json.dumps({"n": "3", "x": "2.5", "ok": "true", "opts": '{"k": 1}', "xs": "[1, 2]", "s": "42",
                      "maybe": "null", "extra": "7"})
    assert json.loads(typed_arguments("f", raw, tools)) == {"n": 3, "x": 2.5, "ok": True, "opts": {"k": 1},
                                                            "xs": [1, 2], "s": "42", "maybe": None, "extra": "7"}
    # a value that is not of its declared type stays the text written; no schema: all text
    assert json.loads(typed_arguments("f", json.dumps({"n": "2.5", "ok": "yes"}), tools)) == {"n": "2.5", "ok": "yes"}
    assert typed_arguments("g", raw, tools) == raw and typed_arguments("f", raw, None) == raw


def test_deepseek_calls_in_the_v3_and_v31_forms():
    fence = "\n```json\n{}\n```"
    v3 = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather"
          + fence.format('{"city": "Paris"}') + "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add"
          + fence.format('{"a": 1}') + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert parse_deepseek_v3(v3) == ("Let me check.", [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1}')])
    v31 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜>"
           "<｜tool▁call▁begin｜>neg<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert parse_deepseek_v31(v31) == (None, [("add", '{"a": 1}'), ("neg", "{}")])
    assert parse_deepseek_v3(v31) == (v31, []) and parse_deepseek_v31(v3) == (v3, [])  # each reads its own form
    for bad in ("no calls", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁begin｜>stray<｜tool▁calls▁end｜>",
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": <｜tool▁call▁end｜>",
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>[1]<｜tool▁call▁end｜>",
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{}"):  # never closed
        assert parse_deepseek_v31(bad) == (bad, []), bad


def test_kimi_k2_calls_are_named_by_their_headers():
    text = ("Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Tokyo"}<|tool_call_end|>'
            "<|tool_call_begin|>add:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
    assert parse_kimi_k2(text) == ("Checking.", [("get_weather", '{"city": "Tokyo"}'), ("add", "{}")])
    for bad in ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f<|tool_call_argument_begin|>{}"
                "<|tool_call_end|>",  # no index
                "<|tool_calls_section_begin|><|tool_call_begin|>f:0{}<|tool_call_end|>",  # no argument marker
                "<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>oops<|tool_call_end|>"):
        assert parse_kimi_k2(bad) == (bad, []), bad


def test_granite_calls_after_either_marker():
    assert parse_granite('<|tool_call|>[{"name": "add", "arguments": {"a": 1}}]') == (None, [("add", '{"a": 1}')])
    text = 'Sure. <tool_call> [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1]}}]'
    assert parse_granite(text) == ("Sure.", [("a", "{}"), ("b", '{"x": [1]}')])
    for bad in ("no calls", "<|tool_call|>[]", '<|tool_call|>{"name": "a", "arguments": {}}',
                '<|tool_call|>[{"arguments": {}}]', '<|tool_call|>[{"name": "a"'):
        assert parse_granite(bad) == (bad, []), bad


def test_glm45_calls_name_then_key_value_pairs_typed_by_the_schema():
    """As GLM-4.5's template writes them: the name right after <tool_call>, then each argument a
    key tag and a value tag (newlines between them or not); a call may have no arguments."""
    text = ("I will look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
            "<tool_call>now</tool_call><tool_call>note<arg_key>text</arg_key><arg_value> two\nlines </arg_value>"
            "</tool_call>")
    assert parse_glm45(text) == ("I will look.", [("get_weather", '{"city": "New York", "days": "3"}'),
                                                  ("now", "{}"), ("note", '{"text": " two\\nlines "}')])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    assert read_calls("glm45", text, tools)[1][0] == ("get_weather", '{"city": "New York", "days": 3}')
    for bad in ("no calls", "<tool_call></tool_call>", "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
                "<tool_call>f<arg_key>a</arg_key>stray<arg_value>1</arg_value></tool_call>",
                "<tool_call>f<arg_key>a</arg_key><arg_value>1</tool_call>"):  # no name / not pairs / unclosed
        assert parse_glm45(bad) == (bad, []), bad


def test_minimax_m2_invokes_with_named_parameters():
    text = ('Checking both.<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Seattle'
            '</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n<invoke name=\'now\'>\n</invoke>\n'
            '</minimax:tool_call>')
    assert parse_minimax_m2(text) == ("Checking both.", [("get_weather", '{"city": "Seattle", "days": "2"}'),
                                                         ("now", "{}")])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"days": {"type": "number"}}}}}]
    assert read_calls("minimax_m2", text, tools)[1][0] == ("get_weather", '{"city": "Seattle", "days": 2}')
    for bad in ("no calls", "<minimax:tool_call></minimax:tool_call>", "<minimax:tool_call>text</minimax:tool_call>",
                '<minimax:tool_call><invoke name="f">stray</invoke></minimax:tool_call>',
                '<minimax:tool_call><invoke name="">\n</invoke></minimax:tool_call>'):
        assert parse_minimax_m2(bad) == (bad, []), bad


def test_seed_oss_calls_after_the_thinking_typed_by_the_schema():
    text = ("<seed:think>Weather first.</seed:think>Sure.<seed:tool_call>\n<function=get_weather>\n<parameter=city>"
            "\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</seed:tool_call>"
            "<seed:tool_call><function=now></function></seed:tool_call>")
    assert parse_seed_oss(text) == ("<seed:think>Weather first.</seed:think>Sure.",
                                    [("get_weather", '{"city": "Paris", "days": "3"}'), ("now", "{}")])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    assert read_calls("seed_oss", text, tools)[1][0] == ("get_weather", '{"city": "Paris", "days": 3}')
    # no section written: each <function=...> alone, as vLLM backs off
    assert parse_seed_oss("<function=now></function>") == (None, [("now", "{}")])
    # a call inside the thinking is not a call
    thought = "<seed:think><seed:tool_call><function=now></function></seed:tool_call></seed:think>Done."
    for bad in ("no calls", thought, "<seed:tool_call>text</seed:tool_call>",
                "<seed:tool_call><function=f><parameter=a>1</parameter>stray</function></seed:tool_call>"):
        assert parse_seed_oss(bad) == (bad, []), bad


def test_step3_calls_in_a_closed_section_with_the_text_around_as_content():
    call = ('<｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="get_weather"><steptml:parameter '
            'name="city"> Paris </steptml:parameter><steptml:parameter name="days">3</steptml:parameter>'
            '</steptml:invoke><｜tool_call_end｜>')
    other = '<｜tool_call_begin｜>search<｜tool_sep｜><steptml:invoke name="web"></steptml:invoke><｜tool_call_end｜>'
    text = f"Looking.<｜tool_calls_begin｜>{call}{other}<｜tool_calls_end｜> Done."
    assert parse_step3(text) == ("Looking. Done.", [("get_weather", '{"city": "Paris", "days": "3"}')])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "properties": {"days": {"type": "integer"}}}}}]
    assert read_calls("step3", text, tools)[1][0] == ("get_weather", '{"city": "Paris", "days": 3}')
    for bad in ("no calls", f"<｜tool_calls_begin｜>{call}", f"<｜tool_calls_begin｜>{other}<｜tool_calls_end｜>"):
        assert parse_step3(bad) == (bad, []), bad


def test_xlam_lists_bare_fenced_tagged_or_after_the_thinking():
    listed = '[{"name": "add", "arguments": {"a": 1, "b": [2]}}, {"name": "now", "arguments": "{}"}]'
    calls = [("add", '{"a": 1, "b": [2]}'), ("now", "{}")]
    assert parse_xlam(listed) == (None, calls)
    assert parse_xlam(f"Adding.\n```json\n{listed}\n```") == ("Adding.", calls)
    assert parse_xlam(f"Adding. <tool_call>{listed}</tool_call>") == ("Adding.", calls)
    assert parse_xlam(f"[TOOL_CALLS]{listed}\nthen more") == ("then more", calls)
    assert parse_xlam(f"<think>sum it</think>\n{listed}") == ("<think>sum it</think>", calls)
    # an item without arguments is passed over, as vLLM does
    assert parse_xlam('[{"name": "add"}, {"name": "now", "arguments": {}}]') == (None, [("now", "{}")])
    for bad in ("no calls", "[1, 2]", '{"name": "add", "arguments": {}}', "```json\n[\n```", '[{"name": "add"}]'):
        assert parse_xlam(bad) == (bad, []), bad


def test_phi4_mini_functools_list_read_whole():
    text = 'functools[{"name": "pick", "arguments": {"from": [1, 2]}}, {"name": "now", "parameters": {}}]'
    assert parse_phi4_mini_json(text) == (None, [("pick", '{"from": [1, 2]}'), ("now", "{}")])
    assert parse_phi4_mini_json("Sure: " + text)[1] == [("pick", '{"from": [1, 2]}'), ("now", "{}")]
    for bad in ("no calls", "functools[]", 'functools[{"name": "f"}]', "functools[{bad json}]"):
        assert parse_phi4_mini_json(bad) == (bad, []), bad


def test_internlm2_reads_one_call_after_the_plugin_action():
    text = 'Adding.<|action_start|><|plugin|>\n{"name": "add", "parameters": {"a": 1, "b": "é"}}<|action_end|>'
    assert parse_internlm2(text) == ("Adding.", [("add", '{"a": 1, "b": "é"}')])
    assert parse_internlm2('<|action_start|><|plugin|>{"name": "now", "arguments": {}}') == (None, [("now", "{}")])
    twice = '<|action_start|><|plugin|>{"name": "a"}<|action_end|><|action_start|><|plugin|>{"name": "b"}<|action_end|>'
    for bad in ("no calls", "<|action_start|><|plugin|>oops<|action_end|>",  # vLLM raises on these
                '<|action_start|><|plugin|>{"arguments": {}}<|action_end|>', twice):  # one call only
        assert parse_internlm2(bad) == (bad, []), bad


def test_jamba_reads_the_first_closed_tool_calls_list():
    text = ('Checking. <tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "now", "arguments": {}}]</tool_calls>')
    assert parse_jamba(text) == ("Checking.", [("get_weather", '{"city": "Paris"}'), ("now", "{}")])
    for bad in ("no calls", '<tool_calls>[{"name": "a", "arguments": {}}]',  # never closed
                '<tool_calls>{"name": "a", "arguments": {}}</tool_calls>', "<tool_calls>[]</tool_calls>",
                '<tool_calls>[{"name": "a", "arguments": {}}, {"name": "b"}]</tool_calls>'):  # b has no arguments
        assert parse_jamba(bad) == (bad, []), bad


def test_hunyuan_a13b_reads_the_first_json_section_outside_the_thinking():
    # the text before the section read is the content: the thinking, and a section that is not JSON
    before = ('<think>Maybe <tool_calls>[{"name": "no", "arguments": {}}]</tool_calls> first.</think>\nSure.'
              '<tool_calls>oops</tool_calls>')
    text = (before + '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "skipped"}, '
            '{"name": "add", "arguments": "{\\"a\\": 1}"}]</tool_calls>')
    assert parse_hunyuan_a13b(text) == (before, [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1}')])
    for bad in ("助手：no calls", '<tool_calls>{"name": "a", "arguments": {}}</tool_calls>',
                '<tool_calls>[{"name": "a", "arguments": [1]}]</tool_calls>',  # arguments neither object nor text
                '<tool_calls>[{"name": "a"}]</tool_calls>',
                '<think><tool_calls>[{"name": "a", "arguments": {}}]</tool_calls></think>'):
        assert parse_hunyuan_a13b(bad) == (bad, []), bad


def test_longcat_reads_hermes_calls_in_its_own_tags():
    text = ('Let me add.<longcat_tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</longcat_tool_call>'
            '<longcat_tool_call>{"name": "now", "arguments": {}}')  # the last may be left open
    assert parse_longcat(text) == ("Let me add.", [("add", '{"a": 1}'), ("now", "{}")])
    for bad in ("no calls", '<tool_call>{"name": "add", "arguments": {}}</tool_call>',
                "<longcat_tool_call>oops</longcat_tool_call>"):
        assert parse_longcat(bad) == (bad, []), bad


def test_olmo3_reads_pythonic_calls_one_a_line():
    text = ("I'll check.\n<function_calls>\nget_weather(city='New York', units=null)\nadd(a=1, b=true)\n"
            "</function_calls>")
    assert parse_olmo3(text) == (None, [("get_weather", '{"city": "New York", "units": null}'),
                                        ("add", '{"a": 1, "b": true}')])
    assert parse_olmo3('now()\nget_weather(city="Paris")') == (None, [("now", "{}"), ("get_weather", '{"city": "Paris"}')])
    for bad in ("Hello world", "<function_calls>\nf(x=1)\n", "<function_calls>\n[f(x=1)]\n</function_calls>",
                "<function_calls>\nf(x=[1,\n2])\n</function_calls>", "<function_calls></function_calls>",
                "<function_calls>\nf(1)\n</function_calls>"):
        assert parse_olmo3(bad) == (bad, []), bad


def test_ernie45_reads_json_calls_and_passes_over_blocks_without_one():
    text = ('Thinking.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"where": {"city": "Paris"}}}\n'
            '</tool_call>\n<tool_call>oops</tool_call><tool_call>{"name": "now"}</tool_call>')
    assert parse_ernie45(text) == ("Thinking.\n</think>", [("get_weather", '{"where": {"city": "Paris"}}'),
                                                           ("now", "{}")])
    for bad in ("no calls", '<tool_call>{"name": "a", "arguments": {}</tool_call>', "<tool_call>{bad}</tool_call>",
                "<tool_call>oops</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_ernie45(bad) == (bad, []), bad


def test_openai_harmony_messages_to_functions_are_calls():
    text = ("<|channel|>analysis<|message|>Need the weather and a sum.<|end|><|start|>assistant<|channel|>commentary"
            "<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>"
            'json<|message|>{"city":"Paris"}<|call|><|start|>assistant to=functions.add<|channel|>commentary json'
            '<|message|>{"a": 1, "b": "é"}')  # the last call's <|call|> ends the completion: not in its text
    assert parse_openai(text) == ("Checking.", [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": "é"}')])
    final = ('<|channel|>commentary to=functions.run code<|message|>print(1)<|call|><|start|>assistant<|channel|>'
             "final<|message|>Done.<|return|>")
    assert parse_openai(final) == ("Done.", [("run", "print(1)")])  # not JSON by its content type: as written
    assert parse_openai("<|channel|>commentary to=functions.f<|message|>{oops<|call|>") == (None, [("f", "{oops")])
    for bad in ("plain text", "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>Hi",
                '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"q": 1}<|call|>',  # built in
                "<|channel|>commentary to=functions.f json extra<|message|>{}<|call|>",  # a header harmony refuses
                "<|channel|>commentary to=functions.f <|constrain|>json"):  # the header never ends
        assert parse_openai(bad) == (bad, []), bad


def test_granite4_reads_closed_blocks_and_all_the_text_around_them():
    text = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>\nThen sum.')
    assert parse_granite4(text) == ("I will check.\n\n\nThen sum.", [("get_weather", '{"city": "Paris"}'),
                                                                   ("add", '{"a": 1}')])
    for bad in ("no calls", '<tool_call>{"name": "f", "arguments": {}}',  # left open
                '<tool_call>{"name": "f"}</tool_call>', '<tool_call>[{"name": "f", "arguments": {}}]</tool_call>',
                '<tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>', "</tool_call>",
                '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>oops</tool_call>'):
        assert parse_granite4(bad) == (bad, []), bad


def test_lfm2_reads_a_pythonic_list_between_its_markers():
    text = ('Let me check.<|tool_call_start|>[get_weather(city="Paris"), tools.add(a=1, b=-2.5)]<|tool_call_end|>'
            "Checking now.")
    assert parse_lfm2(text) == ("Let me check.\nChecking now.", [("get_weather", '{"city": "Paris"}'),
                                                                ("tools.add", '{"a": 1, "b": -2.5}')])
    echoed = '<|tool_call_start|>[run(cmd="ls\n-l")]<|tool_call_end|>[run(cmd="ls")]<|tool_call_end|> Sure.'
    assert parse_lfm2(echoed) == ("Sure.", [("run", '{"cmd": "ls\\n-l"}')])  # a raw newline in a string read
    assert parse_lfm2("<|tool_call_start|>[now()]") == (None, [("now", "{}")])
    for bad in ("[now()]", "<|tool_call_start|>now()<|tool_call_end|>", "<|tool_call_start|>[]<|tool_call_end|>",
                "<|tool_call_start|>[f(x=y)]<|tool_call_end|>", "<|tool_call_start|>[f(1)]<|tool_call_end|>"):
        assert parse_lfm2(bad) == (bad, []), bad


def test_apertus_reads_one_key_objects_after_its_prefix():
    text = ('I will check. <|tools_prefix|>[{"get_weather": {"city": "Zürich"}}, {"now": {}}, 3]<|tools_suffix|>'
            " Then more.")
    assert parse_apertus(text) == ("I will check.\nThen more.", [("get_weather", '{"city": "Zürich"}'), ("now", "{}")])
    assert parse_apertus('<|tools_prefix|>{"f": {"a": 1}} and text') == ("and text", [("f", '{"a": 1}')])
    for bad in ('[{"f": {}}]', "<|tools_prefix|>not json<|tools_suffix|>", "<|tools_prefix|>[]<|tools_suffix|>",
                '<|tools_prefix|>[{"f": {"a": 1}}, {"g": '):  # cut off (vLLM reads what it can)
        assert parse_apertus(bad) == (bad, []), bad


def test_cohere_command_reads_actions_and_the_answer_without_the_thinking():
    text = ('<|START_THINKING|>I will look it up.<|END_THINKING|>Sure, <co>Paris</co: 0:[1]>.<|START_ACTION|>[\n'
            '    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}},\n'
            '    {"tool_call_id": "1", "tool_name": "now"}\n]<|END_ACTION|>')
    calls = [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    assert parse_cohere_command3(text) == ("Sure, Paris.", calls)
    assert parse_cohere_command4(text) == ("Sure, Paris.", calls)
    one = '<|START_ACTION|>{"tool_call_id": "0", "tool_name": "f", "parameters": {}}<|END_ACTION|>'
    assert parse_cohere_command3("Before." + one + "<|START_RESPONSE|>After.<|END_RESPONSE|>ignored") == (
        "Before.After.", [("f", "{}")])
    assert parse_cohere_command4("Planning." + one + "<|START_TEXT|>Answer.<|END_TEXT|>") == ("Answer.", [("f", "{}")])
    for bad in ("<|START_RESPONSE|>no calls<|END_RESPONSE|>", "<|START_ACTION|>[]<|END_ACTION|>",
                '<|START_ACTION|>[{"tool_name": "f", "parameters": {}}]<|END_ACTION|>',  # no tool_call_id
                '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": "x"}]<|END_ACTION|>',
                '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": {"a": 1}<|END_ACTION|>'):
        assert parse_cohere_command3(bad) == (bad, []) and parse_cohere_command4(bad) == (bad, []), bad


def test_glm47_reads_glm45s_calls_and_a_literal_newline_between_key_and_value():
    text = ("Looking it up.<tool_call>get_weather<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value></tool_call><tool_call>now</tool_call>")
    calls = [("get_weather", '{"city": "Paris", "days": "2"}'), ("now", "{}")]
    assert parse_glm47(text) == ("Looking it up.", calls)
    one = "<tool_call>f<arg_key>a</arg_key>\\n<arg_value>1</arg_value></tool_call>"
    assert parse_glm47(one) == (None, [("f", '{"a": "1"}')])
    assert parse_glm45(one) == (one, [])  # GLM-4.5's reading allows only whitespace there
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "properties": {"days": {"type": "integer"}}}}}]
    assert read_calls("glm47", text, tools)[1][0] == ("get_weather", '{"city": "Paris", "days": 2}')
    for bad in ("no calls", "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
                "<tool_call>f<arg_key>a</arg_key>x<arg_value>1</arg_value></tool_call>"):
        assert parse_glm47(bad) == (bad, []), bad


def test_qwen3_xml_is_qwen3_coders_syntax_typed_by_the_schema():
    text = "Adding.<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    assert PARSERS["qwen3_xml"](text) == ("Adding.", [("add", '{"a": "1"}')])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"properties": {"a": {"type": "number"}}}}}]
    assert read_calls("qwen3_xml", text, tools) == ("Adding.", [("add", '{"a": 1}')])
    bad = "<tool_call><function=f><parameter=a>1</function></tool_call>"
    assert PARSERS["qwen3_xml"]("no calls") == ("no calls", []) and PARSERS["qwen3_xml"](bad) == (bad, [])


D = "｜DSML｜"


def dsml_call(name: str, *parameters: tuple[str, bool, str]) -> str:
    """One DSML invoke as DeepSeek-V3.2's encoding writes it, each parameter (key, is a string, value)."""
    written = "".join(f'<{D}parameter name="{key}" string="{str(as_string).lower()}">{value}</{D}parameter>\n'
                      for key, as_string, value in parameters)
    return f'<{D}invoke name="{name}">\n{written}</{D}invoke>\n'


def test_deepseek_v32_and_v4_read_dsml_invokes_in_their_own_sections():
    calls = (dsml_call("get_weather", ("city", True, "Hangzhou"), ("days", False, "3"), ("note", True, "42"))
             + dsml_call("now"))
    v32 = f"<think>Weather first.</think>Let me check.\n\n<{D}function_calls>\n{calls}</{D}function_calls>"
    v4 = f"Let me check.<{D}tool_calls>\n{calls}</{D}tool_calls>"
    read = [("get_weather", '{"city": "Hangzhou", "days": "3", "note": "42"}'), ("now", "{}")]
    assert parse_deepseek_v32(v32) == ("<think>Weather first.</think>Let me check.", read)
    assert parse_deepseek_v4(v4) == ("Let me check.", read)
    assert parse_deepseek_v32(v4) == (v4, []) and parse_deepseek_v4(v32) == (v32, [])  # each reads its own section
    # string="false" values are typed by the schema; string="true" ones stay strings, whatever it declares
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"properties": {
        "days": {"type": "integer"}, "note": {"type": "integer"}}}}}]
    typed = [("get_weather", '{"city": "Hangzhou", "days": 3, "note": "42"}'), ("now", "{}")]
    assert read_calls("deepseek_v32", v32, tools) == ("<think>Weather first.</think>Let me check.", typed)
    assert read_calls("deepseek_v4", v4, tools) == ("Let me check.", typed)
    obj = f"<{D}tool_calls>" + dsml_call("f", ("opts", False, '{"k": [1, 2]}')) + f"</{D}tool_calls>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"opts": {"type": "object"}}}}}]
    assert read_calls("deepseek_v4", obj, tools) == (None, [("f", '{"opts": {"k": [1, 2]}}')])
    # a parameter without its `string` attribute reads as a typed one (vLLM 0.32 keeps it so)
    bare = f'<{D}tool_calls><{D}invoke name="f"><{D}parameter name="opts">{{"k": 1}}</{D}parameter></{D}invoke></{D}tool_calls>'
    assert read_calls("deepseek_v4", bare, tools) == (None, [("f", '{"opts": {"k": 1}}')])
    for bad in ("no calls", f"<{D}tool_calls>\n{calls}",  # never closed: passed over, as vLLM does
                f"<{D}tool_calls>stray{calls}</{D}tool_calls>", f"<{D}tool_calls></{D}tool_calls>",
                f'<{D}tool_calls><{D}invoke name="f">text</{D}invoke></{D}tool_calls>'):
        assert parse_deepseek_v4(bad) == (bad, []) and read_calls("deepseek_v4", bad, tools) == (bad, []), bad


def test_deepseek_v41_reads_v4s_calls_with_a_space_in_every_tag():
    """DeepSeek-V4.1 writes V4's DSML with a space after the marker: `<｜DSML｜ calls>`, `<｜DSML｜
    invoke ...>`, `<｜DSML｜ parameter ...>`; V4's unspaced section is not its, nor its V4's."""
    s = D + " "
    v41 = (f'Checking.<{s}calls>\n<{s}invoke name="get_weather">\n<{s}parameter name="city" string="true">Hangzhou'
           f'</{s}parameter>\n<{s}parameter name="days" string="false">3</{s}parameter>\n</{s}invoke>\n</{s}calls>')
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"properties": {
        "days": {"type": "integer"}}}}}]
    assert parse_deepseek_v41(v41) == ("Checking.", [("get_weather", '{"city": "Hangzhou", "days": "3"}')])
    assert read_calls("deepseek_v41", v41, tools) == ("Checking.", [("get_weather", '{"city": "Hangzhou", "days": 3}')])
    v4 = f"<{D}tool_calls>" + dsml_call("now") + f"</{D}tool_calls>"
    assert parse_deepseek_v41(v4) == (v4, []) and parse_deepseek_v4(v41) == (v41, [])
    assert detect("{{- '<" + s + "calls>' }}") == "deepseek_v41"


def test_kimi_k3_reads_the_tools_channel_typed_by_each_arguments_type():
    call = ('<|open|>call tool="run" index="1"<|sep|>\n<|open|>argument key="code" type="string"<|sep|>print(1)\n'
            '<|close|>argument<|sep|>\n<|open|>argument key="opts" type="object"<|sep|>{"a": 1}<|close|>argument<|sep|>'
            '\n<|open|>argument key="n" type="integer"<|sep|>7<|close|>argument<|sep|>\n<|close|>call<|sep|>')
    other = '<|open|>call tool="say &quot;hi&quot;" index="2"<|sep|><|close|>call<|sep|>'
    text = (f"<|open|>response<|sep|>Running it.<|close|>response<|sep|><|open|>tools<|sep|>\n{call}\n{other}\n"
            "<|close|>tools<|sep|><|close|>message<|sep|>")
    calls = [("run", '{"code": "print(1)\\n", "opts": {"a": 1}, "n": 7}'), ('say "hi"', "{}")]
    assert parse_kimi_k3(text) == ("Running it.", calls)
    # the prompt wrote the response channel's opening: the text before the tools, its closing dropped
    assert parse_kimi_k3(f"Sure.<|close|>response<|sep|><|open|>tools<|sep|>{call}") == ("Sure.", calls[:1])
    assert parse_kimi_k3(f"<|open|>tools<|sep|>{other}<|close|>tools<|sep|>") == (None, [('say "hi"', "{}")])
    for bad in ("no calls", "<|open|>response<|sep|>Hi<|close|>response<|sep|>", "<|open|>tools<|sep|><|close|>tools<|sep|>",
                f"<|open|>tools<|sep|>stray{call}<|close|>tools<|sep|>",
                '<|open|>tools<|sep|><|open|>call index="1"<|sep|><|close|>call<|sep|>',  # no tool name
                '<|open|>tools<|sep|><|open|>call tool="f"<|sep|>text<|close|>call<|sep|>',
                '<|open|>tools<|sep|><|open|>call tool="f"<|sep|><|open|>argument key="a"<|sep|>1<|close|>call<|sep|>'):
        assert parse_kimi_k3(bad) == (bad, []), bad


def test_gemma4_reads_its_own_notation_of_arguments():
    q = '<|"|>'
    text = (f"Checking.<|tool_call>call:get_weather{{location:{q}Paris, FR{q},days:3,metric:true,"
            f"ratio:0.5,since:null,where:{{lat:48.8,tags:[{q}a{q},{q}b}}{q}]}},none:[]}}<tool_call|>"
            "<|tool_call>call:tools.now{}<tool_call|>")
    assert parse_gemma4(text) == ("Checking.", [
        ("get_weather", '{"location": "Paris, FR", "days": 3, "metric": true, "ratio": 0.5, "since": null, '
                        '"where": {"lat": 48.8, "tags": ["a", "b}"]}, "none": []}'),
        ("tools.now", "{}")])
    for bad in ("no calls", f"<|tool_call>call:f{{a:{q}never closed}}<tool_call|>", "<|tool_call>call:f{a:[1, 2}<tool_call|>",
                f"<|tool_call>call:f{{a:{q}x{q}y}}<tool_call|>", "<|tool_call>f{}<tool_call|>",  # no call: prefix
                "<|tool_call>call:f{a:1}", "<|tool_call>call:f{just text}<tool_call|>",
                "<|tool_call>call:f{}<tool_call|><|tool_call>oops"):
        assert parse_gemma4(bad) == (bad, []), bad


def test_aliases_read_the_syntax_they_share():
    """llama4_pythonic is pythonic's reading (Llama 4's <|python_start|> wrapping dropped); step3p5 and
    mimo read Qwen3-Coder's XML calls, values typed by the request's schema."""
    wrapped = '<|python_start|>[get_weather(city="Paris", days=[1, 2]), now()]<|python_end|>'
    assert PARSERS["llama4_pythonic"](wrapped) == (None, [("get_weather", '{"city": "Paris", "days": [1, 2]}'),
                                                          ("now", "{}")])
    for bad in ("The answer is 3.", "[f(1)]", "<|python_start|>[f(x=y)]<|python_end|>"):
        assert PARSERS["llama4_pythonic"](bad) == (bad, []), bad
    text = "Adding.<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"properties": {"a": {"type": "integer"}}}}}]
    for fmt in ("step3p5", "mimo"):
        assert PARSERS[fmt](text) == ("Adding.", [("add", '{"a": "1"}')])
        assert read_calls(fmt, text, tools) == ("Adding.", [("add", '{"a": 1}')])
        bad = "<tool_call><function=f><parameter=a>1</function></tool_call>"
        assert PARSERS[fmt]("no calls") == ("no calls", []) and PARSERS[fmt](bad) == (bad, [])


def test_vllms_other_names_for_the_json_readers():
    """vLLM 0.32 registers internlm for InternLM2's reader, llama4_json for Llama 3's JSON calls and
    qwen3_json for Hermes' blocks: the same readings here."""
    for alias, reader, text in (
            ("internlm", parse_internlm2, 'Let me see.<|action_start|><|plugin|>{"name": "f", "parameters": {"a": 1}}'),
            ("llama4_json", parse_llama3_json, '<|python_tag|>{"name": "f", "parameters": {"a": 1}}'),
            ("qwen3_json", parse_hermes, 'Hm.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')):
        assert PARSERS[alias](text) == reader(text) and reader(text)[1] == [("f", '{"a": 1}')], alias


def test_granite_20b_fc_reads_a_json_object_after_each_marker():
    """granite-20b-functioncalling: `<function_call>` then `{"name": ..., "arguments": ...}` per call;
    what trails an object before the next marker is passed over (as in vLLM); the text before the
    first marker is the content. A call without `arguments`, or no JSON object, is no call."""
    text = ('I will look.<function_call> {"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '<function_call> {"name": "now", "arguments": {}} done')
    assert parse_granite_20b_fc(text) == ("I will look.", [("get_weather", '{"city": "Paris"}'), ("now", "{}")])
    assert PARSERS["granite-20b-fc"]('<function_call>{"name": "f", "arguments": {"a": [1, 2]}}') == \
        (None, [("f", '{"a": [1, 2]}')])
    for bad in ("no call here", '<function_call> {"name": "f"}', "<function_call> f(a=1)",
                '<function_call> {"name": "f", "arguments": {}} <function_call> {"arguments": {}}'):
        assert parse_granite_20b_fc(bad) == (bad, []), bad


PLAMO_REQUEST = ("<|plamo:begin_tool_request:plamo|><|plamo:begin_tool_name:plamo|>{name}<|plamo:end_tool_name:plamo|>"
                 "<|plamo:begin_tool_arguments:plamo|><|plamo:constrain|>json<|plamo:msg|>{args}"
                 "<|plamo:end_tool_arguments:plamo|><|plamo:end_tool_request:plamo|>")


def test_plamo3_reads_named_requests_with_json_arguments_in_their_section():
    section = ("<|plamo:begin_tool_requests:plamo|>" + PLAMO_REQUEST.format(name="get_weather", args='{"city": "Tokyo"}')
               + "\n" + PLAMO_REQUEST.format(name="now", args="") + "<|plamo:end_tool_requests:plamo|>")
    assert parse_plamo3("Let me check." + section) == ("Let me check.", [("get_weather", '{"city": "Tokyo"}'),
                                                                         ("now", "{}")])
    assert PARSERS["plamo3"](section) == (None, [("get_weather", '{"city": "Tokyo"}'), ("now", "{}")])
    for bad in ("no calls", "<|plamo:begin_tool_requests:plamo|>stray<|plamo:end_tool_requests:plamo|>",
                "<|plamo:begin_tool_requests:plamo|>" + PLAMO_REQUEST.format(name="f", args="[1]"),
                "<|plamo:begin_tool_requests:plamo|>" + PLAMO_REQUEST.format(name="", args="{}")):
        assert parse_plamo3(bad) == (bad, []), bad
    assert detect("{{- '<|plamo:begin_tool_requests:plamo|>' }}") == "plamo3"


def test_ling3_reads_glm47s_calls_typed_by_the_schema():
    text = "Adding.<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"properties": {"a": {"type": "integer"}}}}}]
    assert PARSERS["ling3"](text) == PARSERS["glm47"](text) == ("Adding.", [("add", '{"a": "1"}')])
    assert read_calls("ling3", text, tools) == ("Adding.", [("add", '{"a": 1}')])


M3 = "]<]minimax[>["


def test_minimax_m3_reads_nested_elements_shaped_by_the_tool_schema():
    """MiniMax-M3: every tag after its marker; an invoke's parameters are elements that may nest. The
    request's schema shapes them (as vLLM 0.32's reader does, checked on these texts): arrays of
    `<item>`s, scalars coerced, an empty element a `{}` where an object is wanted; without a schema,
    elements with children are objects, a repeated name a list, text stays text."""
    order = (f"Placing it.{M3}<tool_call>\n{M3}<invoke name=\"create_order\">\n{M3}<user_id>42{M3}</user_id>\n"
             f"{M3}<items>{M3}<item>{M3}<sku>book-001{M3}</sku>{M3}<qty>2{M3}</qty>{M3}</item>{M3}</items>\n"
             f"{M3}<gift>true{M3}</gift>{M3}<note>null{M3}</note>{M3}<meta>{M3}</meta>\n{M3}</invoke>\n"
             f"{M3}<invoke name='now'>{M3}</invoke>\n{M3}</tool_call>text after the calls is not read")
    tools = [{"type": "function", "function": {"name": "create_order", "parameters": {"type": "object", "properties": {
        "user_id": {"type": "integer"}, "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}}}}, "gift": {"type": "boolean"},
        "note": {"type": ["string", "null"]}, "meta": {"type": "object"}}}}}]
    shaped = {"user_id": 42, "items": [{"sku": "book-001", "qty": 2}], "gift": True, "note": None, "meta": {}}
    assert read_calls("minimax_m3", order, tools) == ("Placing it.", [("create_order", json.dumps(shaped)), ("now", "{}")])
    as_written = {"user_id": "42", "items": {"item": {"sku": "book-001", "qty": "2"}}, "gift": "true", "note": "null",
                  "meta": ""}
    assert PARSERS["minimax_m3"](order) == ("Placing it.", [("create_order", json.dumps(as_written)), ("now", "{}")])
    repeated = f"{M3}<tool_call>{M3}<invoke name=f>{M3}<tag>a{M3}</tag>{M3}<tag>b{M3}</tag>{M3}<x>1{M3}<y>2{M3}</y>{M3}</x>" \
        f"{M3}</invoke>{M3}</tool_call>"
    assert PARSERS["minimax_m3"](repeated) == (None, [("f", '{"tag": ["a", "b"], "x": {"y": "2", "$text": "1"}}')])
    for bad in ("no calls", f"{M3}<tool_call>{M3}<invoke name=\"f\">{M3}<a>1",  # left open
                f"{M3}<tool_call>{M3}<invoke name=\"f\">{M3}<a>1{M3}</b>{M3}</invoke>{M3}</tool_call>",
                f"{M3}<tool_call>stray{M3}<invoke name=\"f\">{M3}</invoke>"):
        assert PARSERS["minimax_m3"](bad) == (bad, []) and read_calls("minimax_m3", bad, tools) == (bad, []), bad
    assert detect("{{- ']<]minimax[>[<tool_call>' }}") == "minimax_m3"


def test_minimax_m1_reads_json_lines_outside_the_thinking():
    text = ('<think>Maybe <tool_calls>\n{"name": "no", "arguments": {}}\n</tool_calls> first.</think>\nChecking.\n'
            '<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\nnot json\n'
            '{"name": "now", "arguments": {}}\n</tool_calls>')
    assert parse_minimax(text) == (
        '<think>Maybe <tool_calls>\n{"name": "no", "arguments": {}}\n</tool_calls> first.</think>\nChecking.',
        [("get_weather", '{"city": "Paris", "days": 3}'), ("now", "{}")])
    assert parse_minimax('<tool_calls>\n{"name": "now", "arguments": {}}') == (None, [("now", "{}")])  # left open
    for bad in ("no calls", '<tool_calls>\n{"name": "f", "arguments": \n</tool_calls>',  # cut off: no call
                '<tool_calls>\n{"name": "f"}\n</tool_calls>', '<tool_calls>\n{"name": 3, "arguments": {}}\n</tool_calls>',
                '<think><tool_calls>\n{"name": "f", "arguments": {}}\n</tool_calls></think>'):
        assert parse_minimax(bad) == (bad, []), bad


def test_qwen2_5_coder_reads_json_in_tools_blocks():
    text = ('Let me check.\n<tools>\n[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
            '{"name": "now", "arguments": {}}]\n</tools>\nThen more.')
    assert parse_qwen2_5_coder(text) == ("Let me check.\n\nThen more.",
                                         [("get_weather", '{"city": "Paris", "days": 2}'), ("now", "{}")])
    lines = '<tools>\n{"name": "a", "arguments": {"x": [1]}},\n{"name": "b", "parameters": {"y": true}}\n</tools>'
    assert parse_qwen2_5_coder(lines) == (None, [("a", '{"x": [1]}'), ("b", '{"y": true}')])
    doubled = '<tools>{"name": "say", "arguments": {"text": "a \\\\"quote\\\\""}}'  # doubled escapes, left open
    assert parse_qwen2_5_coder(doubled) == (None, [("say", '{"text": "a \\"quote\\""}')])
    for bad in ("no calls", '<tools>\n{"name": "f", "arguments": {oops}\n</tools>', "<tools>[1, 2]</tools>",
                '<tools>{"arguments": {}}</tools>'):
        assert parse_qwen2_5_coder(bad) == (bad, []), bad


def test_hy_v3_reads_name_separator_and_pairs_typed_by_the_schema():
    text = ("Checking.<tool_calls><tool_call>get_weather<tool_sep><arg_key>city</arg_key>\n<arg_value>Paris"
            "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call><tool_call>now<tool_sep>"
            "</tool_call></tool_calls>")
    calls = [("get_weather", '{"city": "Paris", "days": "3"}'), ("now", "{}")]
    assert parse_hy_v3(text) == ("Checking.", calls)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    assert read_calls("hy_v3", text, tools)[1][0] == ("get_weather", '{"city": "Paris", "days": 3}')
    assert parse_hy_v3("<tool_calls><tool_call>now<tool_sep>") == (None, [("now", "{}")])  # left open
    for bad in ("no calls", "<tool_calls></tool_calls>", "<tool_calls><tool_call>now</tool_call></tool_calls>",
                "<tool_calls><tool_call><tool_sep></tool_call></tool_calls>",
                "<tool_calls><tool_call>f<tool_sep><arg_key>a</arg_key>x<arg_value>1</arg_value></tool_call></tool_calls>",
                "<tool_calls>stray<tool_call>now<tool_sep></tool_call></tool_calls>"):
        assert parse_hy_v3(bad) == (bad, []), bad


def test_hy_v4_reads_a_closed_section_its_tags_suffixed_or_not():
    def tag(name, suffix=":opensource"):
        return f"<{name}{suffix}>", f"</{name}{suffix}>"

    for suffix in (":opensource", ""):
        (calls, calls_end), (call, call_end), (key, key_end), (value, value_end) = (
            tag(name, suffix) for name in ("tool_calls", "tool_call", "arg_key", "arg_value"))
        pairs = f"{key}city{key_end}{value}北京{value_end}\n{key}days{key_end}{value}3{value_end}"
        text = f"Sure!{calls}{call}get_weather{pairs}{call_end}\n{call}get_current_date{call_end}{calls_end}"
        assert parse_hy_v4(text) == ("Sure!", [("get_weather", '{"city": "北京", "days": "3"}'),
                                               ("get_current_date", "{}")])
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "properties": {"days": {"type": "integer"}}}}}]
        assert read_calls("hy_v4", text, tools)[1][0] == ("get_weather", '{"city": "北京", "days": 3}')
        for bad in ("no calls", f"{calls}{call}now{call_end}",  # never closed
                    f"{calls}{call}get_weather{key}city{key_end}{calls_end}",  # a call never closed
                    f"{calls}{call}{call_end}{calls_end}", f"{calls}{calls_end}",
                    f"{calls}{call}f{key}a{key_end}{value}1{value_end}JUNK{call_end}{calls_end}",
                    f"{calls}{call}f{key}a{key_end}\n{value}1{value_end}{call_end}{calls_end}",  # nothing between
                    f"{calls_end}{call}now{call_end}{calls}"):
            assert parse_hy_v4(bad) == (bad, []), bad


def test_functiongemma_reads_gemmas_notation_with_escape_marks():
    e = "<escape>"
    text = (f"Sure.<start_function_call>call:get_weather{{city:{e}Paris, FR{e},days:3,metric:true,"
            f"where:{{lat:48.8}},tags:[{e}a{e}]}}<end_function_call><start_function_response>response:get_weather"
            f"{{temperature:26}}<end_function_response><start_function_call>call:now{{}}")  # the last left open
    assert parse_functiongemma(text) == ("Sure.", [
        ("get_weather", '{"city": "Paris, FR", "days": 3, "metric": true, "where": {"lat": 48.8}, "tags": ["a"]}'),
        ("now", "{}")])
    for bad in ("no calls", f"<start_function_call>call:f{{a:{e}never closed}}<end_function_call>",
                "<start_function_call>f{}<end_function_call>", "<start_function_call>call:f{a:[1, 2}<end_function_call>",
                "<start_function_call>call:f{just text}<end_function_call>",
                "<start_function_call>call:f{}<end_function_call><start_function_call>oops"):
        assert parse_functiongemma(bad) == (bad, []), bad


def test_dots_reads_invokes_typed_by_the_schema_and_json_calls_as_written():
    text = ('Searching.\n<dots_function_call>\n<invoke name="search">\n<parameter name="query"> weather in Shanghai '
            '</parameter>\n<parameter name="limit">5</parameter>\n</invoke>\n<invoke name=now>\n</invoke>\n'
            '</dots_function_call>\n<dots_function_call>{"name": "add", "arguments": {"a": "1"}}</dots_function_call>'
            "<dots_function_call>not json</dots_function_call>")
    calls = [("search", '{"query": "weather in Shanghai", "limit": "5"}'), ("now", "{}"), ("add", '{"a": "1"}')]
    assert parse_dots(text) == ("Searching.", calls)
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "properties": {"limit": {"type": "integer"}}}}},
             {"type": "function", "function": {"name": "add", "parameters": {"properties": {"a": {"type": "integer"}}}}}]
    assert read_calls("dots", text, tools)[1] == [("search", '{"query": "weather in Shanghai", "limit": 5}'),
                                                  ("now", "{}"), ("add", '{"a": "1"}')]  # JSON: as written
    for bad in ("no calls", "<dots_function_call>not json</dots_function_call>",
                '<dots_function_call>\n<invoke name="f">', '<dots_function_call>["f"]</dots_function_call>',
                '<dots_function_call>{"name": "f", "arguments": [1]}</dots_function_call>'):
        assert parse_dots(bad) == (bad, []) and read_calls("dots", bad, tools) == (bad, []), bad


def test_gigachat3_reads_one_call_after_either_header():
    call = '{"name": "manage_memory", "arguments": {"action": "create", "content": {"short": true}}}'
    read = [("manage_memory", '{"action": "create", "content": {"short": true}}')]
    assert parse_gigachat3(f"I'll check.<|message_sep|>\n\nfunction call<|role_sep|>\n{call}</s>") == (
        "I'll check.", read)
    assert parse_gigachat3(f"I'll check.<|function_call|>{call}") == ("I'll check.", read)
    assert parse_gigachat3('<|function_call|>{"name": "say", "arguments": {"text": "two\nlines"}}') == (
        None, [("say", '{"text": "two\\nlines"}')])  # a raw newline in a string read
    for bad in ("How can I help?", '<|function_call|>{"name": "f", "arguments": {}', "<|function_call|>oops",
                '<|function_call|>{"name": "f", "arguments": "{}"}', '<|function_call|>{"name": "f"}',
                '<|function_call|>{"name": "f", "arguments": {}} and more'):
        assert parse_gigachat3(bad) == (bad, []), bad


@pytest.mark.parametrize("template, expected", [
    ("{{ '<seed:tool_call>' }}\n<function={{ name }}>\n<parameter={{ key }}>", "seed_oss"),
    ("{{ '<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke' }}", "step3"),
    ("In addition to plain text responses, you can chose to call ... functools[{...}]", "phi4_mini_json"),
    ("<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>", "glm45"),
    ('<minimax:tool_call>\n<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1</parameter>',
     "minimax_m2"),
    ("{% for tool in tools %}<tools>{{ tool }}</tools>{% endfor %} <tool_call>", "hermes"),
    ("<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>\n", "qwen3_coder"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name']"
     " + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}",
     "deepseek_v3"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>'"
     " + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}", "deepseek_v31"),
    ("{{ '<|tool_calls_section_begin|>' }}", "kimi_k2"),
    ("{{ '<|tool_call|>' + tool_calls | tojson }}", "granite"),
    ("{{ '[AVAILABLE_TOOLS]' }} ... {{ '[TOOL_CALLS]' }}", "mistral"),
    ("<|python_start|>{{ call }}<|python_end|>", "pythonic"),
    ("respond in the format [func_name1(params_name1=params_value1)]", "pythonic"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ('{{- "<|action_start|><|plugin|>\\n" }}{{- \'{"name": "\' + function.name }}', "internlm2"),
    ("<|bom|><|system|> {{ '<tool_definitions>' }} ... {{ '<tool_calls>' + calls | tojson + '</tool_calls>' }}", "jamba"),
    ('格式化为<tool_calls>[{"name": "func_name1", "arguments": {"argument1": "value1"}},...]</tool_calls>', "hunyuan_a13b"),
    ("{{ '<longcat_tool_call>' + call | tojson + '</longcat_tool_call>' }}", "longcat"),
    ("respond with a pythonic function call wrapped in <function_calls></function_calls> XML tags", "olmo3"),
    ("{{ '<tool_call>' + call | tojson + '</tool_call>' }} {{ '<tool_calls>' }}", "hermes"),  # Hermes' stays Hermes'
    ("{{- '<|start|>assistant to=' + 'functions.' + call.name + '<|channel|>commentary json<|message|>' }}", "openai"),
    ("{{- '<|start_of_role|>assistant<|end_of_role|>' }}{{- '<tool_call>\n' + call | tojson + '\n</tool_call>' }}",
     "granite4"),
    ('{{- "List of tools: <|tool_list_start|>[" }}{{ tools | tojson }}{{ "]<|tool_list_end|>" }}', "lfm2"),
    ("{{- '<|tools_prefix|>' + calls | tojson + '<|tools_suffix|>' }}", "apertus"),
    ("<|START_RESPONSE|>{{ content }}<|END_RESPONSE|> <|START_ACTION|>{{ calls }}<|END_ACTION|>", "cohere_command3"),
    ("<|START_TEXT|>{{ content }}<|END_TEXT|> <|START_ACTION|>{{ calls }}<|END_ACTION|>", "cohere_command4"),
    ("{{- '<｜DSML｜function_calls>' }}{{- '<｜DSML｜invoke name=\"' + name + '\">' }}", "deepseek_v32"),
    ("{{- '<｜DSML｜tool_calls>' }}{{- '<｜DSML｜invoke name=\"' + name + '\">' }}", "deepseek_v4"),
    ("{{- '<|tool_call>call:' + name + '{' }}{{- key + ':<|\"|>' + value + '<|\"|>' }}{{- '}<tool_call|>' }}", "gemma4"),
    ("{{- '<|open|>tools<|sep|>' }}{{- '<|open|>call tool=\"' + name + '\"<|sep|>' }}", "kimi_k3"),
    ("{{- '<start_function_call>call:' + name + '{' }}{{- key + ':<escape>' + value + '<escape>' }}", "functiongemma"),
    ("{{- '<dots_function_call>\n<invoke name=\"' + name + '\">' }}", "dots"),
    ("{{- '<tool_calls><tool_call>' + name + '<tool_sep>' }}{{- '<arg_key>' + key + '</arg_key>' }}", "hy_v3"),
    ('{{- "<function_call> " + call | tojson }}', "granite-20b-fc"),
    ("{{ messages }}", None), (None, None)])
def test_a_templates_format_is_found_by_its_markers(template, expected):
    assert detect(template) == expected
    assert expected is None or expected in PARSERS



def test_the_parser_is_the_endpoints_and_said_not_applied_to_an_environment(prepared, capsys):
    from transformers import AutoTokenizer

    from rlhf_core.rl.agents import AgentRollouts, make_agent_rollouts
    from rlhf_core.rl.served_agents import ServedRollouts

    tokenizer = AutoTokenizer.from_pretrained(prepared["base"])  # the built-in template shows no tool format
    env = make_agent_rollouts("calculator", tokenizer, 64, 8, 2, 5.0, {}, tool_call_parser="pythonic")
    assert isinstance(env, AgentRollouts)
    assert "--train.agent_tool_call_parser pythonic needs an agent that drives the policy's endpoint" in \
        capsys.readouterr().err
    for parser, fmt, why in (("auto", "hermes", "; the chat template shows none of the known ones"),
                             ("mistral", "mistral", "")):
        served = make_agent_rollouts("calculator-http", tokenizer, 64, 8, 0, 5.0, {}, tool_call_parser=parser)
        try:
            assert isinstance(served, ServedRollouts) and served.server.tool_call_format == fmt
            assert f"tool calls read in the {fmt} format{why})" in capsys.readouterr().err
        finally:
            served.server.close()


def test_the_flag_offers_every_parser():
    from typing import get_args

    from rlhf_core.rl_config import TrainSection

    choices = get_args(TrainSection.model_fields["agent_tool_call_parser"].annotation)
    assert set(choices) == {"auto", "hf", *PARSERS}


def test_the_formats_read_with_the_requests_tools_get_them_through_read_calls():
    """minicpm5, k2_horizon, inkling, muse_glimmer, poolside_v1: `read_calls` hands each the request's
    tools its way (schemas; k2_horizon's refusal of a tool the request does not declare; Muse's doubled
    name), and `detect` finds each by the marker its templates write."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string"}}}}}]
    minicpm = '<function name="add"><param name="a">7</param><param name="b">7</param></function>'
    assert read_calls("minicpm5", minicpm, tools) == (None, [("add", '{"a": 7, "b": "7"}')])
    k2 = "<ifm|tool_calls><ifm|tool_call>add<ifm|arg_key>a</ifm|arg_key><ifm|arg_value>7</ifm|arg_value>" \
         "</ifm|tool_call></ifm|tool_calls>"
    assert read_calls("k2_horizon", k2, tools) == (None, [("add", '{"a": 7}')])
    assert read_calls("k2_horizon", k2, None) == (None, [("add", '{"a": "7"}')])  # no schema: as written
    other = [{"type": "function", "function": {"name": "mul"}}]
    assert read_calls("k2_horizon", k2, other) == (k2, [])  # a tool the request does not declare
    muse = ('<|start|>assistant to=add.add<|message|><atem:function_calls>\n<atem:invoke name="add.add">\n'
            '<atem:parameter name="a">7</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eom|>')
    assert read_calls("muse_glimmer", muse, tools) == (None, [("add", '{"a": 7}')])
    assert read_calls("muse_glimmer", muse, None) == (None, [("add.add", '{"a": 7}')])
    laguna = "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>7</arg_value>\n<arg_key>b</arg_key>\n" \
             "<arg_value>7</arg_value>\n</tool_call>"
    assert read_calls("poolside_v1", laguna, tools) == (None, [("add", '{"a": 7, "b": "7"}')])
    inkling = '<|content_invoke_tool_json|>{"name": "add", "args": {"a": "7", "b": 7}}<|end_message|>'
    assert read_calls("inkling", inkling, tools)[1] == [("add", '{"a": 7, "b": "7"}')]
    for fmt, marker in (("minicpm5", '<param name="'), ("k2_horizon", "<ifm|tool_calls>"),
                        ("inkling", "<|content_invoke_tool_json|>"), ("muse_glimmer", "<atem:function_calls>"),
                        ("poolside_v1", "<available_tools>{{ tools }}</available_tools><tool_call>")):
        assert detect("{{- '" + marker + "' }}<arg_key><tool_sep>") == fmt, fmt


def test_minimax_m3_types_values_by_vllms_schema_type_names():
    """vLLM 0.32's type names (`float32`, `varchar`...) and its container rule read raw spellings: a
    schema allowing `str` (not `string`) still makes an empty element the container (checked against
    vLLM's reader); a `type` that is no name or list types nothing."""
    def read(schema, value):
        text = f"{M3}<tool_call>{M3}<invoke name=\"f\">{M3}<a>{value}{M3}</a>{M3}</invoke>{M3}</tool_call>"
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": schema}}}}]
        return json.loads(read_calls("minimax_m3", text, tools)[1][0][1])["a"]

    assert json.dumps(read({"type": "float32"}, "1.0")) == "1" and read({"type": "varchar"}, "5") == "5"
    assert read({"type": ["object", "str"]}, "") == {} and read({"type": {"integer": 1}}, "5") == "5"
