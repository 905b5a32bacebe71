"""MuseGlimmer's tool calls (pure): ATEM invokes in messages addressed to a tool.

     to=self<|message|>I should look it up.<|eom|><|start|>assistant to=weather.get<|message|>
    <atem:function_calls>
    <atem:invoke name="weather.get">
    <atem:parameter name="city">Paris</atem:parameter>
    <atem:parameter name="days">3</atem:parameter>
    </atem:invoke>
    </atem:function_calls><|eom|><|start|>assistant to=user<|message|>Checking.<|eot|>

- `muse_glimmer` (MuseGlimmer): the completion a run of messages, each a header `[<|start|>assistant]
  [to=RECIPIENT]<|message|>` and a body up to `<|eom|>`, `<|eot|>` or the next header. Each
  `<atem:invoke name="NAME">...</atem:invoke>` in a message to a tool (a recipient other than
  `self`, the reasoning, and `user`) is a call, its `<atem:parameter name="KEY">VALUE
  </atem:parameter>`s the arguments: a value is JSON where it reads as JSON (`3`, `true`, `[1]`,
  `"3"`), else the text as written; the `<atem:function_calls>` wrapper and text around the
  parameters are not required or read. Where the completion has no header at all, its invokes
  are read wherever they are. The content is the text of the messages to `user` or to no
  recipient, joined (text outside any message, before the first header or after a message's end,
  is neither); without any header, the whole text, the calls' markup too, as vLLM gives it.

As vLLM 0.32 reads them: an invoke without a name is passed over; a name the request's tools
do not have, written `X.X` where they have `X` (the template's recipient for a tool without a
namespace), is read as `X` (`read_muse_glimmer`, given the request's tool names); a value nested
too deep to read makes the whole text content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection

from rlhf_core.rl.tool_formats.common import Calls

MUSE_CALLS, MUSE_INVOKE = "<atem:function_calls>", "<atem:invoke"
MUSE_START, MUSE_MESSAGE, MUSE_EOM, MUSE_EOT = "<|start|>", "<|message|>", "<|eom|>", "<|eot|>"
REASONING, USER = "self", "user"  # the recipients whose messages are no calls
# a header: `<|start|>assistant` (not before the first message, which the prompt began), spaces
# but no newline, `to=` and the recipient (ASCII letters, digits, `_.-`), then `<|message|>`
_HEADER = re.compile(rf"(?:{re.escape(MUSE_START)}\s*assistant)?[^\S\n]*(?:to=([A-Za-z0-9_.\-]+))?"
                     + re.escape(MUSE_MESSAGE))
_MESSAGE_END = re.compile(re.escape(MUSE_EOM) + "|" + re.escape(MUSE_EOT))
_INVOKE = re.compile(re.escape(MUSE_INVOKE) + r"\b.*?</atem:invoke>", re.DOTALL)
_INVOKE_NAME = re.compile(re.escape(MUSE_INVOKE) + r'\b[^>]*?\bname="([^"]+)"')
_PARAMETER = re.compile(r'<atem:parameter\b[^>]*?\bname="([^"]+)"[^>]*?>(.*?)</atem:parameter>', re.DOTALL)


def _messages(text: str) -> list[tuple[str | None, str]]:
    """(recipient or None, body) of each message: a body ends at `<|eom|>`/`<|eot|>` or where the
    next header starts, and never holds `<|start|>` (a header not yet whole); the text between a
    message's end and the next header is no message's."""
    out, at = [], 0
    while at < len(text):
        header = _HEADER.search(text, at)
        if header is None:
            break
        end = _MESSAGE_END.search(text, header.end())
        following = _HEADER.search(text, header.end())
        stop = end.start() if end else len(text)
        if following is not None and following.start() < stop:
            stop = at = following.start()
        else:
            at = end.end() if end else len(text)
        out.append((header[1], text[header.end():stop].split(MUSE_START, 1)[0]))
    return out


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _name(written: str, names: Collection[str]) -> str:
    """An invoke's name as the request's tools name it: `X.X` is `X` where only `X` is theirs."""
    head, dot, tail = written.partition(".")
    if names and written not in names and dot and head == tail and head in names:
        return head
    return written


def _calls(scope: str, names: Collection[str]) -> list[tuple[str, str]]:
    calls = []
    for invoke in _INVOKE.findall(scope):
        name = _INVOKE_NAME.search(invoke)
        if name is None:
            continue
        arguments = {key: _value(value) for key, value in _PARAMETER.findall(invoke)}
        calls.append((_name(name[1], names), json.dumps(arguments, ensure_ascii=False)))
    return calls


def read_muse_glimmer(text: str, names: Collection[str] = ()) -> Calls:
    """`text`'s calls; `names`: the request's tool names (an `X.X` written for `X` is read as `X`)."""
    if MUSE_CALLS not in text and MUSE_INVOKE not in text:
        return text, []
    read = _messages(text)
    framed = MUSE_MESSAGE in text  # any header at all
    to_tools = [body for recipient, body in read if recipient not in (None, REASONING, USER)]
    scope = "\n".join(to_tools) if to_tools else "" if framed else text
    try:
        calls = _calls(scope, set(names))
    except RecursionError:
        return text, []
    if not calls:
        return text, []
    content = "".join(body for recipient, body in read if recipient in (None, USER))
    if not content and not framed:
        content = text
    return content.strip() or None, calls


def parse_muse_glimmer(text: str) -> Calls:
    return read_muse_glimmer(text)
