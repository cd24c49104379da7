"""The built-in plain-text transcript, for checkpoints without a chat template of their own (the base Gemma 3
270M): a base model never learned Gemma's turn tokens, and continues a transcript well.

Layout::

    <bos>{agent system}\\n\\n{tools}\\n\\n{client system}\\n\\n
    User: {text}\\n
    Assistant: {text}\\n
    Tool result ({function}): {text}\\n
    System: {mid-conversation instruction}\\n
    ...
    Assistant:

A turn marker (`MARKERS`) counts only at the start of a line. Inside any text we render, a line that would
start with one gets a leading space, so no content can open a turn of its own; and the model's turn ends
where it writes a line that starts with one (`STOP_STRINGS`). Text is tokenized piece by piece with
special-token parsing off (`PromptBuilder`), so nothing but the BOS is a control token.
"""

from __future__ import annotations

import re
from typing import Any

from agents.messages import message_text, normalize_messages
from agents.prompt_text import PromptBuilder, leading_system_count, system_texts
from core.tokenizer import Tokenizer

__all__ = ["MARKERS", "STOP_STRINGS", "neutralise_markers", "render_transcript"]

USER, ASSISTANT, SYSTEM, TOOL_RESULT = "User:", "Assistant:", "System:", "Tool result"
MARKERS = (USER, ASSISTANT, SYSTEM, TOOL_RESULT)
# The model's turn ends where it starts a line with any marker (it would be writing another turn).
STOP_STRINGS = tuple(f"\n{marker}" for marker in MARKERS)
_SEPARATOR = "\n\n"
_MARKER_LINE = re.compile("^(?=" + "|".join(re.escape(m) for m in MARKERS) + ")", re.MULTILINE)


def neutralise_markers(text: str, *, first_line: bool = True) -> str:
    """`text` with a space before every line that starts with a turn marker; with ``first_line`` False the
    first line is left as it is (it follows a marker of ours on the same line)."""
    if not first_line:
        first, newline, rest = text.partition("\n")
        return first + newline + neutralise_markers(rest)
    return _MARKER_LINE.sub(" ", text)


def _line(message: dict[str, Any], function_of: dict[str, str]) -> str:
    """One message as its transcript line (marker included), its text neutralised."""
    role = message["role"]
    if role == "assistant":
        for call in message.get("tool_calls", ()):
            if "id" in call:
                function_of[call["id"]] = call["function"]["name"]
        marker, text = ASSISTANT, message_text(message).strip()
    elif role == "tool":
        name = message.get("name") or function_of.get(message["tool_call_id"]) or message["tool_call_id"]
        marker, text = f"{TOOL_RESULT} ({' '.join(name.split())}):", message["content"]
    elif role in ("system", "developer"):  # a mid-conversation instruction
        marker, text = SYSTEM, message["content"]
    else:
        marker, text = USER, message["content"]
    return f"{marker} {neutralise_markers(text.strip(), first_line=False)}\n"


def render_transcript(
    tok: Tokenizer,
    system_prompt: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> tuple[list[int], int, list[int]]:
    """(prompt ids, system_end, boundaries), as `agents.gemma_template.render_gemma` returns them: system_end
    counts the leading ids fixed by ``system_prompt`` and ``tools`` alone (shared by every session of the
    agent); boundaries are where the system text and each message end."""
    messages = normalize_messages(messages)
    lead = leading_system_count(messages)  # the client's leading system messages follow the agent's own text
    agent_system, client_system = system_texts(system_prompt, tools, messages[:lead])

    b = PromptBuilder(tok)
    b.bos()
    system_end = len(b.ids)
    for i, piece in enumerate(agent_system + client_system):
        b.text(neutralise_markers(piece) + _SEPARATOR)
        if i + 1 == len(agent_system):
            system_end = len(b.ids)
    boundaries = [system_end, len(b.ids)]
    function_of: dict[str, str] = {}  # tool_call_id -> function name, to label results
    for message in messages[lead:]:
        b.text(_line(message, function_of))
        boundaries.append(len(b.ids))
    if add_generation_prompt:
        b.text(ASSISTANT)
    return b.ids, system_end, boundaries
