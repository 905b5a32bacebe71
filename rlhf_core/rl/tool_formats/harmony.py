"""gpt-oss's harmony format (pure): the completion a run of messages, each a header and a body;
a message to a function is a call.

- `openai` (gpt-oss's harmony format, from the text decoded with its special tokens): each message
  to a function, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGUMENTS<|call|>`
  (after `<|start|>assistant` but the first), is a call; the final channel's text and the commentary
  channel's without a recipient are the content (not the analysis channel's).
"""

from __future__ import annotations

import json
import re

from rlhf_core.rl.tool_formats.common import Calls, _NotACall

HARMONY_START, HARMONY_MESSAGE, HARMONY_CHANNEL, HARMONY_CONSTRAIN = ("<|start|>", "<|message|>", "<|channel|>",
                                                                      "<|constrain|>")
_HARMONY_STOP = re.compile(r"<\|(?:end|call|return)\|>")
_HARMONY_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_HARMONY_BUILT_IN = frozenset({"python", "browser", "container"})  # tools that are not the request's functions
Header = tuple[str, str | None, str | None, str | None]  # role, channel, recipient, content type


def _harmony_header(header: str, role: str | None) -> Header:
    """A harmony message header as openai_harmony reads it: `<|channel|>CHANNEL` anywhere, then
    (unless `role` is known) the role, a recipient (`to=NAME`) and a content type (`json`,
    `<|constrain|>json`); _NotACall for one it refuses."""
    channel = None
    if HARMONY_CHANNEL in header:
        before, _, after = header.partition(HARMONY_CHANNEL)
        channel = re.match(r"[^\s<]*", after)[0]
        if not channel:
            raise _NotACall(header)
        header = before + after[len(channel):]
    parts = re.findall(r"[^ \t\n\r\f]+", header.replace(HARMONY_CONSTRAIN, " " + HARMONY_CONSTRAIN))
    if role is None:
        if parts and parts[0] in _HARMONY_ROLES:
            role = parts[0]
        elif len(parts) > 1 or (parts and parts[0].startswith("to=")):
            role = "tool"  # an unknown role before a recipient: a tool's message
            parts.pop(0)
        else:
            raise _NotACall(header)
    if parts and parts[0] == role:
        parts.pop(0)
    recipient = content_type = None
    if parts:
        last = parts.pop()
        if last.startswith("to=") or not parts:
            recipient = last.removeprefix("to=")
        else:
            content_type, recipient = last, parts.pop().removeprefix("to=")
    if parts:
        raise _NotACall(header)
    if recipient is not None:  # vLLM cuts a constrained format that older harmony left in it
        recipient = recipient.split(HARMONY_CONSTRAIN)[0].rstrip() or None
    return role, channel, recipient, content_type


def _harmony_messages(text: str) -> tuple[list[tuple[Header, str]], str]:
    """(each message's header and text, the raw text of a header the completion ends in) of a
    completion whose first message's role, assistant, its prompt wrote. A message ends at
    `<|end|>`, `<|call|>`, `<|return|>` or the end; the text from there to the next `<|start|>` is
    passed over, and so is a message whose header is refused (its header's text kept with the
    unfinished one, as vLLM's token buffer keeps it)."""
    messages, unread, at, head, role = [], "", 0, 0, "assistant"
    while True:
        mark = text.find(HARMONY_MESSAGE, head)
        if mark < 0:
            return messages, unread + text[at:]
        body = mark + len(HARMONY_MESSAGE)
        try:
            header = _harmony_header(text[head:mark], role)
        except _NotACall:
            unread += text[at:mark]
        else:
            stop = _HARMONY_STOP.search(text, body)
            messages.append((header, text[body: stop.start() if stop else len(text)]))
            if stop is None:
                return messages, ""
            unread, body = "", stop.end()
        at = text.find(HARMONY_START, body)
        if at < 0:
            return messages, ""
        head, role = at + len(HARMONY_START), None


def _harmony_function(recipient: str) -> bool:
    """Whether a recipient is one of the request's functions (`functions.NAME`, or a bare name
    that is not a built-in tool's), as vLLM tells."""
    if recipient.startswith("<|") or recipient == "assistant":
        return False
    if recipient.startswith("functions."):
        return len(recipient) > len("functions.")
    return recipient.split(".", 1)[0] not in _HARMONY_BUILT_IN


def _harmony_arguments(text: str, content_type: str | None) -> str:
    if content_type is not None and "json" not in content_type:
        return text
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text  # vLLM passes arguments that are not JSON on as written


def parse_openai(text: str) -> Calls:
    """gpt-oss's harmony format, read from the completion decoded with its special tokens. vLLM
    reads the token ids with openai_harmony's StreamableParser (its prompt ends `<|start|>assistant`);
    this reads the same messages from their text: a message to a function (`<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>ARGUMENTS<|call|>`) is a call (arguments as JSON
    when they read as JSON and the content type is JSON or none, else as written); the final
    channel's text and the commentary channel's without a recipient are the content, one line
    apart (the analysis channel is reasoning, not content), and so is the raw text of a header the
    completion ends in, as vLLM recovers it."""
    messages, unfinished = _harmony_messages(text)
    calls, content = [], []
    for (role, channel, recipient, content_type), body in messages:
        if role != "assistant":
            continue
        if recipient is not None and _harmony_function(recipient):
            calls.append((recipient.removeprefix("functions."), _harmony_arguments(body, content_type)))
        elif body and (channel == "final" or (channel == "commentary" and recipient is None)):
            content.append(body)
    content += [unfinished] if unfinished else []
    return ("\n".join(content).strip() or None, calls) if calls else (text, [])
