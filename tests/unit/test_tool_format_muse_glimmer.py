"""MuseGlimmer's tool calls (`rl/tool_formats/muse_glimmer.py`): ATEM invokes in messages to a tool,
read as vLLM 0.32's muse_glimmer reads a whole completion (checked against it on these texts)."""

from rlhf_core.rl.tool_formats.muse_glimmer import parse_muse_glimmer, read_muse_glimmer

NEXT = "<|start|>assistant"


def invoke(name: str, **parameters: str) -> str:
    written = "".join(f'<atem:parameter name="{key}">{value}</atem:parameter>\n' for key, value in parameters.items())
    return f'<atem:invoke name="{name}">\n{written}</atem:invoke>\n'


def calls(*invokes: str) -> str:
    return "<atem:function_calls>\n" + "".join(invokes) + "</atem:function_calls>"


def test_calls_in_messages_to_tools_values_json_where_they_read_as_json():
    text = (" to=self<|message|>I should look it up.<|eom|>"
            f"{NEXT} to=weather.get<|message|>"
            + calls(invoke("weather.get", city="Paris", days="3", opts='{"unit": "C"}', quoted='"42"',
                           note=" two\nlines ", cut="[1"))
            + f"<|eom|>{NEXT} to=math.add<|message|>" + calls(invoke("math.add", a="1.5", b="true"), invoke("now"))
            + f"<|eom|>{NEXT} to=user<|message|>Checking both.<|eot|>")
    assert parse_muse_glimmer(text) == ("Checking both.", [
        ("weather.get", '{"city": "Paris", "days": 3, "opts": {"unit": "C"}, "quoted": "42", '
                        '"note": " two\\nlines ", "cut": "[1"}'),
        ("math.add", '{"a": 1.5, "b": true}'), ("now", "{}")])


def test_invokes_in_the_reasoning_or_the_answer_are_no_calls():
    for text in (" to=self<|message|>Maybe " + calls(invoke("f", a="1")) + f"<|eom|>{NEXT} to=user<|message|>No.<|eot|>",
                 " to=user<|message|>Write " + calls(invoke("f")) + " to call f.<|eot|>",
                 "<|message|>" + calls(invoke("f"))):  # a message to no recipient is content
        assert parse_muse_glimmer(text) == (text, []), text


def test_a_reasoning_message_left_open_ends_at_the_next_header():
    text = " to=self<|message|>thinking, cut off" + f"{NEXT} to=f<|message|>" + calls(invoke("f", a="x"))
    assert parse_muse_glimmer(text) == (None, [("f", '{"a": "x"}')])


def test_a_doubled_name_is_the_requests_tool_without_a_namespace():
    text = f"{NEXT} to=get_weather<|message|>" + calls(invoke("get_weather.get_weather", city="Oslo"))
    assert read_muse_glimmer(text, {"get_weather"}) == (None, [("get_weather", '{"city": "Oslo"}')])
    assert parse_muse_glimmer(text) == (None, [("get_weather.get_weather", '{"city": "Oslo"}')])
    assert read_muse_glimmer(text, {"get_weather.get_weather", "get_weather"})[1][0][0] == "get_weather.get_weather"
    other = f"{NEXT} to=weather.get<|message|>" + calls(invoke("weather.get"))
    assert read_muse_glimmer(other, {"calendar.get", "get"})[1] == [("weather.get", "{}")]  # passed on as written


def test_without_any_header_the_invokes_are_read_and_the_whole_text_is_content():
    text = "Let me check. " + calls(invoke("f", a="1"))
    assert parse_muse_glimmer(text) == (text, [("f", '{"a": 1}')])


def test_no_complete_named_invoke_leaves_the_whole_text_content():
    for bad in ("no calls", f"{NEXT} to=f<|message|><atem:function_calls>\n",
                f"{NEXT} to=f<|message|>" + '<atem:invoke name="f">\n<atem:parameter name="a">1',  # left open
                f"{NEXT} to=f<|message|><atem:invoke>\n</atem:invoke>",  # no name
                f"{NEXT} to=f<|message|>" + invoke("f", a="[" * 100_000)):  # nested too deep to read
        assert parse_muse_glimmer(bad) == (bad, []), bad[:80]
