"""Tool calls in a tokenizer's `response_template` format (`rl/tool_formats/response_template.py`),
read as vLLM 0.32's `hf` parser reads a whole completion after its prompt (checked against vLLM's
ResponseTemplateParser on these texts); the templates vLLM refuses; the template saved with a tokenizer."""

import pytest

from rlhf_core.rl.tool_formats.response_template import (
    check_response_template,
    read_response_template,
    response_template_of,
)

QWEN3 = {  # Hermes' <tool_call> JSON, as Qwen3 writes it
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "thinking": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"},
    },
}
QWEN3_5 = {  # Qwen3.5's XML calls: the name in the opening, text values
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "thinking": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {"open_pattern": r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
                       "close_pattern": r"</function>\s*</tool_call>", "repeats": True, "content": "xml-inline",
                       "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>"},
                       "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"},
    },
}
GEMMA4 = {  # Gemma 4's call:NAME{...} in its own notation; every field opened, so content is what is left
    "defaults": {"role": "assistant"},
    "start_anchor": ["<|turn>model\n", "<tool_response|>"],
    "fields": {
        "thinking": {"open": "<|channel>thought\n", "close": "<channel|>"},
        "tool_calls": {"open_pattern": r"<\|tool_call>call:(?P<name>\w+)", "close": "<tool_call|>", "repeats": True,
                       "content": "json", "content_args": {"unquoted_keys": True, "string_delims": [['<|"|>', '<|"|>']]},
                       "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}},
    },
}
PROMPT = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": ["integer", "string"]}, "note": {"type": "string"}}}}}]


def read(text, template=QWEN3, prefix=PROMPT, tools=None):
    return read_response_template(text, template, prefix, tools)


def test_a_call_after_content_and_two_calls_in_a_row():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": "é"}}\n</tool_call>'
    assert read(text) == ("Let me add.", [("add", '{"a": 3, "b": "é"}')])
    two = ('<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>\n'
           '<tool_call>{"name": "neg", "arguments": "{\\"x\\": 1}"}</tool_call>\nDone.<|im_end|>')
    assert read(two) == ("\nDone.", [("add", '{"a": 3}'), ("neg", '{"x": 1}')])
    assert read("Just text.\n<|im_end|>") == ("Just text.", []) and read("") == (None, [])


def test_a_bad_call_is_dropped_with_its_text_and_the_others_kept():
    text = ('Trying.<tool_call>{oops}</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>'
            '<tool_call>{"arguments": {"a": 1}}</tool_call><tool_call>{"name": "add"}</tool_call>')
    assert read(text) == ("Trying.", [("add", '{"a": 3}')])


def test_text_values_are_typed_by_the_requests_tool_schema():
    text = '<tool_call>{"name": "add", "arguments": {"a": "7", "b": "x", "note": "7", "c": "7"}}</tool_call>'
    assert read(text, tools=TOOLS) == (None, [("add", '{"a": 7, "b": "x", "note": "7", "c": "7"}')])
    assert read(text) == (None, [("add", '{"a": "7", "b": "x", "note": "7", "c": "7"}')])


def test_a_think_prefill_in_the_prompt_opens_the_thinking_region():
    text = 'Add them.</think>\n\nAdding.<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>'
    assert read(text, prefix=PROMPT + "<think>\n") == ("Add them.\n\nAdding.", [("add", '{"a": 3}')])
    # without the prompt the same text has no thinking opened: its close is content
    assert read(text, prefix="") == ("Add them.</think>\n\nAdding.", [("add", '{"a": 3}')])


def test_a_call_left_open_at_the_end_is_read():
    assert read('Adding. <tool_call>{"name": "add", "arguments": {"a": 3}}') == ("Adding.", [("add", '{"a": 3}')])


def test_a_call_is_one_whose_region_closes_in_the_completion():
    call = '<tool_call>{"name": "add", "arguments": {"a": 3}}'
    assert read("</tool_call>Done.", prefix=PROMPT + call) == ("Done.", [("add", '{"a": 3}')])
    # a literal close at the prompt's end is taken there: that call is the prompt's
    assert read("Done.", prefix=PROMPT + call + "</tool_call>") == ("Done.", [])
    # a pattern close at the prompt's end waits for more text, so the completion's first text closes it
    xml = "<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n</function>\n</tool_call>"
    assert read("Done.", QWEN3_5, PROMPT + xml) == ("Done.", [("add", '{"a": "3"}')])
    assert read("", QWEN3_5, PROMPT + xml) == (None, [])


def test_qwen3_5_xml_calls():
    text = ("I'll add.\n<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n<parameter=note>\ntwo\nlines\n"
            "</parameter>\n</function>\n</tool_call>")
    assert read(text, QWEN3_5, tools=TOOLS) == ("I'll add.", [("add", '{"a": 3, "note": "two\\nlines"}')])
    # a parameter never closed is not read; a call never closed is
    assert read("<tool_call>\n<function=add>\n<parameter=a>3</parameter>\n<parameter=b>4\n</function>\n</tool_call>",
                QWEN3_5) == (None, [("add", '{"a": "3"}')])
    assert read("<tool_call><function=add><parameter=a>3</parameter>", QWEN3_5) == (None, [("add", '{"a": "3"}')])


def test_gemma4_calls_and_content_outside_every_region():
    prompt = "<bos><|turn>user\nWhat is 3 + 4?<turn|>\n<|turn>model\n"
    text = ('<|channel>thought\nAdd.<channel|>Sure.<|tool_call>call:add{a:3,note:<|"|>hi, you<|"|>}<tool_call|>'
            "<|tool_call>call:add{a:}<tool_call|>")
    assert read(text, GEMMA4, prompt, TOOLS) == ("Add.Sure.", [("add", '{"a": 3, "note": "hi, you"}')])


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t["fields"].update(answer={"open": "<a>", "close": "</a>"}), "unsupported fields ['answer']"),
    (lambda t: t["defaults"].update(content=""), "unsupported defaults ['content']"),
    (lambda t: t["fields"].pop("tool_calls"), "no tool_calls field"),
    (lambda t: t["fields"]["thinking"].update(content="json"), "field 'thinking' is not plain text"),
    (lambda t: t.pop("start_anchor"), "'start_anchor' or 'start_anchor_pattern'"),
    (lambda t: t["fields"]["tool_calls"].update(content="yaml"), "unknown content parser 'yaml'"),
])
def test_templates_vllm_cannot_serve_tool_calls_from(change, message):
    template = {**QWEN3, "defaults": dict(QWEN3["defaults"]), "fields": {k: dict(v) for k, v in QWEN3["fields"].items()}}
    change(template)
    with pytest.raises(ValueError, match="response_template") as raised:
        check_response_template(template)
    assert message in str(raised.value)
    with pytest.raises(ValueError):
        read("x", template)


def test_the_templates_vllm_serves_pass_and_a_non_dict_does_not():
    for template in (QWEN3, QWEN3_5, GEMMA4):
        check_response_template(template)
    with pytest.raises(ValueError, match="must be a dict"):
        check_response_template(["not", "a", "template"])


def test_the_template_saved_with_a_tokenizer_is_read_back(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", response_template=QWEN3).save_pretrained(
        tmp_path)
    assert response_template_of(AutoTokenizer.from_pretrained(tmp_path)) == QWEN3
    assert response_template_of(PreTrainedTokenizerFast(tokenizer_object=backend)) is None

    class Stored:  # a tokenizer that keeps it only among its init_kwargs
        init_kwargs = {"response_template": QWEN3}
    assert response_template_of(Stored()) == QWEN3
