"""Servers on a real Redis (a private redis-server on a free port): sessions survive a restart, and two
servers sharing one Redis see the same agents and sessions."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
from test_server_helpers import LiveServer, RedisServer, server_config, tiny_runtime, wait_until

from server.app import create_app


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server.url
    finally:
        server.stop()


def make_server(redis_url: str, prefix: str) -> LiveServer:
    config = server_config(store__url=redis_url, store__prefix=prefix)
    return LiveServer(create_app(config, runtime=tiny_runtime()))


def test_sessions_survive_a_restart(redis_url):
    prefix = f"t-{uuid.uuid4().hex[:8]}:"
    sid = "survivor"
    with make_server(redis_url, prefix) as first:
        c = openai.OpenAI(base_url=f"{first.url}/agents/assistant/v1", api_key="x", max_retries=0)
        r1 = c.chat.completions.create(model="assistant", messages=[{"role": "user", "content": "Remember 42."}],
                                       max_tokens=2, extra_headers={"X-Session-Id": sid})
    with make_server(redis_url, prefix) as second:  # a new app: nothing in process memory carries over
        stored = httpx.get(f"{second.url}/agents/assistant/v1/sessions/{sid}").json()
        assert stored["messages"][0]["content"] == "Remember 42."
        assert stored["messages"][1]["content"] == r1.choices[0].message.content
        c = openai.OpenAI(base_url=f"{second.url}/agents/assistant/v1", api_key="x", max_retries=0)
        r2 = c.chat.completions.create(model="assistant", messages=[{"role": "user", "content": "Which number?"}],
                                       max_tokens=2, extra_headers={"X-Session-Id": sid})
        assert r2.usage.prompt_tokens > r1.usage.prompt_tokens + r1.usage.completion_tokens
        stored = httpx.get(f"{second.url}/agents/assistant/v1/sessions/{sid}").json()
        assert len(stored["messages"]) == 4


def test_two_servers_share_agents_and_sessions(redis_url):
    prefix = f"t-{uuid.uuid4().hex[:8]}:"
    with make_server(redis_url, prefix) as a, make_server(redis_url, prefix) as b:
        r = httpx.post(f"{a.url}/admin/agents", json={"name": "shared", "system_prompt": "Shared agent.",
                                                      "defaults": {"max_tokens": 2}})
        assert r.status_code == 201
        assert "shared" in [m.id for m in openai.OpenAI(base_url=f"{b.url}/v1", api_key="x").models.list()]
        cb = openai.OpenAI(base_url=f"{b.url}/agents/shared/v1", api_key="x", max_retries=0)
        cb.chat.completions.create(model="shared", messages=[{"role": "user", "content": "one"}],
                                   extra_body={"session_id": "s"})
        ca = openai.OpenAI(base_url=f"{a.url}/v1", api_key="x", max_retries=0)
        ca.chat.completions.create(model="shared", messages=[{"role": "user", "content": "two"}],
                                   extra_body={"session_id": "s"})
        for srv in (a, b):
            stored = httpx.get(f"{srv.url}/agents/shared/v1/sessions/s").json()["messages"]
            assert [m["content"] for m in stored if m["role"] == "user"] == ["one", "two"]
        # deleting the agent on one server removes it and its sessions for both
        assert httpx.delete(f"{b.url}/admin/agents/shared").status_code == 200
        assert httpx.get(f"{b.url}/admin/agents/shared").status_code == 404
        assert httpx.get(f"{a.url}/agents/shared/v1/sessions/s").status_code == 404


def test_a_response_stored_by_one_server_is_chained_on_another(redis_url):
    prefix = f"t-{uuid.uuid4().hex[:8]}:"
    with make_server(redis_url, prefix) as a, make_server(redis_url, prefix) as b:
        ca = openai.OpenAI(base_url=f"{a.url}/agents/assistant/v1", api_key="x", max_retries=0)
        cb = openai.OpenAI(base_url=f"{b.url}/agents/assistant/v1", api_key="x", max_retries=0)
        first = ca.responses.create(model="assistant", input="Remember 42.", max_output_tokens=2)
        assert cb.responses.retrieve(first.id).output_text == first.output_text
        second = cb.responses.create(model="assistant", input="Which?", previous_response_id=first.id,
                                     max_output_tokens=2)
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        assert ca.responses.retrieve(second.id).previous_response_id == first.id


def test_a_stalled_redis_is_a_prompt_503_that_names_no_address(tmp_path):
    """redis-server stopped with SIGSTOP (it accepts nothing and answers nothing): a session request fails
    within the store's timeout with 503 store_unavailable, /ready says the store is unavailable, no body
    carries the Redis address; after SIGCONT everything answers again."""
    import os
    import signal
    import time

    from test_server_helpers import RedisServer

    redis_server = RedisServer(tmp_path)
    try:
        config = server_config(store__url=redis_server.url, store__prefix="stall:", store__timeout_s=0.5)
        with LiveServer(create_app(config, runtime=tiny_runtime())) as srv:
            body = {"model": "assistant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                    "session_id": "stalled"}
            assert httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            try:
                begin = time.perf_counter()
                r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
                assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
                assert time.perf_counter() - begin < 5
                assert str(redis_server.port) not in r.text and "127.0.0.1" not in r.text
                assert r.headers.get("retry-after")
                ready = httpx.get(f"{srv.url}/ready", timeout=30)
                assert ready.status_code == 503 and ready.json()["store"] == "unavailable"
                listing = httpx.get(f"{srv.url}/agents/assistant/v1/sessions", timeout=30)
                assert listing.status_code == 503 and str(redis_server.port) not in listing.text
            finally:
                os.kill(redis_server.proc.pid, signal.SIGCONT)
            wait_until(lambda: httpx.get(f"{srv.url}/ready", timeout=30).status_code == 200, timeout=30)
            assert httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    finally:
        redis_server.stop()
