"""The Anthropic Messages API on ``/v1/messages`` (``model`` names the agent) and on
``/agents/{agent}/v1/messages`` (the Anthropic SDK appends ``/v1/messages`` to its base URL), with
``count_tokens``. A thin translation onto the same turn pipeline as Chat Completions (`server.turns`):
blocks become chat messages, ``tool_use`` / ``tool_result`` become tool calls and tool messages, and the
turn's events become Anthropic's stream events. Sessions (``X-Session-Id``) work as on Chat Completions.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agents.chat_params import ChatParams
from agents.messages import invalid_text_path
from agents.service import Outcome
from agents.spec import AgentSpec
from agents.tool_calls import CallPiece
from scheduler.request import FinishEvent
from server.anthropic_schemas import CountTokensRequest, Message, MessagesRequest, ToolChoice
from server.errors import APIError
from server.openai_api import session_header, session_id_of
from server.state import AgentName, agent_for, agent_named_by_model, state_of
from server.streaming import MEDIA_TYPE, SSE_HEADERS
from server.turns import Committed, Failed, Finished, Step, Tracker, Turn

router = APIRouter()


@router.post("/v1/messages", tags=["anthropic"])
async def messages(request: Request, body: MessagesRequest) -> Response:
    return await create_message(request, await agent_named_by_model(request, body.model), body)


@router.post("/agents/{agent}/v1/messages", tags=["agents"])
async def agent_messages(request: Request, agent: AgentName, body: MessagesRequest) -> Response:
    return await create_message(request, await agent_for(request, agent), body)


@router.post("/v1/messages/count_tokens", tags=["anthropic"])
async def count_tokens(request: Request, body: CountTokensRequest) -> dict[str, int]:
    return await count_message_tokens(request, await agent_named_by_model(request, body.model), body)


@router.post("/agents/{agent}/v1/messages/count_tokens", tags=["agents"])
async def agent_count_tokens(request: Request, agent: AgentName, body: CountTokensRequest) -> dict[str, int]:
    return await count_message_tokens(request, await agent_for(request, agent), body)


# ---- requests in -----------------------------------------------------------------------------------


def chat_messages(system: str | None, messages: list[Message]) -> list[dict[str, Any]]:
    """Anthropic messages as chat messages: an assistant's ``tool_use`` blocks become its tool calls, a user's
    ``tool_result`` blocks become tool messages (before the user's own text)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results = [], [], []
        for j, block in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if block.type == "text":
                texts.append(block.text)
            elif block.type == "tool_use":
                if m.role != "assistant":
                    raise APIError(400, f"{where}: tool_use blocks belong to assistant messages", param=where)
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False,
                                                                separators=(",", ":"))}})
            else:
                if m.role != "user":
                    raise APIError(400, f"{where}: tool_result blocks belong to user messages", param=where)
                results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        if m.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
        else:
            out += results
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
    return out


def _tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise APIError(400, "tool_choice of type tool needs a name", param="tool_choice.name",
                           code="missing_required_parameter")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _params(request: Request, body: MessagesRequest | CountTokensRequest, caller: Any) -> ChatParams:
    where = invalid_text_path(body.model_dump(exclude_none=True))
    if where is not None:
        raise APIError(400, f"{where} is not valid Unicode text (it holds a lone surrogate)", param=where,
                       code="invalid_value")
    tools = None
    if body.tools is not None:
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.input_schema}} for t in body.tools]
    fmt = body.output_config.format if body.output_config else None
    response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}} if fmt \
        else None
    parallel = body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use is False
    params = ChatParams(messages=chat_messages(body.system_text(), body.messages), tools=tools,
                        tool_choice=_tool_choice(body.tool_choice), response_format=response_format,
                        session_id=session_id_of(request, None), caller=caller,
                        parallel_tool_calls=parallel)
    if isinstance(body, MessagesRequest):
        params.max_tokens, params.temperature, params.top_p = body.max_tokens, body.temperature, body.top_p
        params.top_k, params.stop = body.top_k, body.stop_sequences
        params.close_within_budget = body.close_within_budget is not False
        for name, value in body.repetition_values().items():
            setattr(params, name, value)
        params.user = (body.metadata.user_id if body.metadata else None) or body.user_profile_id
    return params


async def count_message_tokens(request: Request, agent: AgentSpec, body: CountTokensRequest) -> dict[str, int]:
    state = state_of(request)
    service = state.require_ready()
    _, rendered, _ = await service.render(agent, _params(request, body, state.auth.session_caller(request)))
    return {"input_tokens": len(rendered.ids)}


# ---- responses out ---------------------------------------------------------------------------------


def stop_reason(outcome: Outcome, fin: FinishEvent) -> str:
    if outcome.finish_reason == "tool_calls":
        return "tool_use"
    if outcome.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if fin.stop_sequence else "end_turn"


def usage(fin: FinishEvent) -> dict[str, int]:
    """Anthropic counts cached prompt tokens apart from ``input_tokens``."""
    u = fin.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:  # a call cut short by max_tokens: its arguments are incomplete
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(outcome: Outcome) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": outcome.content}] if outcome.content else []
    for call in outcome.tool_calls or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": _tool_input(call["function"]["arguments"])})
    return blocks


def _message(mid: str, agent: str, content: list, reason: str | None, stop: str | None,
             use: dict[str, int], extensions: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": agent, "content": content,
            "stop_reason": reason, "stop_sequence": stop, "usage": use, **(extensions or {})}


async def create_message(request: Request, agent: AgentSpec, body: MessagesRequest) -> Response:
    state = state_of(request)
    state.require_ready()
    params = _params(request, body, state.auth.session_caller(request))
    turn = await Turn.submit(state, agent, params, Tracker(state, agent.name, "messages", params.user))
    mid = f"msg_{secrets.token_hex(12)}"
    if body.stream:
        return StreamingResponse(_stream(turn, mid), media_type=MEDIA_TYPE,
                                 headers={**SSE_HEADERS, **session_header(turn.gen)})
    _, outcome, fin = await turn.collect(request)
    return JSONResponse(_message(mid, agent.name, content_blocks(outcome), stop_reason(outcome, fin),
                                 fin.stop_sequence, usage(fin), outcome.extensions()),
                        headers=session_header(turn.gen))


def event(name: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps({"type": name, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n".encode()


class _Blocks:
    """Content block bookkeeping of one streamed message: opens a block when the kind of content changes."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def events(self, pieces: list[str | CallPiece]) -> list[bytes]:
        out: list[bytes] = []
        for piece in pieces:
            if isinstance(piece, str):
                if not piece:
                    continue
                if self.open != "text":
                    out += self._start({"type": "text", "text": ""}, "text")
                out.append(event("content_block_delta", {"index": self.index,
                                                         "delta": {"type": "text_delta", "text": piece}}))
            elif piece.first:
                out += self._start({"type": "tool_use", "id": piece.call_id, "name": piece.name, "input": {}},
                                   "tool_use")
            else:
                out.append(event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": piece.arguments}}))
        return out

    def _start(self, block: dict[str, Any], kind: str) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        return [*out, event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]


async def _stream(turn: Turn, mid: str) -> AsyncIterator[bytes]:
    start_usage = {"input_tokens": turn.gen.prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                   "cache_creation_input_tokens": 0}
    yield event("message_start", {"message": _message(mid, turn.gen.agent.name, [], None, None, start_usage)})
    yield event("ping", {})
    blocks = _Blocks()
    async with contextlib.aclosing(turn.events()) as events:  # its clean-up runs when this ends
        async for ev in events:
            if isinstance(ev, Step):
                for chunk in blocks.events(ev.pieces):
                    yield chunk
            elif isinstance(ev, Finished):
                for chunk in [*blocks.events(ev.pieces), *blocks.close()]:
                    yield chunk
                yield event("message_delta", {"delta": {"stop_reason": stop_reason(ev.outcome, ev.fin),
                                                        "stop_sequence": ev.fin.stop_sequence,
                                                        **ev.outcome.extensions()}, "usage": usage(ev.fin)})
            elif isinstance(ev, Failed):
                yield event("error", {"error": ev.error.anthropic_body()["error"]})
                return
            elif isinstance(ev, Committed):
                yield event("message_stop", {})
