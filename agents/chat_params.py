"""What a chat or completion turn asks for, transport-free: the validated request (`ChatParams`) and who asks
(`SessionCaller`). The server's API modules build them; `agents.service.ChatService` serves them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents.store import Session, SessionInfo

__all__ = ["ChatParams", "SessionCaller"]


@dataclass
class ChatParams:
    """A validated OpenAI request, transport-free. None means "not given" (the agent default applies)."""

    messages: list[dict[str, Any]] | None = None  # chat
    prompt: str | list[int] | None = None  # completions: text, or token ids fed as given
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: tuple[str, ...] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    ignore_eos: bool = False
    close_within_budget: bool = True  # a constrained output near max_tokens closes along its grammar
    session_id: str | None = None
    user: str | None = None
    cache_salt: str | None = None  # requests share cached KV only with the same salt (vLLM's API)
    caller: SessionCaller | None = None  # who asks, for session ownership; None: sessions are shared
    truncation: str | None = None  # "auto" | "disabled"; None: the agent's
    instructions: str | None = None  # a system message for this request only: rendered first, never stored
    only_new: bool = False  # the messages are only what follows the session's history (never a resent history)
    # True: up to MAX_PARALLEL_CALLS calls in one turn. Not given: one (unlike OpenAI's default, since a small
    # model offered more calls tends to run on into calls nobody asked for).
    parallel_tool_calls: bool | None = None


@dataclass(frozen=True)
class SessionCaller:
    """Who is asking, as far as sessions go: the fingerprint of their API key (never the key), and whether they
    may see every session (an admin key)."""

    owner: str | None
    admin: bool = False

    def may_see(self, session: Session | SessionInfo) -> bool:
        return self.admin or session.owner == self.owner
