"""The built-in Gemma turn template, for instruction-tuned Gemma checkpoints that ship no chat template
(`model.chat_template: gemma-turns`; a base checkpoint never learned these turn tokens).

Layout (what Gemma's own template produces)::

    <bos><start_of_turn>user\\n{system}\\n\\n{first user message}<end_of_turn>\\n
    <start_of_turn>model\\n{assistant}<end_of_turn>\\n ... <start_of_turn>model\\n

Control tokens are inserted as ids; every piece of text (system prompt, contents, role names) is
tokenized on its own with special-token parsing off, so no text can become a control token and every
piece starts on a token boundary. Gemma has no system or tool roles: the system text opens the first
user turn, tool results are user turns with a "Result of <function>:" prefix, and consecutive turns of
the same side are merged so user and model strictly alternate.
"""

from __future__ import annotations

from typing import Any

from agents.messages import message_text, normalize_messages
from agents.prompt_text import PromptBuilder, leading_system_count, system_texts
from core.tokenizer import Tokenizer

__all__ = ["render_gemma"]

_SEPARATOR = "\n\n"


def _turns(messages: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(side, texts) per turn, side "user" or "model"; consecutive texts of one side share a turn."""
    function_of: dict[str, str] = {}  # tool_call_id -> function name, to label results
    turns: list[tuple[str, list[str]]] = []
    for m in messages:
        role = m["role"]
        if role == "assistant":
            for call in m.get("tool_calls", ()):
                if "id" in call:
                    function_of[call["id"]] = call["function"]["name"]
            side, text = "model", message_text(m).strip()
        elif role == "tool":
            label = m.get("name") or function_of.get(m["tool_call_id"]) or m["tool_call_id"]
            side, text = "user", f"Result of {label}:\n{m['content'].strip()}"
        elif role in ("system", "developer"):  # a mid-conversation instruction
            side, text = "user", f"System: {m['content'].strip()}"
        else:
            side, text = "user", m["content"].strip()
        if turns and turns[-1][0] == side:
            turns[-1][1].append(text)
        else:
            turns.append((side, [text]))
    return turns


def render_gemma(
    tok: Tokenizer,
    system_prompt: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> tuple[list[int], int, list[int]]:
    """(prompt ids, system_end, boundaries): system_end counts the leading ids fixed by ``system_prompt`` and
    ``tools`` alone, so all sessions of one agent share exactly that prefix; boundaries are where the system
    text and each turn end (a later request of the conversation repeats the ids before each)."""
    messages = normalize_messages(messages)
    # Leading system messages from the client extend the system text, after the agent's own.
    lead = leading_system_count(messages)
    agent_system, client_system = system_texts(system_prompt, tools, messages[:lead])
    turns = _turns(messages[lead:])

    b = PromptBuilder(tok)
    b.bos()
    b.control("<start_of_turn>")
    b.text("user\n")
    system_end = len(b.ids)
    opens_with_user = bool(turns) and turns[0][0] == "user"
    system_pieces = agent_system + client_system
    for i, piece in enumerate(system_pieces):
        b.text(piece)
        if i + 1 < len(system_pieces) or opens_with_user:
            b.text(_SEPARATOR)
        if i + 1 == len(agent_system):
            system_end = len(b.ids)
    boundaries = [system_end, len(b.ids)]
    if not opens_with_user:  # the opening user turn holds only the system text (if any)
        b.control("<end_of_turn>")
        b.text("\n")
        boundaries.append(len(b.ids))

    for n, (side, texts) in enumerate(turns):
        if n > 0 or not opens_with_user:  # the first user turn was opened above
            b.control("<start_of_turn>")
            b.text(f"{side}\n")
        for j, text in enumerate(texts):
            if j:
                b.text(_SEPARATOR)
            b.text(text)
        b.control("<end_of_turn>")
        b.text("\n")
        boundaries.append(len(b.ids))
    if add_generation_prompt:
        b.control("<start_of_turn>")
        b.text("model\n")
    return b.ids, system_end, boundaries
