"""What both built-in templates share: an id builder that keeps text out of control tokens, and the text that
describes the agent's tools to the model."""

from __future__ import annotations

import json
from typing import Any

from agents.messages import TemplateError
from core.tokenizer import Tokenizer
from scheduler.tool_protocol import TOOL_CALL_MARKER

__all__ = ["PromptBuilder", "leading_system_count", "system_texts", "tools_instructions"]


def leading_system_count(messages: list[dict[str, Any]]) -> int:
    """How many messages at the start are the client's system (or developer) messages: they extend the
    agent's system text rather than being turns."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] in ("system", "developer"):
        lead += 1
    return lead


def system_texts(system_prompt: str, tools: list[dict[str, Any]] | None, client: list[dict[str, Any]]
                 ) -> tuple[list[str], list[str]]:
    """(the agent's system pieces: its prompt and its tools' description; the client's leading system texts),
    empty pieces left out."""
    agent = [t for t in (system_prompt.strip(), tools_instructions(tools) if tools else "") if t]
    return agent, [t for m in client if (t := m["content"].strip())]


def tools_instructions(tools: list[dict[str, Any]]) -> str:
    """How the model learns its functions and the scheduler's call format (`TOOL_CALL_MARKER` + JSON)."""
    lines = ["You can call these functions:"]
    for tool in tools:
        fn = tool.get("function", tool)
        entry = {k: fn[k] for k in ("name", "description", "parameters") if k in fn}
        lines.append(json.dumps(entry, ensure_ascii=False, separators=(",", ":")))
    lines.append(
        f'To call one, reply with {TOOL_CALL_MARKER}{{"name":<function name>,"arguments":<arguments object>}} '
        "and nothing else."
    )
    return "\n".join(lines)


class PromptBuilder:
    """Accumulates ids; text is always tokenized piece by piece with special-token parsing off, so no text
    becomes a control token and every piece starts on a token boundary."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.ids: list[int] = []

    def bos(self) -> None:
        if self.tok.bos_id is None:
            raise TemplateError("the tokenizer has no BOS token")
        self.ids.append(self.tok.bos_id)

    def control(self, token: str) -> None:
        token_id = self.tok.token_to_id(token)
        if token_id is None or token_id not in self.tok.special_ids:
            raise TemplateError(f"the tokenizer has no {token} control token (the built-in template is Gemma's)")
        self.ids.append(token_id)

    def text(self, text: str) -> None:
        if text:
            self.ids.extend(self.tok.encode(text, parse_special=False))
