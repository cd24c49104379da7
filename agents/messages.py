"""OpenAI-style chat messages: validation into one plain-dict shape, and their text for templates.

A normalised message is a JSON-serialisable dict with ``role`` and ``content`` (a string; text parts are
joined) plus, where present, ``name``, ``tool_calls`` and ``tool_call_id``. Other keys are dropped, so
what sessions store and templates render is always the same small shape.
"""

from __future__ import annotations

import json
from typing import Any

from scheduler.tool_protocol import TOOL_CALL_MARKER

__all__ = [
    "ROLES",
    "MessageError",
    "TemplateError",
    "invalid_text_path",
    "message_text",
    "normalize_message",
    "normalize_messages",
    "tool_call_text",
]

# "developer" is OpenAI's newer name for a system message.
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_MAX_NAME = 256


class MessageError(ValueError):
    """A message that is not a valid OpenAI chat message (the server answers 400)."""


class TemplateError(ValueError):
    """A conversation or chat template that cannot be rendered safely (the server answers 400)."""


def invalid_text_path(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string in a JSON value that is not valid Unicode text
    (a lone surrogate such as "\\ud800", which JSON can carry but no tokenizer can encode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "(value)"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = invalid_text_path(key, where) or invalid_text_path(item, where)
            if found:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = invalid_text_path(item, f"{path}[{i}]")
            if found:
                return found
    return None


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise MessageError("messages must be a list")
    return [normalize_message(m, i) for i, m in enumerate(messages)]


def normalize_message(message: dict[str, Any], index: int = 0) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise MessageError(f"{where} must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise MessageError(f"{where}.role must be one of {sorted(ROLES)}; got {role!r}")
    out: dict[str, Any] = {"role": role, "content": _content(message.get("content"), where)}
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str) or not 0 < len(value) <= _MAX_NAME:
                raise MessageError(f"{where}.{key} must be a non-empty string of at most {_MAX_NAME} characters")
            out[key] = value
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant":
            raise MessageError(f"{where}: only assistant messages carry tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if role == "tool" and "tool_call_id" not in out:
        raise MessageError(f"{where}: a tool message needs tool_call_id")
    return out


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise MessageError(f"{where}.content[{j}]: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise MessageError(f"{where}.content must be a string, a list of text parts, or null")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise MessageError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, str):  # some clients send the object itself
        try:
            arguments = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise MessageError(f"{where}.function.arguments is not JSON-serialisable: {e}") from None
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def tool_call_text(calls: list[dict[str, Any]]) -> str:
    """The text the model emits for these calls (the scheduler's format: marker + compact JSON).

    Re-rendering a past call exactly as the model wrote it keeps the conversation in the model's own
    format. Arguments that are not valid JSON are kept as the raw string."""
    lines = []
    for call in calls:
        fn = call["function"]
        try:
            arguments: Any = json.loads(fn["arguments"])
        except (TypeError, ValueError):
            arguments = fn["arguments"]
        body = json.dumps({"name": fn["name"], "arguments": arguments}, ensure_ascii=False, separators=(",", ":"))
        lines.append(TOOL_CALL_MARKER + body)
    return "\n".join(lines)


def message_text(message: dict[str, Any]) -> str:
    """A normalised message's full text: its content, then any tool calls."""
    calls = message.get("tool_calls")
    if not calls:
        return message["content"]
    content = message["content"].strip()
    return f"{content}\n{tool_call_text(calls)}" if content else tool_call_text(calls)
