"""`RedisStore`: the `Store` contract on Redis (redis.asyncio), for several servers sharing one Redis.

Layout (``prefix`` defaults to "slotserve:"; the ``{agent}`` hash tag keeps one agent's keys in one
cluster slot, so its scripts stay single-slot):

* ``<prefix>agents``: hash, agent name -> AgentSpec JSON.
* ``<prefix>{<agent>}:s:<sid>:msgs``: list of message JSON strings (RPUSH appends).
* ``<prefix>{<agent>}:s:<sid>:meta``: hash with ``created``, ``updated``, ``expires`` (ms, server clock).
* ``<prefix>{<agent>}:index``: sorted set, sid -> expiry in ms (``+inf`` when none), for listing and
  counting live sessions against the limit.

Every session write is one Lua script, so it is atomic: two servers appending to one session never lose
a turn, and the limit check cannot race a concurrent create. Times come from Redis' own clock
(``TIME``), so app servers with skewed clocks agree on expiry.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from agents.spec import AgentSpec
from agents.store.base import (
    AgentGoneError,
    PutMode,
    Session,
    SessionInfo,
    SessionLimitError,
    Store,
    StoreUnavailableError,
    check_session_key,
    encode_messages,
    load_agent,
)

__all__ = ["RedisStore"]

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: msgs, meta, index, agents hash. ARGV: sid, ttl_ms (0 = none), limit (0 = none), owner ('' = none),
# agent name to require in the agents hash ('' = none), message JSON...
_APPEND = (
    _NOW_MS
    + """
local ttl, limit = tonumber(ARGV[2]), tonumber(ARGV[3])
if ARGV[5] ~= '' and redis.call('HEXISTS', KEYS[4], ARGV[5]) == 0 then return {'GONE'} end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[1])
  local count = redis.call('ZCARD', KEYS[3])
  if redis.call('ZSCORE', KEYS[3], ARGV[1]) then count = count - 1 end
  if limit > 0 and count >= limit then return {'LIMIT'} end
  redis.call('HSET', KEYS[2], 'created', now)
  if ARGV[4] ~= '' then redis.call('HSET', KEYS[2], 'owner', ARGV[4]) end
end
redis.call('HSET', KEYS[2], 'updated', now)
for i = 6, #ARGV do redis.call('RPUSH', KEYS[1], ARGV[i]) end
local score = '+inf'
if ttl > 0 then
  score = now + ttl
  redis.call('HSET', KEYS[2], 'expires', score)
  redis.call('PEXPIREAT', KEYS[1], score)
  redis.call('PEXPIREAT', KEYS[2], score)
else
  redis.call('HDEL', KEYS[2], 'expires')
  redis.call('PERSIST', KEYS[1])
  redis.call('PERSIST', KEYS[2])
end
redis.call('ZADD', KEYS[3], score, ARGV[1])
local meta = redis.call('HMGET', KEYS[2], 'created', 'updated', 'expires', 'owner')
return {'OK', meta[1], meta[2], meta[3], meta[4], redis.call('LRANGE', KEYS[1], 0, -1)}
"""
)

# KEYS: agents hash. ARGV: name, spec JSON. Replaces only an existing agent.
_UPDATE_AGENT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# KEYS: msgs, meta, index. ARGV: sid. Returns 1 when a live session was removed.
_DELETE_SESSION = """
local existed = redis.call('EXISTS', KEYS[2])
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
return existed
"""

# KEYS: index. ARGV: key prefix of this agent's sessions. Deletes every session of one agent.
_PURGE_AGENT = """
local sids = redis.call('ZRANGE', KEYS[1], 0, -1)
for _, sid in ipairs(sids) do
  redis.call('DEL', ARGV[1] .. sid .. ':msgs', ARGV[1] .. sid .. ':meta')
end
redis.call('DEL', KEYS[1])
return #sids
"""


T = TypeVar("T")


def _guarded(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Bound a store call by the store's timeout, and report a Redis that is down, slow or refusing as
    `StoreUnavailableError` (without its address: error bodies reach clients)."""

    @functools.wraps(method)
    async def call(self: RedisStore, *args: Any, **kwargs: Any) -> T:
        try:
            return await asyncio.wait_for(method(self, *args, **kwargs), self.timeout_s)
        except (RedisError, OSError, TimeoutError) as e:
            raise StoreUnavailableError(f"the session store is unavailable ({type(e).__name__})") from None

    return call


# KEYS: the session's turn key. ARGV: token, lease ms. Extends the claim if it is still this token's.
_RENEW_TURN = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: the session's turn key. ARGV: token. Releases the claim if it is still this token's.
_END_TURN = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


# KEYS: the request's idempotency key. ARGV: ttl ms. Claims it ('running') or reports what it holds.
_CLAIM_REQUEST = """
local held = redis.call('GET', KEYS[1])
if not held then
  redis.call('SET', KEYS[1], 'running', 'PX', ARGV[1])
  return {'claimed'}
end
if held == 'running' then return {'running'} end
return {'done', string.sub(held, 6)}
"""

# KEYS: the request's idempotency key. ARGV: ttl ms. Extends the claim while it is still running.
_RENEW_REQUEST = """
if redis.call('GET', KEYS[1]) ~= 'running' then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""


def _seconds(ms: Any) -> float | None:
    return None if ms is None else int(ms) / 1000.0


def _session(agent: str, sid: str, created: Any, updated: Any, expires: Any, owner: str | None,
             raw: list[str]) -> Session:
    return Session(agent, sid, [json.loads(m) for m in raw], int(created) / 1000.0, int(updated) / 1000.0,
                   _seconds(expires), owner or None)


DEFAULT_PREFIX = "slotserve:"  # every key starts with it
DEFAULT_TIMEOUT_S = 2.0  # bound on each Redis call


class RedisStore(Store):
    """`Store` on Redis. ``url`` as for ``redis.asyncio.from_url`` (e.g. "redis://127.0.0.1:6379/0").
    ``timeout_s`` bounds every call (connect, each reply, and the whole operation); one retry on a dropped
    connection."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        session_ttl: float | None = None,
        max_sessions_per_agent: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(session_ttl=session_ttl, max_sessions_per_agent=max_sessions_per_agent)
        self.timeout_s = timeout_s
        self._redis = redis.from_url(url, decode_responses=True, socket_connect_timeout=timeout_s,
                                     socket_timeout=timeout_s, retry=Retry(NoBackoff(), 1))
        self._prefix = prefix
        self._append = self._redis.register_script(_APPEND)
        self._update_agent = self._redis.register_script(_UPDATE_AGENT)
        self._delete_session = self._redis.register_script(_DELETE_SESSION)
        self._purge_agent = self._redis.register_script(_PURGE_AGENT)
        self._renew_turn = self._redis.register_script(_RENEW_TURN)
        self._cleanups: set[asyncio.Task] = set()  # claims to take back once Redis answers again
        self._end_turn = self._redis.register_script(_END_TURN)
        self._claim_request = self._redis.register_script(_CLAIM_REQUEST)
        self._renew_request = self._redis.register_script(_RENEW_REQUEST)

    # ---- keys -----------------------------------------------------------------------------------

    @property
    def _agents_key(self) -> str:
        return f"{self._prefix}agents"

    def _session_prefix(self, agent: str) -> str:
        return f"{self._prefix}{{{agent}}}:s:"

    def _index_key(self, agent: str) -> str:
        return f"{self._prefix}{{{agent}}}:index"

    def _session_keys(self, agent: str, sid: str) -> list[str]:
        base = self._session_prefix(agent) + sid
        return [f"{base}:msgs", f"{base}:meta", self._index_key(agent)]

    # ---- agents ---------------------------------------------------------------------------------

    @_guarded
    async def put_agent(self, spec: AgentSpec, mode: PutMode = "upsert") -> bool:
        data = spec.to_json()
        if mode == "create":
            return bool(await self._redis.hsetnx(self._agents_key, spec.name, data))
        if mode == "update":
            return bool(await self._update_agent(keys=[self._agents_key], args=[spec.name, data]))
        await self._redis.hset(self._agents_key, spec.name, data)
        return True

    @_guarded
    async def get_agent(self, name: str) -> AgentSpec | None:
        raw = await self._redis.hget(self._agents_key, name)
        return None if raw is None else load_agent(raw)

    @_guarded
    async def delete_agent(self, name: str) -> bool:
        removed = await self._redis.hdel(self._agents_key, name)
        if AgentSpec.is_valid_name(name):
            await self._purge_agent(keys=[self._index_key(name)], args=[self._session_prefix(name)])
        return bool(removed)

    @_guarded
    async def list_agents(self) -> list[AgentSpec]:
        raws = await self._redis.hgetall(self._agents_key)
        return [load_agent(raws[n]) for n in sorted(raws)]

    # ---- sessions -------------------------------------------------------------------------------

    @_guarded
    async def get_session(self, agent: str, sid: str) -> Session | None:
        check_session_key(agent, sid)
        msgs_key, meta_key, _ = self._session_keys(agent, sid)
        async with self._redis.pipeline(transaction=True) as pipe:  # one consistent snapshot
            pipe.hmget(meta_key, "created", "updated", "expires", "owner")
            pipe.lrange(msgs_key, 0, -1)
            (created, updated, expires, owner), raw = await pipe.execute()
        if created is None:
            return None
        return _session(agent, sid, created, updated, expires, owner, raw)

    @_guarded
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
        ttl_ms = max(1, round(ttl * 1000)) if ttl else 0
        reply = await self._append(keys=[*self._session_keys(agent, sid), self._agents_key],
                                   args=[sid, ttl_ms, limit or 0, owner or "", agent if require_agent else "",
                                         *encoded])
        if reply[0] == "LIMIT":
            raise SessionLimitError(agent, limit or 0)
        if reply[0] == "GONE":
            raise AgentGoneError(agent)
        _, created, updated, expires, stored_owner, raw = reply
        return _session(agent, sid, created, updated, expires, stored_owner, raw)

    @_guarded
    async def delete_session(self, agent: str, sid: str) -> bool:
        check_session_key(agent, sid)
        return bool(await self._delete_session(keys=self._session_keys(agent, sid), args=[sid]))

    @_guarded
    async def list_sessions(self, agent: str) -> list[SessionInfo]:
        if not AgentSpec.is_valid_name(agent):
            raise ValueError(f"invalid agent name {agent!r}")
        index = self._index_key(agent)
        now_s, now_us = await self._redis.time()
        await self._redis.zremrangebyscore(index, "-inf", now_s * 1000 + now_us // 1000)
        sids = await self._redis.zrange(index, 0, -1)
        if not sids:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for sid in sids:
                msgs_key, meta_key, _ = self._session_keys(agent, sid)
                pipe.hmget(meta_key, "created", "updated", "expires", "owner")
                pipe.llen(msgs_key)
            replies = await pipe.execute()
        infos = []
        for i, sid in enumerate(sids):
            (created, updated, expires, owner), count = replies[2 * i], replies[2 * i + 1]
            if created is not None:  # expired or deleted between the two reads
                infos.append(SessionInfo(agent, sid, _seconds(created), _seconds(updated), _seconds(expires), count,
                                         owner or None))
        return sorted(infos, key=lambda i: (-i.updated, i.id))

    def _turn_key(self, agent: str, sid: str) -> str:
        return self._session_prefix(agent) + sid + ":turn"

    async def begin_turn(self, agent: str, sid: str, lease_s: float) -> str | None:
        check_session_key(agent, sid)
        token = secrets.token_hex(16)
        try:
            return token if await self._claim(self._turn_key(agent, sid), token, lease_s) else None
        except StoreUnavailableError:
            # The SET may still reach Redis once it answers again: take the claim back then, rather than leave
            # the session locked for a whole lease by a turn that never ran.
            task = asyncio.create_task(self._release_when_back(agent, sid, token, lease_s))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)
            raise

    @_guarded
    async def _claim(self, key: str, token: str, lease_s: float) -> bool:
        return bool(await self._redis.set(key, token, nx=True, px=max(1, round(lease_s * 1000))))

    async def _release_when_back(self, agent: str, sid: str, token: str, lease_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + lease_s
        while asyncio.get_running_loop().time() < deadline:
            try:
                await self.end_turn(agent, sid, token)
                return
            except StoreUnavailableError:
                await asyncio.sleep(min(1.0, self.timeout_s))

    @_guarded
    async def renew_turn(self, agent: str, sid: str, token: str, lease_s: float) -> bool:
        return bool(await self._renew_turn(keys=[self._turn_key(agent, sid)],
                                           args=[token, max(1, round(lease_s * 1000))]))

    @_guarded
    async def end_turn(self, agent: str, sid: str, token: str) -> None:
        await self._end_turn(keys=[self._turn_key(agent, sid)], args=[token])

    def _request_key(self, scope: str, key: str) -> str:
        digest = hashlib.sha256(f"{scope}\0{key}".encode()).hexdigest()  # any scope and key text, a fixed length
        return f"{self._prefix}request:{digest}"

    @_guarded
    async def claim_request(self, scope: str, key: str, ttl_s: float) -> tuple[str, str | None]:
        reply = await self._claim_request(keys=[self._request_key(scope, key)], args=[max(1, round(ttl_s * 1000))])
        return (reply[0], reply[1] if len(reply) > 1 else None)

    @_guarded
    async def renew_request(self, scope: str, key: str, ttl_s: float) -> bool:
        return bool(await self._renew_request(keys=[self._request_key(scope, key)], args=[max(1, round(ttl_s * 1000))]))

    @_guarded
    async def finish_request(self, scope: str, key: str, answer: str, ttl_s: float) -> None:
        await self._redis.set(self._request_key(scope, key), "done:" + answer, px=max(1, round(ttl_s * 1000)))

    @_guarded
    async def abandon_request(self, scope: str, key: str) -> None:
        await self._redis.delete(self._request_key(scope, key))

    def _response_key(self, response_id: str) -> str:
        return f"{self._prefix}response:{response_id}"

    @_guarded
    async def put_response(self, response_id: str, record: dict[str, Any], ttl_s: float | None) -> None:
        px = max(1, round(ttl_s * 1000)) if ttl_s else None
        await self._redis.set(self._response_key(response_id), json.dumps(record, ensure_ascii=False), px=px)

    @_guarded
    async def get_response(self, response_id: str) -> dict[str, Any] | None:
        raw = await self._redis.get(self._response_key(response_id))
        return json.loads(raw) if raw is not None else None

    @_guarded
    async def delete_response(self, response_id: str) -> bool:
        return bool(await self._redis.delete(self._response_key(response_id)))

    @_guarded
    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        for task in list(self._cleanups):
            task.cancel()
        await self._redis.aclose()
