"""Matching a client's messages against a session's stored history: only what is new is appended, and a
resent history that contradicts the stored one is refused (`HistoryConflictError`)."""

from __future__ import annotations

import json
from typing import Any

from agents.errors import HistoryConflictError

__all__ = ["merge_history"]


def _same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as a conversation turn: role, name, tool call id and tool calls (arguments as JSON values), and
    content up to surrounding whitespace (clients strip or re-indent what they send back)."""
    if any(a.get(k) != b.get(k) for k in ("role", "name", "tool_call_id")):
        return False
    if (a.get("content") or "").strip() != (b.get("content") or "").strip():
        return False
    return _calls(a) == _calls(b)


def _calls(message: dict[str, Any]) -> list[tuple[Any, Any]]:
    out = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", {})
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = arguments.strip()
        out.append((fn.get("name"), arguments))
    return out


def merge_history(history: list[dict[str, Any]], incoming: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages of ``incoming`` (normalised) that the stored ``history`` does not hold yet.

    A client either sends only the new message(s), or resends the conversation with the new messages at the
    end (agent frameworks do). A resend is recognised by its first message matching the stored first one
    (with more than one message sent, or a system message first): it must then match the stored history
    message by message (`_same_message`) and add something after it, else `HistoryConflictError`; never is
    a resent history appended twice."""
    if not history or not incoming:
        return incoming
    resend = _same_message(incoming[0], history[0]) and (len(incoming) > 1 or incoming[0]["role"] == "system")
    if not resend:
        if incoming[0]["role"] == "system" and history[0]["role"] == "system":
            raise HistoryConflictError(0, "is a system message that differs from the session's")
        if incoming[0]["role"] == "system" and len(incoming) > 1 and _same_message(incoming[1], history[0]):
            raise HistoryConflictError(0, "is a system message the session does not start with")
        return incoming
    for i, (sent, stored) in enumerate(zip(incoming, history, strict=False)):
        if not _same_message(sent, stored):
            raise HistoryConflictError(i, f"differs from the session's message {i} ({stored['role']})")
    if len(incoming) <= len(history):
        raise HistoryConflictError(len(incoming) - 1, "ends the resent history without a new message")
    return incoming[len(history):]
