"""The Responses API end to end with the official `openai` client on the tiny random-weight runtime: create,
retrieve, delete, chaining by previous_response_id through server-side sessions (reused prefix, output
identical to a cold run), branches, typed output, function tools, the streamed event sequence, store: false,
idempotent retries and refusals."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from test_server_helpers import LiveServer, server_config, tiny_runtime

from server.app import create_app

GREEDY = {"temperature": 0}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city.", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def server():
    with LiveServer(create_app(server_config(), runtime=tiny_runtime())) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/agents/assistant/v1", api_key="unused", max_retries=0)


def session_of(server, response_id: str) -> list[dict]:
    """The server-side conversation a stored response belongs to (test-only peek into the store)."""
    import asyncio

    state = server.app.state.slotserve
    record = asyncio.run(state.store.get_response(response_id))
    session = asyncio.run(state.store.get_session(record["agent"], record["session_id"]))
    return session.messages[:record["point"]]


def test_a_response_is_created_retrieved_and_deleted(client):
    r = client.responses.create(model="assistant", input="Hello there", max_output_tokens=6, **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "assistant"
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    assert r.output_text == r.output[0].content[0].text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 6
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_a_chained_response_sends_only_its_input_reuses_the_prefix_and_matches_a_cold_run(server, client):
    first = client.responses.create(model="assistant", input="Remember the number 42.", instructions="Be brief.",
                                    max_output_tokens=6, **GREEDY)
    second = client.responses.create(model="assistant", input="Which number?", previous_response_id=first.id,
                                     instructions="Be brief.", max_output_tokens=6, **GREEDY)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    assert [m["role"] for m in session_of(server, second.id)] == ["user", "assistant", "user", "assistant"]
    # The same conversation sent whole, unstored, in a cache scope of its own: the same tokens, computed cold.
    cold = client.responses.create(
        model="assistant", store=False, instructions="Be brief.", max_output_tokens=6, **GREEDY,
        extra_body={"cache_salt": "cold"},
        input=[{"role": "user", "content": "Remember the number 42."},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "Which number?"}])
    assert cold.usage.input_tokens_details.cached_tokens == 0
    assert cold.usage.input_tokens == second.usage.input_tokens
    assert cold.output_text == second.output_text


def test_chaining_from_an_earlier_response_branches_without_touching_the_first_conversation(server, client):
    root = client.responses.create(model="assistant", input="Start", max_output_tokens=4)
    left = client.responses.create(model="assistant", input="Left", previous_response_id=root.id,
                                   max_output_tokens=4)
    right = client.responses.create(model="assistant", input="Right", previous_response_id=root.id,
                                    max_output_tokens=4)
    assert [m["content"] for m in session_of(server, left.id)][::2] == ["Start", "Left"]
    assert [m["content"] for m in session_of(server, right.id)][::2] == ["Start", "Right"]
    assert len(session_of(server, root.id)) == 2  # the root's own point is unchanged
    assert right.usage.input_tokens_details.cached_tokens >= root.usage.input_tokens  # the branch reuses the root


def test_text_format_json_schema_makes_output_text_a_document(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer"], "additionalProperties": False}  # short: random weights finish it
    r = client.responses.create(model="assistant", input="Give a number", max_output_tokens=40, **GREEDY,
                                text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_a_function_call_and_its_output_round_trip_through_previous_response_id(server, client):
    call = client.responses.create(model="assistant", input="Weather in Oslo?", tools=TOOLS,
                                   tool_choice="required", max_output_tokens=40)
    [item] = call.output
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), WEATHER)
    answer = client.responses.create(model="assistant", previous_response_id=call.id, tools=TOOLS,
                                     tool_choice="none", max_output_tokens=6,
                                     input=[{"type": "function_call_output", "call_id": item.call_id,
                                             "output": "Sunny"}])
    assert answer.output[0].type == "message"
    roles = [m["role"] for m in session_of(server, answer.id)]
    assert roles == ["user", "assistant", "tool", "assistant"]


def test_tools_with_a_text_format_answer_with_a_call_or_a_document(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.responses.create(model="assistant", input="Check", tools=TOOLS, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    # Either way the output is whole: a constrained output closes within max_output_tokens (budget_close).
    assert r.status == "completed", r
    if r.output[0].type == "function_call":
        jsonschema.validate(json.loads(r.output[0].arguments), WEATHER)
    else:
        assert r.output[0].type == "message"
        jsonschema.validate(json.loads(r.output_text), schema)


def test_a_stream_sends_the_responses_events_in_order_and_ends_with_the_stored_response(client):
    events = list(client.responses.create(model="assistant", input="Hello there", max_output_tokens=6,
                                          stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text
    assert client.responses.retrieve(final.id).output_text == text
    plain = client.responses.create(model="assistant", input="Hello there", max_output_tokens=6, **GREEDY)
    assert plain.output_text == text


def test_a_streamed_function_call_sends_its_arguments_as_deltas(client):
    events = list(client.responses.create(model="assistant", input="Weather?", tools=TOOLS, tool_choice="required",
                                          max_output_tokens=40, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) >= 2 and "".join(deltas) == done.arguments
    assert events[-1].response.output[0].arguments == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER)


def test_an_unstored_response_cannot_be_retrieved_or_chained(client):
    r = client.responses.create(model="assistant", input="Hi", store=False, max_output_tokens=2)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="assistant", input="Next", previous_response_id=r.id, max_output_tokens=2)


def test_an_idempotent_retry_gets_the_first_response(server):
    body = {"model": "assistant", "input": "Hello", "max_output_tokens": 3}
    headers = {"Idempotency-Key": "responses-retry-1"}
    first = httpx.post(f"{server.url}/v1/responses", json=body, headers=headers, timeout=60)
    again = httpx.post(f"{server.url}/v1/responses", json=body, headers=headers, timeout=60)
    assert first.status_code == again.status_code == 200
    assert again.json()["id"] == first.json()["id"] and again.headers["Idempotent-Replayed"] == "true"


@pytest.mark.parametrize(("extra", "param"), [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0]"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]"),
])
def test_what_is_not_implemented_is_refused_naming_it(server, extra, param):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "assistant", "input": "Hi", **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


def test_truncation_auto_drops_old_turns_and_disabled_refuses(server):
    long = "word " * 150
    items = [m for i in range(4) for m in ({"role": "user", "content": f"{i} {long}"},
                                           {"role": "assistant", "content": long})]
    body = {"model": "assistant", "input": [*items, {"role": "user", "content": "last"}], "max_output_tokens": 2,
            "store": False}
    refused = httpx.post(f"{server.url}/v1/responses", json={**body, "truncation": "disabled"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    kept = httpx.post(f"{server.url}/v1/responses", json={**body, "truncation": "auto"}, timeout=60)
    assert kept.status_code == 200 and kept.json()["usage"]["input_tokens"] < 512
