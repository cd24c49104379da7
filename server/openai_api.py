"""OpenAI Chat Completions, Completions and Models, on ``/v1`` (``model`` names the agent) and on
``/agents/{agent}/v1`` (the agent fixed by the URL: a complete OpenAI base URL)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from pathlib import PurePath
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agents.chat_params import ChatParams
from agents.service import Generation, Outcome
from agents.spec import AgentSpec
from agents.tool_calls import CallPiece
from scheduler.request import FinishEvent, TokenEvent
from server.errors import APIError
from server.schemas import ChatCompletionRequest, CompletionRequest, request_problem
from server.state import AgentName, ServerState, agent_for, agent_named_by_model, state_of
from server.streaming import DONE, MEDIA_TYPE, SSE_HEADERS, sse
from server.turns import Committed, Failed, Finished, Step, Tracker, Turn, idempotent_request, in_background

NEW_SESSION = "new"  # X-Session-Id / session_id value asking the server to choose an unguessable id

router = APIRouter()


# ---- routes --------------------------------------------------------------------------------------


@router.get("/v1/models", tags=["openai"])
async def list_models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    state.auth.require_key_if_enabled(request)
    agents = [a for a in await state.registry.list() if state.auth.may_use(request, a)]
    return {"object": "list", "data": [model_card(a) for a in agents]}


@router.get("/v1/models/{model}", tags=["openai"])
async def get_model(request: Request, model: str) -> dict[str, Any]:
    return model_card(await agent_for(request, model))


@router.post("/v1/chat/completions", tags=["openai"])
async def chat(request: Request, body: ChatCompletionRequest) -> Response:
    return await chat_completion(request, await agent_named_by_model(request, body.model), body)


@router.post("/v1/completions", tags=["openai"])
async def completions(request: Request, body: CompletionRequest) -> Response:
    return await completion(request, await agent_named_by_model(request, body.model), body)


@router.get("/agents/{agent}/v1/models", tags=["agents"])
async def agent_models(request: Request, agent: AgentName) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(await agent_for(request, agent))]}


@router.get("/agents/{agent}/v1/models/{model}", tags=["agents"])
async def agent_model(request: Request, agent: AgentName, model: str) -> dict[str, Any]:
    spec = await agent_for(request, agent)
    if model != spec.name:
        raise APIError(404, f"this endpoint serves agent {spec.name!r} only", param="model", code="model_not_found")
    return model_card(spec)


@router.post("/agents/{agent}/v1/chat/completions", tags=["agents"])
async def agent_chat(request: Request, agent: AgentName, body: ChatCompletionRequest) -> Response:
    return await chat_completion(request, await agent_for(request, agent), body)


@router.post("/agents/{agent}/v1/completions", tags=["agents"])
async def agent_completions(request: Request, agent: AgentName, body: CompletionRequest) -> Response:
    return await completion(request, await agent_for(request, agent), body)


def model_card(agent: AgentSpec) -> dict[str, Any]:
    card = {"id": agent.name, "object": "model", "created": 0, "owned_by": "slotserve",
            "description": agent.description}
    if agent.adapter is not None:  # as vLLM lists a LoRA module (the directory's name, not the server's path)
        card["adapter"] = PurePath(agent.adapter).name
    return card


# ---- shared pieces -------------------------------------------------------------------------------


def check_supported(body: ChatCompletionRequest | CompletionRequest) -> None:
    problem = request_problem(body)
    if problem is not None:
        param, message, code = problem
        raise APIError(400, message, param=param, code=code)


def session_id_of(request: Request, given: str | None) -> str | None:
    """The request's session id (X-Session-Id or the body's); "new" makes one up (returned in the
    X-Session-Id response header)."""
    header = request.headers.get("x-session-id")
    if header and given and header != given:
        raise APIError(400, "X-Session-Id and session_id differ", param="session_id", code="invalid_value")
    sid = header or given
    return f"sess-{secrets.token_hex(16)}" if sid == NEW_SESSION else sid


def session_header(gen: Generation) -> dict[str, str]:
    """The session a turn belongs to (the id the server chose, for X-Session-Id: new)."""
    return {"X-Session-Id": gen.session_id} if gen.session_id else {}


def usage(fin: FinishEvent) -> dict[str, Any]:
    u = fin.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def fingerprint(state: ServerState) -> str:
    rt = state.runtime
    return f"slotserve-{rt.dtype}-{rt.precision}-{rt.kv_dtype}" if rt is not None else "slotserve"


def _token_text(state: ServerState, token_id: int) -> tuple[str, list[int]]:
    raw = state.runtime.tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def _chat_logprob(state: ServerState, ev: TokenEvent) -> dict[str, Any]:
    text, raw = _token_text(state, ev.token_id)
    tops = []
    for tid, lp in ev.top_logprobs or []:
        t, b = _token_text(state, tid)
        tops.append({"token": t, "logprob": lp, "bytes": b})
    return {"token": text, "logprob": ev.logprob, "bytes": raw, "top_logprobs": tops}


# ---- chat completions ----------------------------------------------------------------------------


def chat_params(body: ChatCompletionRequest, session_id: str | None, caller: Any = None) -> ChatParams:
    rf = body.output_format()
    tool_choice = body.tool_choice
    if tool_choice is not None and not isinstance(tool_choice, str):
        tool_choice = tool_choice.model_dump()
    return ChatParams(
        messages=[m.model_dump(exclude_none=True, exclude={"refusal", "audio", "function_call", "annotations"})
                  for m in body.messages],
        max_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        **body.repetition_values(), frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty, seed=body.seed, stop=body.stop_list(), logit_bias=body.bias(),
        logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0, response_format=rf,
        tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools is not None else None,
        tool_choice=tool_choice, ignore_eos=bool(body.ignore_eos), session_id=session_id, user=body.user,
        close_within_budget=body.close_within_budget is not False,
        cache_salt=body.cache_salt, caller=caller, truncation=body.truncation,
        parallel_tool_calls=body.parallel_tool_calls,
    )


async def chat_completion(request: Request, agent: AgentSpec, body: ChatCompletionRequest) -> Response:
    state = state_of(request)
    state.require_ready()
    check_supported(body)
    caller = state.auth.session_caller(request)
    idem, answer = await idempotent_request(request, state, agent, caller)
    if answer is not None:
        return _replay(answer, body)
    params = chat_params(body, session_id_of(request, body.session_id), caller)
    cid = f"chatcmpl-{secrets.token_hex(12)}"
    tracker = Tracker(state, agent.name, "chat", body.user)
    try:
        turn = await Turn.submit(state, agent, params, tracker, idem)
    except BaseException:
        if idem is not None:
            in_background(state, idem.abandon())
        raise
    turn.answer = lambda outcome, fin: _chat_body(state, turn.gen, cid, outcome, fin)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_chat_stream(turn, cid, include_usage, bool(body.logprobs)),
                                 media_type=MEDIA_TYPE, headers={**SSE_HEADERS, **session_header(turn.gen)})
    tokens, outcome, fin = await turn.collect(request)
    lp = [_chat_logprob(state, ev) for ev in tokens] if body.logprobs else None
    return JSONResponse(_chat_body(state, turn.gen, cid, outcome, fin, lp), headers=session_header(turn.gen))


def _chat_body(state: ServerState, gen: Generation, cid: str, outcome: Outcome, fin: FinishEvent,
               logprobs: list | None = None) -> dict[str, Any]:
    """A finished chat completion as the non-streaming API returns it (and idempotent retries replay it)."""
    choice: dict[str, Any] = {"index": 0, "message": {**outcome.message(), "refusal": None},
                              "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None,
                              "finish_reason": outcome.finish_reason, **outcome.extensions()}
    body = {"id": cid, "object": "chat.completion", "created": gen.created, "model": gen.agent.name,
            "system_fingerprint": fingerprint(state), "choices": [choice], "usage": usage(fin)}
    if gen.session_id:
        body["session_id"] = gen.session_id
    return body


def chat_delta(pieces: list[str | CallPiece]) -> dict[str, Any]:
    """A chunk's delta for answer text and tool-call pieces: a call's first piece carries its id and name,
    the rest its arguments as they are generated."""
    delta: dict[str, Any] = {}
    text = "".join(p for p in pieces if isinstance(p, str))
    if text:
        delta["content"] = text
    calls = []
    for p in pieces:
        if isinstance(p, CallPiece):
            calls.append({"index": p.index, "id": p.call_id, "type": "function",
                          "function": {"name": p.name, "arguments": ""}} if p.first
                         else {"index": p.index, "function": {"arguments": p.arguments}})
    if calls:
        delta["tool_calls"] = calls
    return delta


async def _chat_stream(turn: Turn, cid: str, include_usage: bool, logprobs: bool) -> AsyncIterator[bytes]:
    state, gen = turn.state, turn.gen
    base = {"id": cid, "object": "chat.completion.chunk", "created": gen.created, "model": gen.agent.name,
            "system_fingerprint": fingerprint(state)}

    def chunk(delta: dict[str, Any], finish: str | None = None, lp: list | None = None,
              extensions: dict[str, Any] | None = None) -> bytes:
        out = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": {"content": lp, "refusal": None}
                                    if lp is not None else None, "finish_reason": finish, **(extensions or {})}]}
        if include_usage:
            out["usage"] = None
        return sse(out)

    yield chunk({"role": "assistant", "content": ""})
    async with contextlib.aclosing(turn.events()) as events:  # its clean-up runs when this ends
        async for event in events:
            if isinstance(event, Step):
                delta = chat_delta(event.pieces)
                lp = [_chat_logprob(state, event.token)] if logprobs else None
                if delta or lp:
                    yield chunk(delta or {"content": ""}, lp=lp)
            elif isinstance(event, Finished):
                if delta := chat_delta(event.pieces):
                    yield chunk(delta)
                yield chunk({}, event.outcome.finish_reason, extensions=event.outcome.extensions())
            else:
                for end in _stream_end(event, base, include_usage):
                    yield end


def _replay(answer: dict[str, Any], body: ChatCompletionRequest) -> Response:
    """The first answer to this Idempotency-Key, in the shape this retry asked for."""
    headers = {"Idempotent-Replayed": "true"}
    if answer.get("session_id"):
        headers["X-Session-Id"] = answer["session_id"]
    if not body.stream:
        return JSONResponse(answer, headers=headers)
    base = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint")}
    base["object"] = "chat.completion.chunk"
    message, finish = answer["choices"][0]["message"], answer["choices"][0]["finish_reason"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    chunks = [sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}),
              sse({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}]})]
    if body.stream_options and body.stream_options.include_usage:
        chunks.append(sse({**base, "choices": [], "usage": answer["usage"]}))
    chunks.append(DONE)

    async def replay() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    return StreamingResponse(replay(), media_type=MEDIA_TYPE, headers={**SSE_HEADERS, **headers})


# ---- completions ---------------------------------------------------------------------------------


def _completion_params(body: CompletionRequest) -> ChatParams:
    rf = body.output_format()
    return ChatParams(
        prompt=body.prompt, max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, min_p=body.min_p, **body.repetition_values(),
        frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty, seed=body.seed,
        stop=body.stop_list(), logit_bias=body.bias(), logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0, response_format=rf, tools=None, tool_choice="none",
        ignore_eos=bool(body.ignore_eos), user=body.user, cache_salt=body.cache_salt,
        close_within_budget=body.close_within_budget is not False,
    )


def _legacy_logprobs(state: ServerState, events: list[TokenEvent], offset: int = 0) -> dict[str, Any]:
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    for ev in events:
        text, _ = _token_text(state, ev.token_id)
        tokens.append(text)
        lps.append(ev.logprob)
        tops.append({_token_text(state, t)[0]: lp for t, lp in ev.top_logprobs or []})
        offsets.append(pos)
        pos += len(ev.text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


async def completion(request: Request, agent: AgentSpec, body: CompletionRequest) -> Response:
    state = state_of(request)
    state.require_ready()
    check_supported(body)
    turn = await Turn.submit(state, agent, _completion_params(body), Tracker(state, agent.name, "completions",
                                                                            body.user))
    base = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": turn.gen.created,
            "model": agent.name, "system_fingerprint": fingerprint(state)}
    want_lp = body.logprobs is not None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_completion_stream(turn, base, include_usage, want_lp), media_type=MEDIA_TYPE,
                                 headers=SSE_HEADERS)
    tokens, outcome, fin = await turn.collect(request)
    return JSONResponse({**base, "choices": [{
        "text": outcome.content, "index": 0, "logprobs": _legacy_logprobs(state, tokens) if want_lp else None,
        "finish_reason": outcome.finish_reason, **outcome.extensions()}], "usage": usage(fin)})


async def _completion_stream(turn: Turn, base: dict[str, Any], include_usage: bool,
                             want_lp: bool) -> AsyncIterator[bytes]:
    def chunk(text: str, finish: str | None = None, lp: dict | None = None,
              extensions: dict[str, Any] | None = None) -> bytes:
        out = {**base, "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish,
                                    **(extensions or {})}]}
        if include_usage:
            out["usage"] = None
        return sse(out)

    offset = 0
    async with contextlib.aclosing(turn.events()) as events:  # its clean-up runs when this ends
        async for event in events:
            if isinstance(event, Step):
                text = "".join(event.pieces)
                lp = _legacy_logprobs(turn.state, [event.token], offset) if want_lp else None
                offset += len(event.token.text)
                if text or lp:
                    yield chunk(text, lp=lp)
            elif isinstance(event, Finished):
                yield chunk("".join(event.pieces), event.outcome.finish_reason, extensions=event.outcome.extensions())
            else:
                for end in _stream_end(event, base, include_usage):
                    yield end


def _stream_end(event: Failed | Committed, base: dict[str, Any], include_usage: bool) -> list[bytes]:
    """The last chunks of an OpenAI stream: its error event, or the usage chunk (if asked for) and [DONE]."""
    if isinstance(event, Failed):
        return [sse(event.error.body())]
    return [*([sse({**base, "choices": [], "usage": usage(event.fin)})] if include_usage else []), DONE]
