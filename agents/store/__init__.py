"""Persistence for admin-created agents and per-agent sessions: the `Store` contract (`base`), kept in
memory (`memory.MemoryStore`) or in Redis for several servers sharing one (`redis_store.RedisStore`, whose
client is imported only when a Redis URL is opened). `open_store` picks one by URL."""

from __future__ import annotations

from agents.store.base import (
    SESSION_ID_PATTERN,
    AgentGoneError,
    InvalidSessionIdError,
    PutMode,
    Session,
    SessionInfo,
    SessionLimitError,
    Store,
    StoreError,
    StoreUnavailableError,
)
from agents.store.memory import MemoryStore

__all__ = [
    "SESSION_ID_PATTERN",
    "AgentGoneError",
    "InvalidSessionIdError",
    "MemoryStore",
    "PutMode",
    "Session",
    "SessionInfo",
    "SessionLimitError",
    "Store",
    "StoreError",
    "StoreUnavailableError",
    "open_store",
]


def open_store(
    url: str | None = None, *, session_ttl: float | None = None, max_sessions_per_agent: int | None = None
) -> Store:
    """A store for ``url``: None or "memory://" -> `MemoryStore`; "redis://", "rediss://", "unix://" ->
    `RedisStore`."""
    options = {"session_ttl": session_ttl, "max_sessions_per_agent": max_sessions_per_agent}
    if url is None or url == "memory://":
        return MemoryStore(**options)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from agents.store.redis_store import RedisStore

        return RedisStore(url, **options)
    raise ValueError(f"unsupported store url {url!r}: use memory:// or redis://host:port/db")
