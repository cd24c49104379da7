"""Persistence for admin-created agents and per-agent sessions: the `Store` interface and `MemoryStore`.

`RedisStore` (``agents.redis_store``, importable from here too) implements the same contract for
several servers sharing one Redis. Everything stored is JSON; nothing is pickled.

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
import secrets
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from agents.messages import normalize_messages
from agents.spec import AgentSpec

if TYPE_CHECKING:
    from agents.redis_store import RedisStore

__all__ = [
    "SESSION_ID_PATTERN",
    "InvalidSessionIdError",
    "MemoryStore",
    "PutMode",
    "RedisStore",
    "Session",
    "SessionInfo",
    "SessionLimitError",
    "Store",
    "AgentGoneError",
    "StoreError",
    "StoreUnavailableError",
    "open_store",
]

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


@dataclass
class _MemSession:
    messages: list[str]  # JSON strings, so callers never share mutable state with the store
    created: float
    updated: float
    expires_at: float | None
    owner: str | None = None

    def live(self, now: float) -> bool:
        return self.expires_at is None or self.expires_at > now


class MemoryStore(Store):
    """In-process store (the default). Lost on restart; not shared between processes."""

    def __init__(self, *, session_ttl: float | None = None, max_sessions_per_agent: int | None = None) -> None:
        super().__init__(session_ttl=session_ttl, max_sessions_per_agent=max_sessions_per_agent)
        self._agents: dict[str, str] = {}
        self._sessions: dict[str, dict[str, _MemSession]] = {}
        self._turns: dict[tuple[str, str], tuple[str, float]] = {}  # (agent, sid) -> (token, lapses at)
        self._requests: dict[tuple[str, str], tuple[str | None, float]] = {}  # (scope, key) -> (answer, expiry)
        self._responses: dict[str, tuple[str, float]] = {}  # response id -> (record JSON, expiry)
        # No awaits inside the operations, so they are atomic within one event loop; the lock covers
        # callers on other threads.
        self._lock = threading.Lock()

    async def put_agent(self, spec: AgentSpec, mode: PutMode = "upsert") -> bool:
        with self._lock:
            exists = spec.name in self._agents
            if (mode == "create" and exists) or (mode == "update" and not exists):
                return False
            self._agents[spec.name] = spec.to_json()
            return True

    async def get_agent(self, name: str) -> AgentSpec | None:
        with self._lock:
            raw = self._agents.get(name)
        return None if raw is None else load_agent(raw)

    async def delete_agent(self, name: str) -> bool:
        with self._lock:
            self._sessions.pop(name, None)
            return self._agents.pop(name, None) is not None

    async def list_agents(self) -> list[AgentSpec]:
        with self._lock:
            raws = [self._agents[n] for n in sorted(self._agents)]
        return [load_agent(r) for r in raws]

    def _live(self, agent: str, now: float) -> dict[str, _MemSession]:
        """The agent's sessions with expired ones dropped (expiry is lazy: checked on access)."""
        sessions = self._sessions.setdefault(agent, {})
        for sid in [s for s, v in sessions.items() if not v.live(now)]:
            del sessions[sid]
        if not sessions:  # keep no empty entries for names that were merely looked up
            del self._sessions[agent]
        return sessions

    async def get_session(self, agent: str, sid: str) -> Session | None:
        check_session_key(agent, sid)
        with self._lock:
            entry = self._sessions.get(agent, {}).get(sid)
            if entry is None or not entry.live(time.time()):
                return None
            return _snapshot(agent, sid, entry)

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
        check_session_key(agent, sid)
        encoded = encode_messages(new_messages)
        ttl, limit = self._ttl(ttl), self._limit(max_sessions)
        with self._lock:
            if require_agent and agent not in self._agents:
                raise AgentGoneError(agent)
            now = time.time()
            sessions = self._live(agent, now)
            entry = sessions.get(sid)
            if entry is None:
                if limit is not None and len(sessions) >= limit:
                    raise SessionLimitError(agent, limit)
                entry = _MemSession([], now, now, None, owner)
                self._sessions.setdefault(agent, sessions)[sid] = entry
            entry.messages.extend(encoded)
            entry.updated = now
            entry.expires_at = now + ttl if ttl else None
            return _snapshot(agent, sid, entry)

    async def delete_session(self, agent: str, sid: str) -> bool:
        check_session_key(agent, sid)
        with self._lock:
            entry = self._sessions.get(agent, {}).pop(sid, None)
            return entry is not None and entry.live(time.time())

    async def list_sessions(self, agent: str) -> list[SessionInfo]:
        if not AgentSpec.is_valid_name(agent):
            raise ValueError(f"invalid agent name {agent!r}")
        with self._lock:
            sessions = self._live(agent, time.time())
            infos = [
                SessionInfo(agent, sid, e.created, e.updated, e.expires_at, len(e.messages), e.owner)
                for sid, e in sessions.items()
            ]
        return sorted(infos, key=lambda i: (-i.updated, i.id))


    async def begin_turn(self, agent: str, sid: str, lease_s: float) -> str | None:
        check_session_key(agent, sid)
        with self._lock:
            now = time.monotonic()
            held = self._turns.get((agent, sid))
            if held is not None and held[1] > now:
                return None
            token = secrets.token_hex(16)
            self._turns[(agent, sid)] = (token, now + lease_s)
            return token

    async def renew_turn(self, agent: str, sid: str, token: str, lease_s: float) -> bool:
        with self._lock:
            held = self._turns.get((agent, sid))
            if held is None or held[0] != token or held[1] <= time.monotonic():
                return False
            self._turns[(agent, sid)] = (token, time.monotonic() + lease_s)
            return True

    async def end_turn(self, agent: str, sid: str, token: str) -> None:
        with self._lock:
            if self._turns.get((agent, sid), ("",))[0] == token:
                del self._turns[(agent, sid)]


    async def claim_request(self, scope: str, key: str, ttl_s: float) -> tuple[str, str | None]:
        with self._lock:
            now = time.monotonic()
            held = self._requests.get((scope, key))
            if held is not None and held[1] > now:
                return ("running", None) if held[0] is None else ("done", held[0])
            self._requests = {k: v for k, v in self._requests.items() if v[1] > now}  # forget expired keys
            self._requests[(scope, key)] = (None, now + ttl_s)
            return "claimed", None

    async def renew_request(self, scope: str, key: str, ttl_s: float) -> bool:
        with self._lock:
            held = self._requests.get((scope, key))
            if held is None or held[0] is not None or held[1] <= time.monotonic():
                return False
            self._requests[(scope, key)] = (None, time.monotonic() + ttl_s)
            return True

    async def finish_request(self, scope: str, key: str, answer: str, ttl_s: float) -> None:
        with self._lock:
            self._requests[(scope, key)] = (answer, time.monotonic() + ttl_s)

    async def abandon_request(self, scope: str, key: str) -> None:
        with self._lock:
            self._requests.pop((scope, key), None)


    async def put_response(self, response_id: str, record: dict[str, Any], ttl_s: float | None) -> None:
        encoded = json.dumps(record, ensure_ascii=False)
        with self._lock:
            now = time.monotonic()
            self._responses = {k: v for k, v in self._responses.items() if v[1] > now}  # forget expired ones
            self._responses[response_id] = (encoded, now + ttl_s if ttl_s else float("inf"))

    async def get_response(self, response_id: str) -> dict[str, Any] | None:
        with self._lock:
            held = self._responses.get(response_id)
            return json.loads(held[0]) if held is not None and held[1] > time.monotonic() else None

    async def delete_response(self, response_id: str) -> bool:
        with self._lock:
            held = self._responses.pop(response_id, None)
            return held is not None and held[1] > time.monotonic()


def _snapshot(agent: str, sid: str, entry: _MemSession) -> Session:
    messages = [json.loads(m) for m in entry.messages]
    return Session(agent, sid, messages, entry.created, entry.updated, entry.expires_at, entry.owner)


def open_store(
    url: str | None = None, *, session_ttl: float | None = None, max_sessions_per_agent: int | None = None
) -> Store:
    """A store for ``url``: None or "memory://" -> `MemoryStore`; "redis://", "rediss://", "unix://" ->
    `RedisStore`."""
    options = {"session_ttl": session_ttl, "max_sessions_per_agent": max_sessions_per_agent}
    if url is None or url == "memory://":
        return MemoryStore(**options)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from agents.redis_store import RedisStore

        return RedisStore(url, **options)
    raise ValueError(f"unsupported store url {url!r}: use memory:// or redis://host:port/db")


def __getattr__(name: str) -> Any:
    # Lazy, so the redis client is imported only by deployments that use it.
    if name == "RedisStore":
        from agents.redis_store import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
