"""One generation turn as every API serves it: submit, stream, finish, commit, account. The API modules
(`openai_api`, `anthropic_api`, `responses_api`) only translate requests in and these events out.

`Turn.events` yields, in order: one `Step` per generated token (its text split into answer text and
tool-call pieces, see `agents.tool_calls.ToolCallStream`), then `Finished` (the parsed outcome; the
session commit has started), then either `Committed` or `Failed`. A turn whose generation finished is
committed whether or not its client is still there; a turn cut short frees its slot and its session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from agents.chat_params import ChatParams
from agents.service import ChatService, Generation, Outcome
from agents.spec import AgentSpec
from agents.store import AgentGoneError, Session, SessionLimitError, StoreUnavailableError
from agents.tool_calls import CallPiece
from scheduler.grammar_spec import GrammarBusyError
from scheduler.request import FinishEvent, FinishReason, QueueFullError, TokenEvent
from server import idempotency
from server.errors import APIError
from server.state import ServerState

log = logging.getLogger("slotserve.server")

CLIENT_CLOSED = 499  # the status metrics and logs give a request whose client went away (nginx's convention)
IDEMPOTENT_WAIT_S = 300.0  # how long a retry waits for the first request with its Idempotency-Key
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


class Tracker:
    """Per-request metrics: TTFT, inter-token latency, tokens, finish reasons."""

    def __init__(self, state: ServerState, agent: str, endpoint: str, user: str | None = None) -> None:
        self.m = state.metrics
        self.agent = agent
        self.endpoint = endpoint
        self.begin = time.perf_counter()
        self.last: float | None = None
        self.user = user  # the request's `user` (logged, for abuse tracing)

    def token(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.m.ttft.labels(self.agent).observe(now - self.begin)
            self.m.recent_ttft.observe(now - self.begin)
        else:
            self.m.inter_token.labels(self.agent).observe(now - self.last)
            self.m.recent_inter_token.observe(now - self.last)
        self.last = now

    def done(self, fin: FinishEvent | None, status: int, finish_reason: str | None = None) -> None:
        self.m.requests.labels(self.agent, self.endpoint, str(status)).inc()
        if fin is None:
            return
        u = fin.usage
        self.m.prompt_tokens.labels(self.agent).inc(u.prompt_tokens)
        self.m.cached_tokens.labels(self.agent).inc(u.cached_tokens)
        self.m.completion_tokens.labels(self.agent).inc(u.completion_tokens)
        self.m.duration.labels(self.agent).observe(time.perf_counter() - self.begin)
        self.m.finished.labels(self.agent, finish_reason or str(fin.reason)).inc()
        log.info("generation", extra={"event": {
            "agent": self.agent, "endpoint": self.endpoint, "finish_reason": finish_reason or str(fin.reason),
            "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
            "completion_tokens": u.completion_tokens, "user": self.user,
            **{k: round(v, 4) for k, v in fin.timings.items()}}})


# ---- events --------------------------------------------------------------------------------------


@dataclass
class Step:
    """One generated token: ``pieces`` is what became final with it (answer text, tool-call pieces)."""

    token: TokenEvent
    pieces: list[str | CallPiece]


@dataclass
class Finished:
    """Generation ended normally; ``pieces`` is what was still held. The commit is under way."""

    outcome: Outcome
    fin: FinishEvent
    pieces: list[str | CallPiece]


@dataclass
class Committed:
    """The turn is stored (if it belongs to a session): the API may end its response."""

    fin: FinishEvent


@dataclass
class Failed:
    """The turn ended with an error (generation failed, or its commit did)."""

    error: APIError


Event = Step | Finished | Committed | Failed


# ---- helpers -------------------------------------------------------------------------------------


def in_background(state: ServerState, work: Any) -> asyncio.Task:
    """Run ``work`` (a coroutine) to its end even if the request that started it is cancelled."""
    task = asyncio.ensure_future(work)
    state.background.add(task)
    task.add_done_callback(state.background.discard)
    return task


def generation_failed(fin: FinishEvent, state: ServerState) -> APIError:
    if state.engine_failure is not None:
        return APIError(503, f"generation ended: the engine loop died ({state.engine_failure})",
                        code="engine_failed")
    if fin.reason is FinishReason.CANCELLED and not state.shutting_down:
        # Only the client cancels outside a shutdown (it went away): recorded as nginx's 499, not a 503.
        return APIError(CLIENT_CLOSED, "the client closed the request", code="client_closed_request")
    if fin.reason is FinishReason.CANCELLED:
        return APIError(503, f"generation ended early: {fin.error or 'the server is shutting down'}",
                        code="shutting_down")
    return APIError(500, f"generation failed: {fin.error}", code="generation_error")


def commit_failed(e: Exception) -> APIError:
    """The error a turn whose commit failed ends with (its response may have started)."""
    status, code = {SessionLimitError: (429, "session_limit"), AgentGoneError: (404, "agent_deleted"),
                    StoreUnavailableError: (503, "store_unavailable")}.get(type(e), (500, "session_commit_failed"))
    return APIError(status, f"the session turn was not stored: {e}", param="session_id", code=code)


async def idempotent_request(request: Request, state: ServerState, agent: AgentSpec, caller: Any
                             ) -> tuple[idempotency.IdempotentRequest | None, dict[str, Any] | None]:
    """(the claim this request holds on its Idempotency-Key, or the first request's answer to replay);
    (None, None) without the header."""
    key = request.headers.get(idempotency.HEADER)
    if key is None:
        return None, None
    scope = f"{agent.name}\0{caller.owner if caller is not None and caller.owner else ''}"
    idem = idempotency.IdempotentRequest(state.store, scope, key, wait_s=IDEMPOTENT_WAIT_S,
                                         lease_s=state.config.store.lease_s)
    answer = await idem.start()
    return (None, answer) if answer is not None else (idem, None)


# ---- the turn ------------------------------------------------------------------------------------


@dataclass(eq=False)
class Turn:
    """A submitted generation and what finishing it takes. ``answer(outcome, fin)`` is the API's finished
    response body, recorded for Idempotency-Key retries."""

    state: ServerState
    gen: Generation
    tracker: Tracker
    idem: idempotency.IdempotentRequest | None = None
    answer: Callable[[Outcome, FinishEvent], dict[str, Any]] | None = None
    # Run once the turn is stored, before `Committed` (the Responses API stores its response object there).
    after_commit: Callable[[Outcome, FinishEvent, Session | None], Awaitable[None]] | None = None
    committed: bool = field(default=False, init=False)

    @classmethod
    async def submit(cls, state: ServerState, agent: AgentSpec, params: ChatParams, tracker: Tracker,
                     idem: idempotency.IdempotentRequest | None = None, answer: Any = None) -> Turn:
        """Submit the generation, counting a refusal under its own HTTP status in the metrics."""
        service = state.require_ready()
        try:
            gen = await service.submit(agent, params)
        except Exception as exc:
            overloaded = isinstance(exc, QueueFullError | SessionLimitError | GrammarBusyError)
            tracker.done(None, 429 if overloaded else getattr(exc, "status", 400))
            raise
        state.live.add(gen)
        return cls(state, gen, tracker, idem, answer)

    @property
    def service(self) -> ChatService:
        return self.state.service

    async def events(self) -> AsyncIterator[Event]:
        service, gen, tracker = self.service, self.gen, self.tracker
        calls = service.call_stream(gen)
        parts: list[str] = []
        status, fin = 200, None
        commit: asyncio.Task | None = None
        try:
            async for ev in gen.handle:
                if isinstance(ev, TokenEvent):
                    tracker.token()
                    parts.append(ev.text)
                    yield Step(ev, calls.push(ev.text))
                    continue
                fin = ev
                parts.append(ev.text)
                tail = calls.push(ev.text)
                if ev.reason not in (FinishReason.STOP, FinishReason.LENGTH):
                    error = generation_failed(ev, self.state)
                    status = error.status
                    yield Failed(error)
                    return
                outcome = service.finish(gen, "".join(parts), ev.reason, calls.call_ids, ev.budget_closed)
                # Generation finished: the turn is committed whether or not the client stays to the end.
                commit = in_background(self.state, service.commit(gen, outcome))
                yield Finished(outcome, ev, tail + calls.finish())
                try:
                    session = await asyncio.shield(commit)
                    if self.after_commit is not None:
                        await asyncio.shield(in_background(self.state, self.after_commit(outcome, ev, session)))
                except Exception as e:  # noqa: BLE001 - reported in the response; generation is done
                    error = commit_failed(e)
                    status = error.status
                    yield Failed(error)
                    return
                self.committed = True
                if self.idem is not None and self.answer is not None:
                    await asyncio.shield(in_background(self.state, self.idem.finish(self.answer(outcome, ev))))
                    self.idem = None
                tracker.done(ev, 200, outcome.finish_reason)
                yield Committed(ev)
                return
        finally:
            self.state.live.discard(gen)
            if gen.handle.finished is None:  # the client went away (or shutdown): free the slot now
                gen.cancel()
                tracker.done(None, CLIENT_CLOSED)
            elif status != 200:
                tracker.done(fin, status)
            if gen.claim is not None and commit is None:  # the turn ended without a commit: free the session
                in_background(self.state, service.release(gen))
            if self.idem is not None:  # no answer recorded: a retry runs the request again
                in_background(self.state, self.idem.abandon())

    async def collect(self, request: Request) -> tuple[list[TokenEvent], Outcome, FinishEvent]:
        """A non-streaming turn: every token, the outcome and the finish event once committed; raises the
        turn's APIError. The generation is cancelled if the client goes away before it finishes."""
        tokens: list[TokenEvent] = []
        finished: Finished | None = None
        watcher = asyncio.create_task(self._watch_disconnect(request))
        try:
            async with contextlib.aclosing(self.events()) as events:  # its clean-up runs when this ends
                async for event in events:
                    if isinstance(event, Step):
                        tokens.append(event.token)
                    elif isinstance(event, Finished):
                        finished = event
                        watcher.cancel()
                    elif isinstance(event, Failed):
                        raise event.error
                    else:
                        return tokens, finished.outcome, finished.fin
        finally:
            watcher.cancel()
        raise RuntimeError("the event stream ended without a finish event")

    async def _watch_disconnect(self, request: Request) -> None:
        while True:
            if await request.is_disconnected():
                self.gen.cancel()
                return
            await asyncio.sleep(DISCONNECT_POLL_S)
