"""Auth on: admin key for /admin, per-agent keys for agent endpoints and their sessions."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_server_helpers import LiveServer, server_config, tiny_runtime

from server.app import create_app

ADMIN = "admin-secret"
USER = [{"role": "user", "content": "hi"}]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server():
    config = server_config(auth__enabled=True, auth__admin_keys=[ADMIN])
    with LiveServer(create_app(config, runtime=tiny_runtime())) as srv:
        for name, key in (("alpha", "key-a"), ("beta", "key-b")):
            r = httpx.post(f"{srv.url}/admin/agents", headers=bearer(ADMIN),
                           json={"name": name, "system_prompt": f"You are {name}.", "api_keys": [key]})
            assert r.status_code == 201, r.text
            assert "api_keys" not in r.json() and r.json()["auth_required"] is True
        yield srv


def test_admin_needs_the_admin_key(server):
    url = f"{server.url}/admin/agents"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers=bearer("key-a")).status_code == 403
    assert httpx.get(url, headers=bearer(ADMIN)).status_code == 200
    r = httpx.post(url, headers=bearer("key-a"), json={"name": "evil"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


def test_agent_keys_are_isolated(server):
    alpha = openai.OpenAI(base_url=f"{server.url}/agents/alpha/v1", api_key="key-a", max_retries=0)
    r = alpha.chat.completions.create(model="alpha", messages=USER, max_tokens=1)
    assert r.model == "alpha"
    beta_with_a = openai.OpenAI(base_url=f"{server.url}/agents/beta/v1", api_key="key-a", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        beta_with_a.chat.completions.create(model="beta", messages=USER, max_tokens=1)
    v1 = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-a", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        v1.chat.completions.create(model="beta", messages=USER, max_tokens=1)
    with pytest.raises(openai.PermissionDeniedError):  # file agents without keys are closed when auth is on
        v1.chat.completions.create(model="assistant", messages=USER, max_tokens=1)
    assert [m.id for m in v1.models.list()] == ["alpha"]
    r = httpx.post(f"{server.url}/agents/alpha/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    with pytest.raises(openai.PermissionDeniedError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="alpha", messages=USER, max_tokens=1)
    # the admin key may call any agent
    admin = openai.OpenAI(base_url=f"{server.url}/v1", api_key=ADMIN, max_retries=0)
    assert admin.chat.completions.create(model="beta", messages=USER, max_tokens=1).model == "beta"


def test_sessions_are_isolated(server):
    r = httpx.post(f"{server.url}/agents/alpha/v1/chat/completions", headers={**bearer("key-a"), "X-Session-Id": "s1"},
                   json={"messages": USER, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200
    own = httpx.get(f"{server.url}/agents/alpha/v1/sessions/s1", headers=bearer("key-a"))
    assert own.status_code == 200 and len(own.json()["messages"]) == 2
    # B's key cannot read A's session, A's key cannot reach B's (namespaced: B has no s1 either)
    assert httpx.get(f"{server.url}/agents/alpha/v1/sessions/s1", headers=bearer("key-b")).status_code == 403
    assert httpx.get(f"{server.url}/agents/beta/v1/sessions/s1", headers=bearer("key-a")).status_code == 403
    assert httpx.get(f"{server.url}/agents/beta/v1/sessions/s1", headers=bearer("key-b")).status_code == 404
    assert httpx.delete(f"{server.url}/agents/alpha/v1/sessions/s1", headers=bearer("key-b")).status_code == 403
    assert httpx.get(f"{server.url}/agents/alpha/v1/sessions", headers=bearer("key-b")).status_code == 403
    assert httpx.get(f"{server.url}/agents/alpha/v1/sessions/s1").status_code == 401


def test_a_configured_admin_key_protects_admin_even_with_auth_off():
    config = server_config(auth__enabled=False, auth__admin_keys=[ADMIN])
    with LiveServer(create_app(config, runtime=tiny_runtime())) as srv:
        url = f"{srv.url}/admin/agents"
        assert httpx.get(url).status_code == 401
        assert httpx.post(url, json={"name": "evil"}).status_code == 401
        assert httpx.get(url, headers=bearer("wrong")).status_code == 403
        assert httpx.get(url, headers=bearer(ADMIN)).status_code == 200
        # Agent endpoints stay open with auth off.
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": "assistant", "messages": USER,
                                                                "max_tokens": 1}, timeout=60)
        assert r.status_code == 200


def test_serving_beyond_loopback_without_auth_warns():
    from server.run import exposure_warning

    assert exposure_warning("127.0.0.1", False) is None and exposure_warning("::1", False) is None
    assert exposure_warning("0.0.0.0", True) is None
    assert "auth disabled" in exposure_warning("0.0.0.0", False)
    assert "auth.enabled" in exposure_warning("10.1.2.3", False)


def test_a_session_belongs_to_the_key_that_created_it(server):
    """Two keys of one agent: the second gets 404 for the first's session (read, continue, delete) and does not
    see it listed; the admin key sees and reads it; the creator keeps using it. Only a fingerprint is stored."""
    r = httpx.post(f"{server.url}/admin/agents", headers=bearer(ADMIN),
                   json={"name": "gamma", "system_prompt": "You are gamma.", "api_keys": ["key-g1", "key-g2"]})
    assert r.status_code == 201, r.text
    base = f"{server.url}/agents/gamma/v1"
    turn = {"messages": USER, "max_tokens": 1}
    r = httpx.post(f"{base}/chat/completions", headers={**bearer("key-g1"), "X-Session-Id": "mine"}, json=turn,
                   timeout=60)
    assert r.status_code == 200 and r.headers["x-session-id"] == "mine"
    other = bearer("key-g2")
    assert httpx.get(f"{base}/sessions/mine", headers=other).status_code == 404
    assert httpx.post(f"{base}/chat/completions", headers={**other, "X-Session-Id": "mine"}, json=turn,
                      timeout=60).status_code == 404
    assert httpx.delete(f"{base}/sessions/mine", headers=other).status_code == 404
    assert "mine" not in [s["id"] for s in httpx.get(f"{base}/sessions", headers=other).json()["data"]]
    assert "mine" in [s["id"] for s in httpx.get(f"{base}/sessions", headers=bearer(ADMIN)).json()["data"]]
    assert httpx.get(f"{base}/sessions/mine", headers=bearer(ADMIN)).status_code == 200
    r = httpx.post(f"{base}/chat/completions", headers={**bearer("key-g1"), "X-Session-Id": "mine"}, json=turn,
                   timeout=60)
    assert r.status_code == 200
    assert len(httpx.get(f"{base}/sessions/mine", headers=bearer("key-g1")).json()["messages"]) == 4
    store = server.app.state.slotserve.store
    import asyncio

    session = asyncio.run(store.get_session("gamma", "mine"))
    assert session.owner and "key-g1" not in session.owner and len(session.owner) == 32


def test_the_server_makes_up_an_unguessable_session_id_on_request(server):
    r = httpx.post(f"{server.url}/agents/alpha/v1/chat/completions", headers={**bearer("key-a"), "X-Session-Id": "new"},
                   json={"messages": USER, "max_tokens": 1}, timeout=60)
    sid = r.headers["x-session-id"]
    assert r.status_code == 200 and sid.startswith("sess-") and len(sid) == 5 + 32
    assert httpx.get(f"{server.url}/agents/alpha/v1/sessions/{sid}", headers=bearer("key-a")).status_code == 200


def test_a_stored_response_belongs_to_the_key_that_created_it(server):
    r = httpx.post(f"{server.url}/admin/agents", headers=bearer(ADMIN),
                   json={"name": "delta", "system_prompt": "You are delta.", "api_keys": ["key-d1", "key-d2"]})
    assert r.status_code == 201, r.text
    base = f"{server.url}/agents/delta/v1"
    r = httpx.post(f"{base}/responses", headers=bearer("key-d1"), json={"input": "hi", "max_output_tokens": 1},
                   timeout=60)
    assert r.status_code == 200, r.text
    rid, other = r.json()["id"], bearer("key-d2")
    for path in (f"{base}/responses/{rid}", f"{server.url}/v1/responses/{rid}"):
        assert httpx.get(path, headers=other).status_code == 404
        assert httpx.get(path, headers=bearer("key-a")).status_code in (403, 404)  # another agent's key
        assert httpx.get(path, headers=bearer(ADMIN)).status_code == 200
    chained = {"input": "more", "previous_response_id": rid, "max_output_tokens": 1}
    assert httpx.post(f"{base}/responses", headers=other, json=chained, timeout=60).status_code == 404
    assert httpx.delete(f"{base}/responses/{rid}", headers=other).status_code == 404
    r = httpx.post(f"{base}/responses", headers=bearer("key-d1"), json=chained, timeout=60)
    assert r.status_code == 200 and r.json()["previous_response_id"] == rid
