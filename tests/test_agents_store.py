"""agents.store: one contract, run against MemoryStore and a RedisStore on a real redis-server.

The Redis tests start their own ``redis-server`` on a free loopback port (never the machine's usual
6379), with persistence off; each test uses its own key prefix.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis

from agents.messages import MessageError
from agents.registry import AgentConflictError, AgentRegistry, UnknownAgentError
from agents.spec import AgentSpec
from agents.store import (
    InvalidSessionIdError,
    MemoryStore,
    SessionLimitError,
    Store,
    StoreError,
    open_store,
)
from agents.store.redis_store import RedisStore

StoreFactory = Callable[..., Store]

# --------------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    """A private redis-server for this module: loopback only, no RDB/AOF files."""
    binary = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin:/usr/sbin")
    if binary is None:
        pytest.fail("redis-server not found: install the Debian package `redis-server` (apt-get install redis-server)")
    workdir = tmp_path_factory.mktemp("redis")
    for _attempt in range(3):  # the free port can be taken between probing and binding
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        if proc.poll() is None:
            break
    else:
        pytest.fail("could not start redis-server on a free loopback port")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(params=["memory", "redis"])
def make_store(request) -> StoreFactory:
    """A factory of stores. Redis stores made by one factory share one key prefix (one "deployment")."""
    if request.param == "memory":
        return lambda **kw: MemoryStore(**kw)
    url = request.getfixturevalue("redis_url")
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    return lambda **kw: RedisStore(url, prefix=prefix, **kw)


@pytest.fixture
def redis_factory(redis_url) -> StoreFactory:
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    return lambda **kw: RedisStore(redis_url, prefix=prefix, **kw)


def run(make: StoreFactory, body: Callable[[Store], Awaitable[Any]], **options: Any) -> Any:
    """Run ``body(store)`` in a fresh event loop (the redis client binds to its loop), then close."""

    async def main() -> Any:
        store = make(**options)
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def spec(name: str, **fields: Any) -> AgentSpec:
    return AgentSpec(name=name, system_prompt=f"You are {name}.", **fields)


# --------------------------------------------------------------------------------------------------
# contract: sessions
# --------------------------------------------------------------------------------------------------


def test_append_creates_then_extends(make_store):
    async def body(store: Store):
        assert await store.get_session("a", "s1") is None
        first = await store.append_turn("a", "s1", [user("hi"), assistant("hello")])
        assert [m["content"] for m in first.messages] == ["hi", "hello"]
        assert first.agent == "a" and first.id == "s1"
        assert first.created == first.updated and first.expires_at is None
        await asyncio.sleep(0.01)
        second = await store.append_turn("a", "s1", [user("again")])
        assert [m["content"] for m in second.messages] == ["hi", "hello", "again"]
        assert second.created == first.created and second.updated > first.updated
        got = await store.get_session("a", "s1")
        assert got == second
        assert got.info().message_count == 3

    run(make_store, body)


def test_messages_are_normalised_json(make_store):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "extra": 1},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "42"},
    ]

    async def body(store: Store):
        session = await store.append_turn("a", "s", messages)
        assert session.messages == [
            {"role": "user", "content": "ab"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"x":1}'}, "id": "c1"}]},
            {"role": "tool", "content": "42", "name": "f", "tool_call_id": "c1"},
        ]
        json.dumps(session.messages)  # JSON all the way
        with pytest.raises(MessageError, match="role"):
            await store.append_turn("a", "s", [{"role": "wizard", "content": "x"}])
        with pytest.raises(MessageError, match="only text parts"):
            await store.append_turn("a", "s", [{"role": "user", "content": [{"type": "image_url"}]}])
        with pytest.raises(MessageError, match="JSON"):
            bad = {**call, "function": {"name": "f", "arguments": {"x": {1, 2}}}}
            await store.append_turn("a", "s", [{"role": "assistant", "tool_calls": [bad]}])
        with pytest.raises(ValueError, match="at least one message"):
            await store.append_turn("a", "s", [])
        assert len((await store.get_session("a", "s")).messages) == 3  # failed appends added nothing

    run(make_store, body)


def test_returned_sessions_are_copies(make_store):
    async def body(store: Store):
        session = await store.append_turn("a", "s", [user("hi")])
        session.messages[0]["content"] = "tampered"
        session.messages.append(user("extra"))
        assert (await store.get_session("a", "s")).messages == [user("hi")]

    run(make_store, body)


def test_sessions_are_namespaced_per_agent(make_store):
    async def body(store: Store):
        await store.append_turn("alpha", "same-id", [user("alpha's secret")])
        await store.append_turn("beta", "same-id", [user("beta's secret")])
        assert (await store.get_session("alpha", "same-id")).messages == [user("alpha's secret")]
        assert (await store.get_session("beta", "same-id")).messages == [user("beta's secret")]
        assert await store.get_session("gamma", "same-id") is None
        assert await store.delete_session("alpha", "same-id") is True
        assert await store.get_session("alpha", "same-id") is None
        assert (await store.get_session("beta", "same-id")).messages == [user("beta's secret")]
        assert [i.id for i in await store.list_sessions("beta")] == ["same-id"]
        assert await store.list_sessions("alpha") == []

    run(make_store, body)


def test_delete_and_list_sessions(make_store):
    async def body(store: Store):
        for sid in ("s1", "s2", "s3"):
            await store.append_turn("a", sid, [user(sid)])
            await asyncio.sleep(0.01)
        await store.append_turn("a", "s1", [assistant("more")])
        infos = await store.list_sessions("a")
        assert [i.id for i in infos] == ["s1", "s3", "s2"]  # most recently updated first
        assert [i.message_count for i in infos] == [2, 1, 1]
        assert await store.delete_session("a", "s2") is True
        assert await store.delete_session("a", "s2") is False
        assert await store.delete_session("a", "never") is False
        assert [i.id for i in await store.list_sessions("a")] == ["s1", "s3"]

    run(make_store, body)


@pytest.mark.parametrize("sid", ["", "../etc", "a b", "x" * 129, "-leading", "a\nb", "ключ"])
def test_invalid_session_ids_are_refused(make_store, sid):
    async def body(store: Store):
        with pytest.raises(InvalidSessionIdError):
            await store.append_turn("a", sid, [user("x")])
        with pytest.raises(InvalidSessionIdError):
            await store.get_session("a", sid)
        with pytest.raises(InvalidSessionIdError):
            await store.delete_session("a", sid)

    run(make_store, body)


def test_invalid_agent_names_are_refused(make_store):
    async def body(store: Store):
        for agent in ("A", "a:b", "", "{a}"):
            with pytest.raises(ValueError, match="agent name"):
                await store.append_turn(agent, "s", [user("x")])
            with pytest.raises(ValueError, match="agent name"):
                await store.list_sessions(agent)

    run(make_store, body)


def test_session_limit_refuses_only_new_sessions(make_store):
    async def body(store: Store):
        await store.append_turn("a", "s1", [user("1")])
        await store.append_turn("a", "s2", [user("2")])
        with pytest.raises(SessionLimitError, match="2 sessions"):
            await store.append_turn("a", "s3", [user("3")])
        assert await store.get_session("a", "s3") is None
        await store.append_turn("a", "s1", [user("existing sessions still grow")])
        await store.append_turn("b", "s3", [user("other agents have their own count")])
        await store.append_turn("a", "s3", [user("a per-call override")], max_sessions=0)
        assert await store.delete_session("a", "s1")
        with pytest.raises(SessionLimitError):  # 2 sessions (s2, s3) remain
            await store.append_turn("a", "s4", [user("4")])
        assert await store.delete_session("a", "s2")
        await store.append_turn("a", "s4", [user("4")])
        assert sorted(i.id for i in await store.list_sessions("a")) == ["s3", "s4"]

    run(make_store, body, max_sessions_per_agent=2)


def test_ttl_expires_sessions_and_is_refreshed_by_writes(make_store):
    async def body(store: Store):
        session = await store.append_turn("a", "s", [user("1")])
        assert session.expires_at == pytest.approx(session.updated + 0.5, abs=0.01)
        await store.append_turn("a", "forever", [user("x")], ttl=0)
        assert (await store.get_session("a", "forever")).expires_at is None
        await asyncio.sleep(0.3)
        await store.append_turn("a", "s", [user("2")])  # refreshes: 0.5 s from now
        await asyncio.sleep(0.3)  # 0.6 s after creation, 0.3 s after the last write
        assert len((await store.get_session("a", "s")).messages) == 2
        await asyncio.sleep(0.4)
        assert await store.get_session("a", "s") is None
        assert [i.id for i in await store.list_sessions("a")] == ["forever"]
        # An expired session no longer counts against the limit, and its id starts afresh.
        fresh = await store.append_turn("a", "s", [user("new")], max_sessions=2)
        assert fresh.messages == [user("new")]

    run(make_store, body, session_ttl=0.5)


def test_concurrent_appends_lose_nothing(make_store):
    n = 40

    async def body(store: Store):
        # A second client: for Redis another connection pool, as another server would have.
        other = store if isinstance(store, MemoryStore) else make_store()
        try:
            appends = [s.append_turn("a", "busy", [user(f"{tag}{i}")]) for i in range(n)
                       for s, tag in ((store, "x"), (other, "y"))]
            results = await asyncio.gather(*appends)
        finally:
            if other is not store:
                await other.close()
        contents = [m["content"] for m in (await store.get_session("a", "busy")).messages]
        assert sorted(contents) == sorted([f"x{i}" for i in range(n)] + [f"y{i}" for i in range(n)])
        # Each append saw a consistent snapshot: its own message last, one more than some other append.
        assert sorted(len(r.messages) for r in results) == list(range(1, 2 * n + 1))

    run(make_store, body)


# --------------------------------------------------------------------------------------------------
# contract: agents
# --------------------------------------------------------------------------------------------------


def test_agent_put_modes(make_store):
    async def body(store: Store):
        a1 = spec("alpha", description="v1")
        assert await store.put_agent(a1, mode="update") is False
        assert await store.get_agent("alpha") is None
        assert await store.put_agent(a1, mode="create") is True
        assert await store.put_agent(spec("alpha", description="other"), mode="create") is False
        assert (await store.get_agent("alpha")) == a1
        assert await store.put_agent(spec("alpha", description="v2"), mode="update") is True
        assert (await store.get_agent("alpha")).description == "v2"
        assert await store.put_agent(spec("beta"), mode="upsert") is True
        assert [s.name for s in await store.list_agents()] == ["alpha", "beta"]

    run(make_store, body)


def test_deleting_an_agent_purges_its_sessions(make_store):
    async def body(store: Store):
        await store.put_agent(spec("alpha"))
        await store.append_turn("alpha", "s1", [user("private")])
        await store.append_turn("beta", "s1", [user("kept")])
        assert await store.delete_agent("alpha") is True
        assert await store.delete_agent("alpha") is False
        assert await store.get_agent("alpha") is None
        # A new agent under the old name must not inherit the old conversations.
        await store.put_agent(spec("alpha"), mode="create")
        assert await store.get_session("alpha", "s1") is None
        assert await store.list_sessions("alpha") == []
        assert (await store.get_session("beta", "s1")).messages == [user("kept")]

    run(make_store, body)


def test_agent_round_trip_keeps_every_field(make_store):
    full = AgentSpec(
        name="full",
        description="d",
        system_prompt="s",
        defaults={"temperature": 0.5, "top_k": 40, "stop": "END"},
        response_format={"type": "json_object"},
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        tool_choice="required",
        context_limit=100,
        priority=3,
        api_keys=["k1", "k2"],
    )

    async def body(store: Store):
        await store.put_agent(full)
        assert await store.get_agent("full") == full

    run(make_store, body)


def test_open_store():
    assert isinstance(open_store(None), MemoryStore)
    assert isinstance(open_store("memory://", session_ttl=5), MemoryStore)
    assert isinstance(open_store("redis://127.0.0.1:1/0"), RedisStore)  # connects lazily
    with pytest.raises(ValueError, match="unsupported store url"):
        open_store("postgres://x")
    with pytest.raises(ValueError):
        MemoryStore(session_ttl=-1)


# --------------------------------------------------------------------------------------------------
# Redis only: state shared between store objects (servers) and across restarts
# --------------------------------------------------------------------------------------------------


def test_redis_new_store_object_sees_committed_state(redis_factory):
    """A "restart": everything committed through one RedisStore is there for a fresh one."""

    async def write(store: Store):
        await store.put_agent(spec("alpha"))
        await store.append_turn("alpha", "s1", [user("before restart"), assistant("noted")])

    async def read(store: Store):
        assert (await store.get_agent("alpha")) == spec("alpha")
        session = await store.get_session("alpha", "s1")
        assert session.messages == [user("before restart"), assistant("noted")]
        return session

    run(redis_factory, write)
    session = run(redis_factory, read)  # a new object and a new event loop: nothing cached in-process
    assert session.created > 0


def test_redis_two_stores_share_agents_and_sessions(redis_factory):
    async def body(a: Store):
        b = redis_factory()
        try:
            await a.put_agent(spec("shared"))
            assert [s.name for s in await b.list_agents()] == ["shared"]
            await a.append_turn("shared", "s", [user("from server a")])
            await b.append_turn("shared", "s", [assistant("from server b")])
            assert (await a.get_session("shared", "s")).messages == [user("from server a"), assistant("from server b")]
            # Exactly one of two racing creates of one name wins.
            results = await asyncio.gather(a.put_agent(spec("race"), mode="create"),
                                           b.put_agent(spec("race"), mode="create"))
            assert sorted(results) == [False, True]
            assert await b.delete_session("shared", "s")
            assert await a.get_session("shared", "s") is None
        finally:
            await b.close()

    run(redis_factory, body)


def test_redis_session_limit_holds_under_racing_creates(redis_factory):
    async def body(a: Store):
        b = redis_factory(max_sessions_per_agent=3)
        try:
            attempts = [(a if i % 2 else b).append_turn("lim", f"s{i}", [user("x")]) for i in range(10)]
            results = await asyncio.gather(*attempts, return_exceptions=True)
        finally:
            await b.close()
        assert sum(not isinstance(r, BaseException) for r in results) == 3
        assert all(isinstance(r, SessionLimitError) for r in results if isinstance(r, BaseException))
        assert len(await a.list_sessions("lim")) == 3

    run(redis_factory, body, max_sessions_per_agent=3)


def test_redis_two_registries_share_admin_agents(redis_factory):
    async def body(store_a: Store):
        store_b = redis_factory()
        try:
            reg_a = AgentRegistry(store_a, None, cache_ttl=0)
            reg_b = AgentRegistry(store_b, None, cache_ttl=0)
            await reg_a.create(spec("admin-made"))
            assert (await reg_b.get("admin-made")).name == "admin-made"
            with pytest.raises(AgentConflictError):
                await reg_b.create(spec("admin-made"))
            await reg_b.delete("admin-made")
            with pytest.raises(UnknownAgentError):
                await reg_a.get("admin-made")
        finally:
            await store_b.close()

    run(redis_factory, body)


def test_redis_stores_json_and_key_ttls(redis_factory, redis_url):
    prefix_holder: dict[str, str] = {}

    async def body(store: Store):
        prefix_holder["p"] = store._prefix
        await store.put_agent(spec("alpha"))
        await store.append_turn("alpha", "s1", [user("hi")], ttl=30)

    run(redis_factory, body)
    p = prefix_holder["p"]
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        assert json.loads(raw.hget(f"{p}agents", "alpha"))["name"] == "alpha"
        assert [json.loads(m) for m in raw.lrange(f"{p}{{alpha}}:s:s1:msgs", 0, -1)] == [user("hi")]
        assert 0 < raw.pttl(f"{p}{{alpha}}:s:s1:msgs") <= 30_000
        assert 0 < raw.pttl(f"{p}{{alpha}}:s:s1:meta") <= 30_000
        # A corrupted agent entry is reported, not silently dropped.
        raw.hset(f"{p}agents", "broken", json.dumps({"name": "broken", "priority": 0}))
    finally:
        raw.close()

    async def read_broken(store: Store):
        with pytest.raises(StoreError, match="invalid"):
            await store.get_agent("broken")

    run(redis_factory, read_broken)


def test_a_session_turn_is_claimed_by_one_caller_at_a_time(make_store):
    """One claim per session across every store object of one deployment (two Redis clients stand in for two
    servers); a claim is released only by its own token, renewed while held, and lapses when not renewed."""

    async def body(store: Store) -> None:
        other = make_store() if isinstance(store, RedisStore) else store  # one process holds one memory store
        try:
            token = await store.begin_turn("a", "s1", lease_s=5)
            assert token and await other.begin_turn("a", "s1", lease_s=5) is None
            assert await other.begin_turn("a", "s2", lease_s=5)  # other sessions are free
            await other.end_turn("a", "s1", "not-the-token")
            assert await other.begin_turn("a", "s1", lease_s=5) is None
            assert await store.renew_turn("a", "s1", token, lease_s=5)
            assert not await other.renew_turn("a", "s1", "not-the-token", lease_s=5)
            await store.end_turn("a", "s1", token)
            again = await other.begin_turn("a", "s1", lease_s=0.2)
            assert again
            await asyncio.sleep(0.4)  # never renewed: a crashed holder frees the session on its own
            assert not await other.renew_turn("a", "s1", again, lease_s=5)
            assert await store.begin_turn("a", "s1", lease_s=5)
        finally:
            if other is not store:
                await other.close()

    run(make_store, body)


def test_a_turn_of_a_deleted_store_agent_is_not_stored(make_store):
    from agents.store import AgentGoneError

    async def body(store: Store) -> None:
        await store.put_agent(AgentSpec(name="gone"), "create")
        await store.append_turn("gone", "s", [{"role": "user", "content": "hi"}], require_agent=True)
        assert await store.delete_agent("gone")
        with pytest.raises(AgentGoneError):
            await store.append_turn("gone", "s", [{"role": "user", "content": "again"}], require_agent=True)
        assert await store.get_session("gone", "s") is None and await store.list_sessions("gone") == []
        # A file agent's turns (not required in the store) are stored as before.
        await store.append_turn("filed", "s", [{"role": "user", "content": "hi"}])
        assert await store.get_session("filed", "s") is not None

    run(make_store, body)


def test_idempotency_keys_claim_once_and_replay_the_answer(make_store):
    async def body(store: Store) -> None:
        assert await store.claim_request("agent\0owner", "k1", ttl_s=5) == ("claimed", None)
        assert await store.claim_request("agent\0owner", "k1", ttl_s=5) == ("running", None)
        assert await store.claim_request("agent\0other", "k1", ttl_s=5) == ("claimed", None)  # another scope
        await store.finish_request("agent\0owner", "k1", '{"answer": 1}', ttl_s=5)
        assert await store.claim_request("agent\0owner", "k1", ttl_s=5) == ("done", '{"answer": 1}')
        await store.abandon_request("agent\0other", "k1")
        assert await store.claim_request("agent\0other", "k1", ttl_s=0.2) == ("claimed", None)
        await asyncio.sleep(0.4)  # a claim that never finished lapses
        assert await store.claim_request("agent\0other", "k1", ttl_s=5) == ("claimed", None)

    run(make_store, body)


def test_a_renewed_idempotency_claim_stays_running_and_a_finished_one_is_not_renewed(make_store):
    async def body(store: Store) -> None:
        assert await store.claim_request("a\0o", "k", ttl_s=0.3) == ("claimed", None)
        for _ in range(3):  # renewed past its first lease: still running
            await asyncio.sleep(0.15)
            assert await store.renew_request("a\0o", "k", ttl_s=0.3)
        assert await store.claim_request("a\0o", "k", ttl_s=0.3) == ("running", None)
        await store.finish_request("a\0o", "k", '{"x": 1}', ttl_s=5)
        assert not await store.renew_request("a\0o", "k", ttl_s=0.3)  # a finished answer is not turned back
        assert await store.claim_request("a\0o", "k", ttl_s=0.3) == ("done", '{"x": 1}')
        assert not await store.renew_request("a\0o", "never", ttl_s=0.3)

    run(make_store, body)


def test_stored_responses_are_kept_read_back_and_deleted(make_store):
    async def body(store: Store) -> None:
        record = {"agent": "a", "session_id": "s", "point": 4, "owner": None, "response": {"id": "resp_1"}}
        await store.put_response("resp_1", record, ttl_s=5)
        assert await store.get_response("resp_1") == record
        assert await store.get_response("resp_2") is None
        assert await store.delete_response("resp_1") and not await store.delete_response("resp_1")
        assert await store.get_response("resp_1") is None
        await store.put_response("resp_3", record, ttl_s=0.2)
        await asyncio.sleep(0.4)
        assert await store.get_response("resp_3") is None  # expired with its session's time to live

    run(make_store, body)
