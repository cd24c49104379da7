"""The Anthropic Messages API end to end with the official `anthropic` SDK on the tiny random-weight runtime:
messages, forced tool_use, a tool_result round trip, the stream's event sequence, count_tokens, cached
tokens, stop sequences, sessions and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from test_server_helpers import LiveServer, server_config, tiny_runtime

from server.app import create_app

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather for a city.", "input_schema": WEATHER}]
USER = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0}  # the current API dropped sampling parameters; older clients still send them


@pytest.fixture(scope="module")
def server():
    with LiveServer(create_app(server_config(), runtime=tiny_runtime())) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    # The SDK appends /v1/messages: an agent's base URL is /agents/{agent}.
    return anthropic.Anthropic(base_url=f"{server.url}/agents/assistant", api_key="unused", max_retries=0)


def test_a_message_has_text_content_a_stop_reason_and_anthropic_usage(client):
    m = client.messages.create(model="assistant", max_tokens=6, system="Be brief.", messages=USER,
                               extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason in ("end_turn", "max_tokens") and m.content and m.content[0].type == "text"
    assert 0 < m.usage.output_tokens <= 6 and m.usage.input_tokens > 0
    again = client.messages.create(model="assistant", max_tokens=6, system="Be brief.", messages=USER,
                                   extra_body=GREEDY)
    assert again.content[0].text == m.content[0].text  # a prefix-cache hit is the same answer
    assert again.usage.cache_read_input_tokens > 0
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total


def test_count_tokens_counts_what_a_message_would_send(client):
    counted = client.messages.count_tokens(model="assistant", system="Be brief.", messages=USER, tools=TOOLS)
    m = client.messages.create(model="assistant", max_tokens=2, system="Be brief.", messages=USER, tools=TOOLS)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_forced_tool_use_is_a_tool_use_block_with_valid_input(client, choice):
    m = client.messages.create(model="assistant", max_tokens=40, messages=USER, tools=TOOLS, tool_choice=choice)
    assert m.stop_reason == "tool_use"
    [block] = m.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    jsonschema.validate(block.input, WEATHER)


def test_a_tool_result_round_trip_is_answered(client):
    first = client.messages.create(model="assistant", max_tokens=40, messages=USER, tools=TOOLS,
                                   tool_choice={"type": "any"})
    call = first.content[0]
    follow = client.messages.create(model="assistant", max_tokens=8, tools=TOOLS,
                                    messages=[*USER, {"role": "assistant", "content": first.content},
                                              {"role": "user", "content": [
                                                  {"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "Sunny, 21 C"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use") and follow.content
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_a_stream_follows_anthropics_event_sequence_and_adds_up_to_the_message(client):
    with client.messages.stream(model="assistant", max_tokens=8, messages=USER, extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds
    plain = client.messages.create(model="assistant", max_tokens=8, messages=USER, extra_body=GREEDY)
    assert final.content[0].text == plain.content[0].text and final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_a_streamed_tool_use_sends_its_input_as_json_deltas(client):
    with client.messages.stream(model="assistant", max_tokens=40, messages=USER, tools=TOOLS,
                                tool_choice={"type": "any"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(deltas) >= 2  # the input arrives while it is generated
    [block] = final.content
    assert block.type == "tool_use" and final.stop_reason == "tool_use"
    jsonschema.validate(block.input, WEATHER)


def test_a_stop_sequence_is_reported_as_such(client):
    text = client.messages.create(model="assistant", max_tokens=12, messages=USER, extra_body=GREEDY).content[0].text
    assert len(text) >= 4  # greedy on fixed random weights: the same text every run
    stop = text[2:4]
    m = client.messages.create(model="assistant", max_tokens=12, messages=USER, extra_body=GREEDY,
                               stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert stop not in "".join(b.text for b in m.content)


def test_output_config_format_makes_the_answer_a_document_of_its_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
    m = client.messages.create(model="assistant", max_tokens=20, messages=USER,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_sessions_keep_the_conversation_on_the_messages_api(server, client):
    sid = "anthropic-session"
    first = client.messages.create(model="assistant", max_tokens=4, messages=USER,
                                   extra_headers={"X-Session-Id": sid})
    second = client.messages.create(model="assistant", max_tokens=4, messages=[{"role": "user", "content": "More"}],
                                    extra_headers={"X-Session-Id": sid})
    stored = httpx.get(f"{server.url}/agents/assistant/v1/sessions/{sid}").json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant", "user", "assistant"]
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens


def test_errors_come_in_anthropics_shape(server, client):
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=f"{server.url}/agents/nobody", api_key="x", max_retries=0).messages.create(
            model="nobody", max_tokens=2, messages=USER)
    for body, where in [({"model": "assistant", "messages": USER}, "max_tokens"),
                        ({"model": "assistant", "max_tokens": 2, "messages": USER, "frobnicate": 1}, "frobnicate"),
                        ({"model": "assistant", "max_tokens": 2, "messages": [{"role": "user", "content": "\ud800"}]},
                         "messages[0].content"),
                        ({"model": "assistant", "max_tokens": 2, "messages": [{"role": "user", "content": [
                            {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}]}, "tool_use")]:
        r = httpx.post(f"{server.url}/v1/messages", content=json.dumps(body), timeout=60,  # ASCII: "\ud800" stays
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert where in error["error"]["message"]
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "nobody", "max_tokens": 2, "messages": USER})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
