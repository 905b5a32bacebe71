"""Cohere Command's format (pure): the completion a run of thinking, action and answer stretches,
each action a JSON list of calls.

- `cohere_command3` (Command A) and `cohere_command4` (Command A Reasoning, Vision): in
  `<|START_ACTION|>...<|END_ACTION|>`, a JSON list of `{"tool_call_id", "tool_name", "parameters"}`;
  the content is the answer (outside the thinking, in `<|START_RESPONSE|>`, or cmd4's `<|START_TEXT|>`),
  citations unwrapped.
"""

from __future__ import annotations

import json
import re

from rlhf_core.rl.tool_formats.common import Calls, _NotACall

COHERE_THINKING, COHERE_THINKING_END = "<|START_THINKING|>", "<|END_THINKING|>"
COHERE_ACTION, COHERE_ACTION_END = "<|START_ACTION|>", "<|END_ACTION|>"
COHERE_RESPONSE, COHERE_RESPONSE_END = "<|START_RESPONSE|>", "<|END_RESPONSE|>"
COHERE_TEXT, COHERE_TEXT_END = "<|START_TEXT|>", "<|END_TEXT|>"
_CITATION = re.compile(r"<co(?::[^>]*)?>(.*?)</co:[^>]*>", re.DOTALL)


def _stretches(text: str, opens: dict[str, str], first: str) -> list[tuple[str, str]]:
    """(kind, text) of each stretch of `text` between its markers, `opens` naming the kind of
    stretch each marker opens (`first` the kind of the text before any)."""
    stretches, kind, at = [], first, 0
    for marker in re.finditer("|".join(map(re.escape, opens)), text):
        stretches.append((kind, text[at:marker.start()]))
        kind, at = opens[marker[0]], marker.end()
    return stretches + [(kind, text[at:])]


def _cohere_call(item) -> tuple[str, str]:
    if not isinstance(item, dict) or not all(isinstance(item.get(k), str) for k in ("tool_call_id", "tool_name")):
        raise _NotACall(item)
    parameters = item.get("parameters", {})
    if not isinstance(parameters, dict):
        raise _NotACall(item)
    return item["tool_name"], json.dumps(parameters, ensure_ascii=False)


def _cohere_command(text: str, answer: tuple[str, ...], answer_end: tuple[str, ...], first: str) -> Calls:
    """Cohere Command's calls and answer as cohere_melody's filter reads them (vLLM's parser): each
    `<|START_ACTION|>` section a JSON list of `{"tool_call_id": str, "tool_name": str, "parameters":
    {...}}` (or one such object); the content is the answer's text (`first` being the kind of the
    text before any marker), citations `<co>SPAN</co: ...>` unwrapped, not the thinking nor the text
    after an action or answer ends. A section that is not such JSON is malformed (melody's streaming
    reader takes what it finds in it); parameters left out are `{}` (melody gives no text)."""
    if COHERE_ACTION not in text:
        return text, []
    opens = {COHERE_THINKING: "thinking", COHERE_THINKING_END: "answer", COHERE_ACTION: "action",
             COHERE_ACTION_END: "after", **dict.fromkeys(answer, "answer"), **dict.fromkeys(answer_end, "after")}
    stretches, calls = _stretches(text, opens, first), []
    try:
        for kind, body in stretches:
            if kind == "action":
                listed = json.loads(body)
                calls += [_cohere_call(item) for item in (listed if isinstance(listed, list) else [listed])]
    except ValueError:
        return text, []
    content = _CITATION.sub(r"\1", "".join(body for kind, body in stretches if kind == "answer")).strip()
    return (content or None, calls) if calls else (text, [])


def parse_cohere_command3(text: str) -> Calls:
    """Command A (melody's cmd3): the answer is the text outside other sections and in
    `<|START_RESPONSE|>...<|END_RESPONSE|>`."""
    return _cohere_command(text, (COHERE_RESPONSE,), (COHERE_RESPONSE_END,), "answer")


def parse_cohere_command4(text: str) -> Calls:
    """Command A Reasoning/Vision (melody's cmd4): the completion opens thinking; the answer is in
    `<|START_TEXT|>` or `<|START_RESPONSE|>` sections and after `<|END_THINKING|>`."""
    return _cohere_command(text, (COHERE_TEXT, COHERE_RESPONSE), (COHERE_TEXT_END, COHERE_RESPONSE_END), "thinking")
