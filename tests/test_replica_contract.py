"""What a replica behind a router must offer (docs/scale-out.md): bodies as vllm-router re-serialises them
(SGLang's fields added at their defaults) are served, any other value of those fields is a 400 naming it,
`GET /get_load` reports waiting + running requests, and every response names the replica that answered."""

from __future__ import annotations

import socket

import httpx
import pytest
from test_server_helpers import LiveServer, server_config, tiny_runtime

from server.app import create_app
from server.schemas import ROUTER_FIELDS

# What vllm-router 0.1.17 adds to every body it forwards (nulls dropped, unknown fields kept).
ROUTER_CHAT = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
               "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}
ROUTER_COMPLETION = {"echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                     "return_hidden_states": False}
CHAT = {"model": "assistant", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
COMPLETION = {"model": "assistant", "prompt": "Hello", "max_tokens": 3}


@pytest.fixture(scope="module")
def server():
    with LiveServer(create_app(server_config(), runtime=tiny_runtime())) as srv:
        yield srv


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120, **kw)


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_body_as_the_router_forwards_it_is_served(server, stream):
    r = post(server, "/v1/chat/completions", {**CHAT, **ROUTER_CHAT, "stream": stream})
    assert r.status_code == 200, r.text
    assert ("data: [DONE]" in r.text) if stream else r.json()["object"] == "chat.completion"


def test_a_completion_body_as_the_router_forwards_it_is_served(server):
    r = post(server, "/v1/completions", {**COMPLETION, **ROUTER_COMPLETION})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"


@pytest.mark.parametrize("field", sorted(ROUTER_FIELDS))
def test_a_router_field_at_another_value_is_a_400_naming_it(server, field):
    path, body = ("/v1/completions", COMPLETION) if field in ROUTER_COMPLETION else ("/v1/chat/completions", CHAT)
    accepted, _meaning = ROUTER_FIELDS[field]
    r = post(server, path, {**body, field: not accepted})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_parameter"
    assert f"only {str(accepted).lower()}" in error["message"]


def test_chat_only_router_fields_stay_unknown_on_completions_and_unknown_fields_stay_refused(server):
    r = post(server, "/v1/completions", {**COMPLETION, "separate_reasoning": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "separate_reasoning"
    r = post(server, "/v1/chat/completions", {**CHAT, **ROUTER_CHAT, "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
    assert r.json()["error"]["param"] == "best_of"


def test_get_load_counts_waiting_and_running_requests(server):
    r = httpx.get(f"{server.url}/get_load", timeout=10)
    assert r.status_code == 200
    load = r.json()
    assert set(load) == {"load", "waiting", "running"}
    assert load["load"] == load["waiting"] + load["running"] and load["load"] >= 0


def test_every_response_names_the_replica_hostname_and_port_by_default(server):
    expected = f"{socket.gethostname()}:{server.port}"
    responses = [httpx.get(f"{server.url}{path}", timeout=10) for path in ("/health", "/ready", "/v1/models",
                                                                           "/get_load", "/no-such-route")]
    responses.append(post(server, "/v1/chat/completions", {**CHAT, "n": 2}))  # an error
    responses.append(post(server, "/v1/chat/completions", CHAT))
    assert [r.headers.get("x-slotserve-replica") for r in responses] == [expected] * len(responses)


def test_the_replica_name_comes_from_the_config():
    app = create_app(server_config(server__replica_name="replica-a"), runtime=tiny_runtime())
    with LiveServer(app) as srv:
        assert httpx.get(f"{srv.url}/health", timeout=10).headers["x-slotserve-replica"] == "replica-a"
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=120)
        assert r.status_code == 200 and r.headers["x-slotserve-replica"] == "replica-a"
