"""`MemoryStore`: the `Store` contract in one process's memory (tests, a single server without Redis)."""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from agents.spec import AgentSpec
from agents.store.base import (
    AgentGoneError,
    PutMode,
    Session,
    SessionInfo,
    SessionLimitError,
    Store,
    check_session_key,
    encode_messages,
    load_agent,
)


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
