"""The OpenAI Responses API on ``/v1/responses`` and ``/agents/{agent}/v1/responses``: create (plain or
streamed), ``GET`` and ``DELETE /v1/responses/{id}``.

Stored responses live on server-side sessions: a stored response (``store``, true by default) is a turn of
a session, and its id names that point of the session (the record keeps the session and its message
count). ``previous_response_id`` resolves through that record, so a chained request sends only its new
input and the session's prompt prefix is reused from the cache. Chaining from the session's latest point
continues the session; chaining from an earlier point (a branch) starts a new session holding the history
up to that point. Records live in the same store as sessions, for the same time, under the same owner.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agents.chat_params import ChatParams, SessionCaller
from agents.service import Outcome
from agents.spec import AgentSpec
from agents.store import Session
from agents.tool_calls import CallPiece
from scheduler.request import FinishEvent
from server.errors import APIError
from server.openai_api import session_header, session_id_of
from server.responses_schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
    TextFormatJSONObject,
    TextFormatJSONSchema,
)
from server.state import AgentName, ServerState, agent_for, agent_named_by_model, state_of
from server.streaming import MEDIA_TYPE, SSE_HEADERS
from server.turns import Committed, Failed, Finished, Step, Tracker, Turn, idempotent_request, in_background

ResponseId = Annotated[str, Path(examples=["resp_0123"], description="a response id")]
router = APIRouter()


@router.post("/v1/responses", tags=["responses"])
async def create(request: Request, body: ResponsesRequest) -> Response:
    return await create_response(request, await agent_named_by_model(request, body.model), body)


@router.post("/agents/{agent}/v1/responses", tags=["agents"])
async def agent_create(request: Request, agent: AgentName, body: ResponsesRequest) -> Response:
    return await create_response(request, await agent_for(request, agent), body)


@router.get("/v1/responses/{response_id}", tags=["responses"])
async def get(request: Request, response_id: ResponseId) -> dict[str, Any]:
    return (await _record(request, None, response_id))["response"]


@router.get("/agents/{agent}/v1/responses/{response_id}", tags=["agents"])
async def agent_get(request: Request, agent: AgentName, response_id: ResponseId) -> dict[str, Any]:
    return (await _record(request, await agent_for(request, agent), response_id))["response"]


@router.delete("/v1/responses/{response_id}", tags=["responses"])
async def delete(request: Request, response_id: ResponseId) -> dict[str, Any]:
    return await _delete(request, None, response_id)


@router.delete("/agents/{agent}/v1/responses/{response_id}", tags=["agents"])
async def agent_delete(request: Request, agent: AgentName, response_id: ResponseId) -> dict[str, Any]:
    return await _delete(request, await agent_for(request, agent), response_id)


# ---- stored responses ----------------------------------------------------------------------------


async def _record(request: Request, agent: AgentSpec | None, response_id: str) -> dict[str, Any]:
    """The stored record of a response the caller may see (its key's, or any for an admin key), else 404."""
    state = state_of(request)
    record = await state.store.get_response(response_id)
    caller = state.auth.session_caller(request)
    if record is not None and agent is None:  # on /v1 the response's own agent decides access
        await agent_for(request, record["agent"])
    visible = record is not None and (agent is None or record["agent"] == agent.name) and _may_see(caller, record)
    if not visible:
        raise APIError(404, f"no response {response_id!r}", param="response_id", code="response_not_found")
    return record


def _may_see(caller: SessionCaller | None, record: dict[str, Any]) -> bool:
    return caller is None or caller.admin or record.get("owner") == caller.owner


async def _delete(request: Request, agent: AgentSpec | None, response_id: str) -> dict[str, Any]:
    await _record(request, agent, response_id)
    await state_of(request).store.delete_response(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


# ---- requests in -----------------------------------------------------------------------------------


def input_messages(given: str | list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: function calls join the assistant message before them (or make one),
    function call outputs become tool messages; reasoning items of other models are dropped."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    for item in given:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text else None
    if isinstance(fmt, TextFormatJSONSchema):
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_,
                                                       "strict": bool(fmt.strict)}}
    return {"type": "json_object"} if isinstance(fmt, TextFormatJSONObject) else None


def _tool_choice(body: ResponsesRequest) -> str | dict[str, Any] | None:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return choice.model_dump()  # {"type": "function", "name"} or {"type": "allowed_tools", "mode", "tools"}


async def _conversation(request: Request, state: ServerState, agent: AgentSpec, body: ResponsesRequest,
                        caller: SessionCaller | None) -> tuple[list[dict[str, Any]], str | None, bool]:
    """(the messages to send, the session the turn belongs to or None, whether they only follow its history)."""
    new = input_messages(body.input)
    store = body.store is not False
    given = session_id_of(request, body.session_id)
    if body.previous_response_id is None:
        if given is not None and not store:
            raise APIError(400, "a session turn is always stored: drop store: false or the session id",
                           param="store", code="invalid_value")
        return new, (given or f"sess-{secrets.token_hex(16)}") if store else None, False
    if given is not None:
        raise APIError(400, "previous_response_id already names the conversation; drop the session id",
                       param="previous_response_id", code="invalid_value")
    record = await _record(request, agent, body.previous_response_id)
    sid, point = record["session_id"], record["point"]
    session = await state.store.get_session(agent.name, sid) if sid else None
    history = session.messages[:point] if session is not None else []
    if len(history) < point:
        raise APIError(404, f"the conversation of response {body.previous_response_id!r} has expired",
                       param="previous_response_id", code="response_not_found")
    if store and session is not None and len(session.messages) == point:
        return new, sid, True  # the session's latest point: continue it (its prefix is in the cache)
    return history + new, (f"sess-{secrets.token_hex(16)}" if store else None), False  # a branch, or unstored


def _params(body: ResponsesRequest, messages: list[dict[str, Any]], sid: str | None, only_new: bool,
            caller: SessionCaller | None) -> ChatParams:
    tools = None
    if body.tools is not None:
        tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                 for t in body.tools]
    return ChatParams(
        messages=messages, max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, **body.repetition_values(), response_format=_response_format(body), tools=tools,
        tool_choice=_tool_choice(body),
        session_id=sid, user=body.user or body.safety_identifier, cache_salt=body.cache_salt, caller=caller,
        truncation=body.truncation, instructions=body.instructions, only_new=only_new,
        close_within_budget=body.close_within_budget is not False,
        parallel_tool_calls=False if body.max_tool_calls == 1 else body.parallel_tool_calls)


# ---- responses out ---------------------------------------------------------------------------------


def usage(fin: FinishEvent) -> dict[str, Any]:
    u = fin.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class ResponseBuilder:
    """The response object of one request, from its first event (in progress) to its end; output item ids are
    chosen when a stream opens an item, so the streamed items and the final object agree."""

    def __init__(self, agent: str, body: ResponsesRequest) -> None:
        self.id = f"resp_{secrets.token_hex(24)}"
        self.created = int(time.time())
        self.agent, self.body = agent, body
        self.message_id = f"msg_{secrets.token_hex(24)}"
        self.call_item_ids: dict[str, str] = {}  # call id -> output item id

    def item_id(self, call_id: str) -> str:
        return self.call_item_ids.setdefault(call_id, f"fc_{secrets.token_hex(24)}")

    def message_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def call_item(self, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": self.item_id(call_id), "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    def output(self, outcome: Outcome) -> list[dict[str, Any]]:
        status = "incomplete" if outcome.finish_reason == "length" else "completed"
        items = [self.message_item(outcome.content or "", status)] if outcome.content or not outcome.tool_calls \
            else []
        for call in outcome.tool_calls or []:
            items.append(self.call_item(call["id"], call["function"]["name"], call["function"]["arguments"], status))
        return items

    def object(self, status: str = "in_progress", outcome: Outcome | None = None,
               fin: FinishEvent | None = None, error: APIError | None = None) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else None
        choice = b.tool_choice.model_dump() if b.tool_choice is not None and not isinstance(b.tool_choice, str) \
            else (b.tool_choice or "auto")
        if outcome is not None and outcome.finish_reason == "length":
            status = "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": {"code": error.code or "server_error", "message": error.message} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.agent,
            "output": self.output(outcome) if outcome is not None else [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": b.store is not False, "temperature": b.temperature, "top_p": b.top_p,
            "text": {"format": fmt or {"type": "text"}}, "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "truncation": b.truncation or "disabled", "usage": usage(fin) if fin is not None else None,
            "user": b.user, "metadata": b.metadata or {}, "background": False, "service_tier": "default",
            **(outcome.extensions() if outcome is not None else {}),
        }


async def create_response(request: Request, agent: AgentSpec, body: ResponsesRequest) -> Response:
    state = state_of(request)
    state.require_ready()
    caller = state.auth.session_caller(request)
    idem, answer = await idempotent_request(request, state, agent, caller)
    if answer is not None:
        return _replay(answer, bool(body.stream))
    builder = ResponseBuilder(agent.name, body)
    try:
        messages, sid, only_new = await _conversation(request, state, agent, body, caller)
        params = _params(body, messages, sid, only_new, caller)
        turn = await Turn.submit(state, agent, params, Tracker(state, agent.name, "responses", params.user), idem)
    except BaseException:
        if idem is not None:
            in_background(state, idem.abandon())
        raise
    turn.answer = lambda outcome, fin: builder.object("completed", outcome, fin)
    if body.store is not False:
        turn.after_commit = lambda outcome, fin, session: _store(state, builder, outcome, fin, session, caller)
    if body.stream:
        return StreamingResponse(_stream(turn, builder), media_type=MEDIA_TYPE,
                                 headers={**SSE_HEADERS, **session_header(turn.gen)})
    _, outcome, fin = await turn.collect(request)
    return JSONResponse(builder.object("completed", outcome, fin), headers=session_header(turn.gen))


async def _store(state: ServerState, builder: ResponseBuilder, outcome: Outcome, fin: FinishEvent,
                 session: Session | None, caller: SessionCaller | None) -> None:
    record = {"agent": builder.agent, "owner": caller.owner if caller is not None else None,
              "session_id": session.id if session is not None else None,
              "point": len(session.messages) if session is not None else 0,
              "response": builder.object("completed", outcome, fin)}
    await state.store.put_response(builder.id, record, state.service.session_ttl)


class _Events:
    """Numbered stream events, and the output item the stream has open."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.sequence = 0
        self.index = -1
        self.open: dict[str, Any] | None = None  # {"kind", "text"} or {"kind", "call_id", "name", "arguments"}

    def event(self, kind: str, payload: dict[str, Any]) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **payload}, ensure_ascii=False,
                          separators=(",", ":"))
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def pieces(self, pieces: list[str | CallPiece]) -> list[bytes]:
        out: list[bytes] = []
        b = self.builder
        for piece in pieces:
            if isinstance(piece, str):
                if not piece:
                    continue
                if self.open is None or self.open["kind"] != "message":
                    out += self.open_message()
                self.open["text"] += piece
                out.append(self.event("response.output_text.delta", {
                    "item_id": b.message_id, "output_index": self.index, "content_index": 0, "delta": piece,
                    "logprobs": []}))
            elif piece.first:
                out += self.close()
                self.index += 1
                self.open = {"kind": "call", "call_id": piece.call_id, "name": piece.name, "arguments": ""}
                out.append(self.event("response.output_item.added", {
                    "output_index": self.index, "item": b.call_item(piece.call_id, piece.name, "", "in_progress")}))
            else:
                self.open["arguments"] += piece.arguments
                out.append(self.event("response.function_call_arguments.delta", {
                    "item_id": b.item_id(piece.call_id), "output_index": self.index, "delta": piece.arguments}))
        return out

    def open_message(self) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = {"kind": "message", "text": ""}
        item = {**self.builder.message_item("", "in_progress"), "content": []}
        return [*out, self.event("response.output_item.added", {"output_index": self.index, "item": item}),
                self.event("response.content_part.added", {
                    "item_id": self.builder.message_id, "output_index": self.index, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})]

    def close(self, status: str = "completed") -> list[bytes]:
        item, self.open, b = self.open, None, self.builder
        if item is None:
            return []
        if item["kind"] == "call":
            done = b.call_item(item["call_id"], item["name"], item["arguments"], status)
            return [self.event("response.function_call_arguments.done", {
                        "item_id": done["id"], "output_index": self.index, "name": item["name"],
                        "arguments": item["arguments"]}),
                    self.event("response.output_item.done", {"output_index": self.index, "item": done})]
        part = {"type": "output_text", "text": item["text"], "annotations": [], "logprobs": []}
        where = {"item_id": b.message_id, "output_index": self.index, "content_index": 0}
        return [self.event("response.output_text.done", {**where, "text": item["text"], "logprobs": []}),
                self.event("response.content_part.done", {**where, "part": part}),
                self.event("response.output_item.done", {"output_index": self.index,
                                                         "item": b.message_item(item["text"], status)})]


async def _stream(turn: Turn, builder: ResponseBuilder) -> AsyncIterator[bytes]:
    events = _Events(builder)
    yield events.event("response.created", {"response": builder.object()})
    yield events.event("response.in_progress", {"response": builder.object()})
    final: tuple[Outcome, FinishEvent] | None = None
    async with contextlib.aclosing(turn.events()) as turn_events:  # its clean-up runs when this ends
        async for ev in turn_events:
            if isinstance(ev, Step):
                for chunk in events.pieces(ev.pieces):
                    yield chunk
            elif isinstance(ev, Finished):
                status = "incomplete" if ev.outcome.finish_reason == "length" else "completed"
                tail = events.pieces(ev.pieces)
                if events.index < 0 and not ev.outcome.tool_calls:  # an empty answer is still one (empty) message
                    tail += events.open_message()
                for chunk in [*tail, *events.close(status)]:
                    yield chunk
                final = (ev.outcome, ev.fin)
            elif isinstance(ev, Failed):
                failed = builder.object("failed", error=ev.error)
                yield events.event("response.failed", {"response": failed})
                return
            elif isinstance(ev, Committed) and final is not None:
                done = builder.object("completed", *final)
                kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
                yield events.event(kind, {"response": done})


def _replay(answer: dict[str, Any], stream: bool) -> Response:
    """The first answer to this Idempotency-Key, as a plain response or as a short stream."""
    headers = {"Idempotent-Replayed": "true"}
    if not stream:
        return JSONResponse(answer, headers=headers)
    events = _Events(ResponseBuilder(answer["model"], ResponsesRequest(input="")))
    chunks = [events.event("response.created", {"response": {**answer, "status": "in_progress", "output": []}})]
    for i, item in enumerate(answer["output"]):
        chunks.append(events.event("response.output_item.added", {"output_index": i, "item": item}))
        chunks.append(events.event("response.output_item.done", {"output_index": i, "item": item}))
    kind = "response.incomplete" if answer["status"] == "incomplete" else "response.completed"
    chunks.append(events.event(kind, {"response": answer}))

    async def replay() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    return StreamingResponse(replay(), media_type=MEDIA_TYPE, headers={**SSE_HEADERS, **headers})
