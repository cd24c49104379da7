"""The tool-call wire format the model writes, and reading it back, whole or as it streams.

Gemma 3 has no tool tokens, so the format is ours (the grammar of `ConstraintSpec.tools` enforces it):

* ``tool_choice="required"`` or a named function: the whole output is one compact JSON object
  ``{"name":"<declared name>","arguments":{...}}``.
* ``tool_choice="auto"``: either an answer (free text that does not start with `TOOL_CALL_MARKER`, or a
  document of the request's answer schema when one is set), or the marker immediately followed by one
  such object, and then the end of the output.

`ToolCallStream` splits generated text into answer text and call pieces as it arrives, so every API can
stream a call's arguments while they are generated; `parse_tool_calls` reads a finished output.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

TOOL_CALL_MARKER = "<tool_call>"
# The fixed head of a call object, as the grammar writes it (compact JSON, "name" first).
_CALL_HEAD = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"arguments":')


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class CallPiece:
    """A piece of the tool call being generated: its start (``first``: the call's id and name are known,
    no arguments yet) or more of its arguments' JSON text."""

    index: int
    call_id: str
    name: str
    arguments: str = ""
    first: bool = False


class ToolCallStream:
    """Feeds on generated text; `push` returns what is final so far: answer text (str) and `CallPiece`s.

    ``mode`` is None (no tools: everything is text), "auto" (text unless it starts with the marker) or
    "required" (the whole output is a call). Text that may still become the marker is held; so is the
    last character of a call's arguments (it may be the call object's closing brace).
    """

    def __init__(self, mode: str | None) -> None:
        self.mode = mode
        self.state = "text" if mode is None else ("deciding" if mode == "auto" else "head")
        self.buffer = ""  # undecided text, or the call's head, or its arguments not yet given out
        self.call: CallPiece | None = None
        self.sent = 0  # characters of the call's arguments given out

    def push(self, text: str) -> list[str | CallPiece]:
        if self.state == "text":
            return [text] if text else []
        self.buffer += text
        out: list[str | CallPiece] = []
        if self.state == "deciding":
            if self.buffer.startswith(TOOL_CALL_MARKER):
                self.state, self.buffer = "head", self.buffer[len(TOOL_CALL_MARKER):]
            elif not TOOL_CALL_MARKER.startswith(self.buffer):
                self.state = "text"
                out.append(self.buffer)
                self.buffer = ""
                return out
            else:
                return out
        if self.state == "head":
            head = _CALL_HEAD.match(self.buffer)
            if head is None:
                return out
            self.call = CallPiece(0, new_call_id(), json.loads(head.group(1)))
            out.append(CallPiece(0, self.call.call_id, self.call.name, first=True))
            self.state, self.buffer = "arguments", self.buffer[head.end():]
        if self.state == "arguments" and len(self.buffer) - 1 > self.sent:
            out.append(CallPiece(0, self.call.call_id, self.call.name, self.buffer[self.sent:-1]))
            self.sent = len(self.buffer) - 1
        return out

    def finish(self, complete: bool) -> list[str | CallPiece]:
        """What is still held once generation ended; ``complete``: the output parsed as a whole call, so its
        last character is the object's closing brace, not arguments."""
        if self.state in ("text", "deciding"):
            rest, self.buffer = self.buffer, ""
            return [rest] if rest else []
        if self.state != "arguments":
            return []
        end = len(self.buffer) - 1 if complete else len(self.buffer)
        rest = self.buffer[self.sent:end]
        self.sent = end
        return [CallPiece(0, self.call.call_id, self.call.name, rest)] if rest else []

    @property
    def call_started(self) -> bool:
        return self.call is not None


def _call_json(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str, spec: Any) -> list[dict[str, Any]] | None:
    """The OpenAI ``tool_calls`` list for a finished output of a tools `ConstraintSpec`, or None for an
    answer (auto mode). ValueError when the output is not a complete call (e.g. cut by max_tokens).
    ``arguments`` is the generated JSON text itself, as it was streamed."""
    if spec.kind != "tools":
        raise ValueError(f"not a tools constraint: {spec.kind}")
    names = {f["name"] for f in spec.functions}
    if spec.tool_mode == "auto":
        if not text.startswith(TOOL_CALL_MARKER):
            return None
        text = text[len(TOOL_CALL_MARKER):]
    try:
        call = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"incomplete or malformed tool call: {e}") from None
    if not (isinstance(call, dict) and call.keys() == {"name", "arguments"} and call["name"] in names):
        raise ValueError("the output is not a call of a declared function")
    head = _CALL_HEAD.match(text)
    if head is not None and text.rstrip().endswith("}"):
        arguments = text[head.end():text.rstrip().rfind("}")].strip()
    else:  # not the grammar's own layout (hand-written text): normalise
        arguments = json.dumps(call["arguments"], ensure_ascii=False, separators=(",", ":"))
    return [_call_json(call["name"], arguments)]


def begins_call(text: str, mode: str) -> bool:
    """Whether an output of a tools constraint in ``mode`` is (the start of) a call rather than an answer."""
    return mode != "auto" or text.startswith(TOOL_CALL_MARKER)


def parse_partial_call(text: str, mode: str) -> dict[str, Any] | None:
    """A call cut short (max_tokens) as the call it was becoming: its name and the arguments so far; None
    if the output had not got as far as naming a function."""
    if mode == "auto":
        if not text.startswith(TOOL_CALL_MARKER):
            return None
        text = text[len(TOOL_CALL_MARKER):]
    head = _CALL_HEAD.match(text)
    return _call_json(json.loads(head.group(1)), text[head.end():]) if head is not None else None
