"""Reading tool calls back from generated text, whole or as it streams.

The wire format is `scheduler.tool_protocol`'s (the grammar of `ConstraintSpec.tools` enforces it).
`ToolCallStream` splits generated text into answer text and call pieces as it arrives, so every API can
stream a call's arguments while they are generated; `parse_tool_calls` reads a finished output,
`parse_partial_calls` one cut short.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from scheduler.tool_protocol import CALL_HEAD, TOOL_CALL_MARKER

__all__ = ["CallPiece", "ToolCallStream", "begins_call", "new_call_id", "parse_partial_calls", "parse_tool_calls",
           "split_answer"]


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

    ``mode`` is None (no tools: everything is text), "auto" or "required" (the output is calls).
    ``calls_after_text`` (auto mode without an answer schema): the marker may come after some text, so text
    flows while any suffix that may still become the marker is held; otherwise only a leading marker starts
    a call. A call's arguments are given out as they arrive; the call object's closing brace is not (its
    arguments' end is found by tracking JSON nesting). After a call, the marker may start the next one.
    """

    def __init__(self, mode: str | None, calls_after_text: bool = False) -> None:
        self.mode = mode
        self.calls_after_text = calls_after_text and mode == "auto"
        self.state = "text" if mode is None else ("deciding" if mode == "auto" else "head")
        self.buffer = ""  # undecided text, or a call's head, or text after a call
        self.calls: list[CallPiece] = []  # the calls started so far (first pieces)
        self._depth = 0  # JSON nesting inside the current call's arguments
        self._in_string = self._escaped = False

    def push(self, text: str) -> list[str | CallPiece]:
        if self.state == "text":
            return [text] if text else []
        self.buffer += text
        out: list[str | CallPiece] = []
        while True:
            before = (self.state, len(self.buffer))
            out += self._advance()
            if (self.state, len(self.buffer)) == before:
                return out

    def _advance(self) -> list[str | CallPiece]:
        if self.state == "deciding" and self.calls_after_text:
            at = self.buffer.find(TOOL_CALL_MARKER)
            if at >= 0:
                text, self.state, self.buffer = self.buffer[:at], "head", self.buffer[at + len(TOOL_CALL_MARKER):]
                return [text] if text else []
            keep = _marker_prefix_len(self.buffer)
            text, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            return [text] if text else []
        if self.state == "deciding":
            if self.buffer.startswith(TOOL_CALL_MARKER):
                self.state, self.buffer = "head", self.buffer[len(TOOL_CALL_MARKER):]
            elif not TOOL_CALL_MARKER.startswith(self.buffer):
                self.state, text, self.buffer = "text", self.buffer, ""
                return [text]
            return []
        if self.state == "head":
            head = CALL_HEAD.match(self.buffer)
            if head is None:
                return []
            call = CallPiece(len(self.calls), new_call_id(), json.loads(head.group(1)), first=True)
            self.calls.append(call)
            self.state, self.buffer = "arguments", self.buffer[head.end():]
            self._depth, self._in_string, self._escaped = 0, False, False
            return [call]
        if self.state == "arguments":
            end = self._arguments_end()
            piece, self.buffer = (self.buffer, "") if end is None else (self.buffer[:end], self.buffer[end:])
            if end is not None:
                self.state = "after"
            call = self.calls[-1]
            return [CallPiece(call.index, call.call_id, call.name, piece)] if piece else []
        # After the arguments: the call object's closing brace, then the end or the next call's marker.
        if self.state == "after" and self.buffer.startswith("}" + TOOL_CALL_MARKER):
            self.state, self.buffer = "head", self.buffer[1 + len(TOOL_CALL_MARKER):]
        return []

    def _arguments_end(self) -> int | None:
        """Where the arguments' JSON value ends in the buffer (scanning it once), or None if not yet."""
        for i, ch in enumerate(self.buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None

    def finish(self) -> list[str | CallPiece]:
        """What is still held once generation ended: undecided text (it was an answer after all)."""
        if self.state in ("text", "deciding"):
            rest, self.buffer = self.buffer, ""
            return [rest] if rest else []
        return []

    @property
    def call_ids(self) -> list[str]:
        return [c.call_id for c in self.calls]


def _marker_prefix_len(text: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of the marker."""
    for n in range(min(len(text), len(TOOL_CALL_MARKER) - 1), 0, -1):
        if TOOL_CALL_MARKER.startswith(text[-n:]):
            return n
    return 0


def _call_json(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str, spec: Any) -> list[dict[str, Any]] | None:
    """The OpenAI ``tool_calls`` list for a finished output of a tools `ConstraintSpec`, or None for an
    answer (auto mode). ValueError when the output is not complete calls (e.g. cut by max_tokens).
    ``arguments`` is the generated JSON text itself, as it was streamed."""
    if spec.kind != "tools":
        raise ValueError(f"not a tools constraint: {spec.kind}")
    names = {f["name"] for f in spec.functions}
    if spec.tool_mode == "auto":
        _, text = split_answer(text, spec)
        if text is None:
            return None
    calls, decoder, at = [], json.JSONDecoder(), 0
    while True:
        try:
            call, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError as e:
            raise ValueError(f"incomplete or malformed tool call {len(calls)}: {e}") from None
        if not (isinstance(call, dict) and call.keys() == {"name", "arguments"} and call["name"] in names):
            raise ValueError(f"output {len(calls)} is not a call of a declared function")
        head = CALL_HEAD.match(text, at)
        if head is not None and text[end - 1] == "}":
            arguments = text[head.end():end - 1]
        else:  # not the grammar's own layout (hand-written text): normalise
            arguments = json.dumps(call["arguments"], ensure_ascii=False, separators=(",", ":"))
        calls.append(_call_json(call["name"], arguments))
        if not text[end:].strip():
            return calls
        if not (spec.parallel and text.startswith(TOOL_CALL_MARKER, end)):
            raise ValueError("text after the tool call")
        at = end + len(TOOL_CALL_MARKER)


def split_answer(text: str, spec: Any) -> tuple[str, str | None]:
    """An auto-mode output of a tools spec split into (the text before the calls, the calls after the marker;
    None without calls). Only a leading marker counts when the spec has an answer schema."""
    at = text.find(TOOL_CALL_MARKER) if spec.answer_schema is None else (0 if text.startswith(TOOL_CALL_MARKER)
                                                                          else -1)
    return (text, None) if at < 0 else (text[:at], text[at + len(TOOL_CALL_MARKER):])


def begins_call(text: str, mode: str, calls_after_text: bool = False) -> bool:
    """Whether an output of a tools constraint in ``mode`` has begun calls (rather than being an answer)."""
    if mode != "auto":
        return True
    return TOOL_CALL_MARKER in text if calls_after_text else text.startswith(TOOL_CALL_MARKER)


def parse_partial_calls(text: str, mode: str, calls_after_text: bool = False) -> list[dict[str, Any]]:
    """Calls cut short (max_tokens): the complete ones, then the one it was becoming (its name and the
    arguments so far); empty if the output had not got as far as naming a function."""
    stream = ToolCallStream(mode, calls_after_text)
    pieces = stream.push(text)
    arguments: dict[str, str] = {}
    for piece in pieces:
        if isinstance(piece, CallPiece):
            arguments[piece.call_id] = arguments.get(piece.call_id, "") + piece.arguments
    return [_call_json(c.name, arguments[c.call_id]) for c in stream.calls]
