"""The `Store` contract for admin-created agents and per-agent sessions, its errors and the records it
returns. Everything stored is JSON; nothing is pickled.

Sessions are namespaced by agent: (agent, session id) is the key, so agent A can never read agent B's
session even when both use the same id. A session holds the committed conversation as normalised
OpenAI-style messages (`agents.messages`), plus created/updated timestamps and an optional expiry.

TTL and the per-agent session limit are store settings that one call may override:
``ttl=None`` / ``max_sessions=None`` use the store's setting, ``0`` means no expiry / no limit.
The TTL is refreshed by every write. The limit only refuses *creating* a session (`SessionLimitError`);
appending to an existing one always works.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

from agents.messages import normalize_messages
from agents.spec import AgentSpec

# Ids end up inside Redis keys and URLs: a conservative charset keeps both unambiguous.
SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
_SESSION_ID = re.compile(SESSION_ID_PATTERN)

PutMode = Literal["create", "update", "upsert"]


class StoreError(RuntimeError):
    """The store holds something unreadable (e.g. an agent JSON that no longer validates)."""


class StoreUnavailableError(StoreError):
    """The store did not answer in time or refused the connection (the server answers 503). The message
    never carries the store's address."""


class AgentGoneError(LookupError):
    """The agent was deleted while its turn ran: the turn is not stored (it would resurrect the session)."""

    def __init__(self, agent: str) -> None:
        super().__init__(f"agent {agent!r} was deleted during the turn; the turn was not stored")


class InvalidSessionIdError(ValueError):
    """A session id outside `SESSION_ID_PATTERN` (the server answers 400)."""


class SessionLimitError(RuntimeError):
    """Creating one more session would exceed the agent's session limit (the server answers 429)."""

    def __init__(self, agent: str, limit: int) -> None:
        self.agent = agent
        self.limit = limit
        super().__init__(f"agent {agent!r} already has {limit} sessions (the limit); delete one or wait for expiry")


@dataclass(frozen=True)
class SessionInfo:
    """A session's metadata; times are Unix seconds, ``expires_at`` None when it never expires."""

    agent: str
    id: str
    created: float
    updated: float
    expires_at: float | None
    message_count: int
    owner: str | None = None  # fingerprint of the API key that created it; None: created without auth


@dataclass(frozen=True)
class Session:
    """A committed conversation. ``messages`` is the caller's own copy."""

    agent: str
    id: str
    messages: list[dict[str, Any]] = field(repr=False)
    created: float
    updated: float
    expires_at: float | None = None
    owner: str | None = None  # fingerprint of the API key that created it; None: created without auth

    def info(self) -> SessionInfo:
        return SessionInfo(self.agent, self.id, self.created, self.updated, self.expires_at, len(self.messages),
                           self.owner)


def check_session_key(agent: str, sid: str) -> None:
    if not AgentSpec.is_valid_name(agent):
        raise ValueError(f"invalid agent name {agent!r}")
    if not isinstance(sid, str) or not _SESSION_ID.fullmatch(sid):
        raise InvalidSessionIdError(f"invalid session id {sid!r}: expected {SESSION_ID_PATTERN}")


def load_agent(raw: str | bytes) -> AgentSpec:
    """A stored agent, or `StoreError` naming why it no longer validates (e.g. after an upgrade)."""
    try:
        return AgentSpec.from_json(raw)
    except ValueError as e:
        raise StoreError(f"stored agent is invalid: {e}") from e


def encode_messages(messages: list[dict[str, Any]]) -> list[str]:
    """Validated, normalised messages as JSON strings (the unit both stores persist)."""
    if not messages:
        raise ValueError("a turn needs at least one message")
    normalized = normalize_messages(messages)
    try:
        return [json.dumps(m, ensure_ascii=False, allow_nan=False) for m in normalized]
    except (TypeError, ValueError) as e:
        raise ValueError(f"messages must be JSON-serialisable: {e}") from None


class Store(ABC):
    """Async storage for agents (created through the admin API) and sessions."""

    def __init__(self, *, session_ttl: float | None = None, max_sessions_per_agent: int | None = None) -> None:
        if session_ttl is not None and session_ttl < 0:
            raise ValueError("session_ttl must be >= 0")
        if max_sessions_per_agent is not None and max_sessions_per_agent < 0:
            raise ValueError("max_sessions_per_agent must be >= 0")
        self.session_ttl = session_ttl or None
        self.max_sessions_per_agent = max_sessions_per_agent or None

    def _ttl(self, ttl: float | None) -> float | None:
        value = self.session_ttl if ttl is None else ttl
        if value is not None and value < 0:
            raise ValueError("ttl must be >= 0")
        return value or None

    def _limit(self, max_sessions: int | None) -> int | None:
        value = self.max_sessions_per_agent if max_sessions is None else max_sessions
        return value or None

    # ---- agents ---------------------------------------------------------------------------------

    @abstractmethod
    async def put_agent(self, spec: AgentSpec, mode: PutMode = "upsert") -> bool:
        """Store ``spec``. "create": only if the name is free; "update": only if it exists.
        Returns False when the condition failed (atomic, also across servers)."""

    @abstractmethod
    async def get_agent(self, name: str) -> AgentSpec | None: ...

    @abstractmethod
    async def delete_agent(self, name: str) -> bool:
        """Remove the agent and all its sessions (a later agent of that name must not inherit them)."""

    @abstractmethod
    async def list_agents(self) -> list[AgentSpec]:
        """All stored agents, sorted by name."""

    # ---- sessions -------------------------------------------------------------------------------

    @abstractmethod
    async def get_session(self, agent: str, sid: str) -> Session | None: ...

    @abstractmethod
    async def append_turn(
        self,
        agent: str,
        sid: str,
        new_messages: list[dict[str, Any]],
        *,
        ttl: float | None = None,
        max_sessions: int | None = None,
        owner: str | None = None,
        require_agent: bool = False,
    ) -> Session:
        """Atomically append ``new_messages`` (creating the session if missing, owned by ``owner``) and return
        the result. ``require_agent``: the agent lives in this store, and if it is gone by now (deleted while
        the turn ran) nothing is written and `AgentGoneError` is raised."""

    @abstractmethod
    async def delete_session(self, agent: str, sid: str) -> bool: ...

    @abstractmethod
    async def list_sessions(self, agent: str) -> list[SessionInfo]:
        """The agent's live sessions, most recently updated first."""

    @abstractmethod
    async def begin_turn(self, agent: str, sid: str, lease_s: float) -> str | None:
        """Claim the session for one turn: a token, or None while another turn holds it. The claim lapses
        after ``lease_s`` unless renewed (a crashed server does not lock a session for good)."""

    @abstractmethod
    async def renew_turn(self, agent: str, sid: str, token: str, lease_s: float) -> bool:
        """Extend a claim; False if it lapsed (or was never this token's)."""

    @abstractmethod
    async def end_turn(self, agent: str, sid: str, token: str) -> None:
        """Release a claim, if it is still this token's."""

    @abstractmethod
    async def claim_request(self, scope: str, key: str, ttl_s: float) -> tuple[str, str | None]:
        """Idempotency keys: ("claimed", None) for the first request with this key in this scope, which must
        then `finish_request` or `abandon_request`; ("running", None) while that one runs; ("done", answer)
        after it finished, until ``ttl_s`` after the claim."""

    @abstractmethod
    async def renew_request(self, scope: str, key: str, ttl_s: float) -> bool:
        """Extend a running claim by ``ttl_s``; False once it is no longer running (finished, abandoned or
        lapsed)."""

    @abstractmethod
    async def finish_request(self, scope: str, key: str, answer: str, ttl_s: float) -> None:
        """Record the answer of a claimed request (kept ``ttl_s``)."""

    @abstractmethod
    async def abandon_request(self, scope: str, key: str) -> None:
        """Drop a claimed request that failed, so that a retry runs it again."""

    @abstractmethod
    async def put_response(self, response_id: str, record: dict[str, Any], ttl_s: float | None) -> None:
        """Keep a stored response (the Responses API's): a JSON-able record, for ``ttl_s`` (None: for good)."""

    @abstractmethod
    async def get_response(self, response_id: str) -> dict[str, Any] | None:
        """A stored response's record, or None (never stored, expired or deleted)."""

    @abstractmethod
    async def delete_response(self, response_id: str) -> bool:
        """Forget a stored response; False if there was none."""

    async def ping(self) -> None:  # noqa: B027 - optional hook: a store in process memory always answers
        """Raise `StoreUnavailableError` unless the store answers (for /ready)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections."""


# --------------------------------------------------------------------------------------------------
# MemoryStore
# --------------------------------------------------------------------------------------------------
