"""The HTTP server: OpenAI-compatible endpoints per agent, sessions, admin API, health and metrics.

Routes:

* ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``: ``model`` names the agent.
* ``/agents/{agent}/v1/...``: the same, with the agent fixed by the URL (a complete OpenAI base URL),
  plus ``GET|DELETE /agents/{agent}/v1/sessions/{id}`` and ``GET /agents/{agent}/v1/sessions``.
* ``/admin/agents`` (POST, GET) and ``/admin/agents/{name}`` (GET, PUT, PATCH, DELETE).
* ``/health`` (alive), ``/ready`` (503 until the model is loaded and warm), ``/metrics``.

The model loads on a background thread at start-up, so /health answers at once and /ready reports
progress. Nothing here imports JAX: the runtime is built by `agents.service.build_runtime`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import re
import secrets
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Body, FastAPI, HTTPException, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agents.registry import AgentRegistry
from agents.service import (
    ChatParams,
    ChatService,
    Generation,
    Runtime,
    SessionNotFoundError,
    ToolCallFilter,
    build_runtime,
)
from agents.spec import AgentSpec
from agents.store import AgentGoneError, SessionLimitError, Store, StoreUnavailableError, open_store
from scheduler.grammar_spec import GrammarBusyError
from scheduler.request import FinishEvent, FinishReason, QueueFullError, TokenEvent
from server import idempotency
from server.auth import Auth
from server.config import ServerConfig
from server.errors import APIError, error_body, install_error_handlers
from server.metrics import CONTENT_TYPE, Metrics
from server.schemas import ChatCompletionRequest, CompletionRequest, request_problem
from server.streaming import DONE, MEDIA_TYPE, SSE_HEADERS, sse

log = logging.getLogger("slotserve.server")
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

AgentName = Annotated[str, Path(examples=["assistant"], description="the agent's name")]
SessionId = Annotated[str, Path(examples=["session-1"], description="a session id (namespaced per agent)")]
RuntimeFactory = Callable[[Callable[[str], None]], Runtime]
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


# --------------------------------------------------------------------------------------------------
# state
# --------------------------------------------------------------------------------------------------


@dataclass
class ServerState:
    config: ServerConfig
    factory: RuntimeFactory
    own_runtime: bool
    auth: Auth
    metrics: Metrics | None = None
    store: Store | None = None
    registry: AgentRegistry | None = None
    runtime: Runtime | None = None
    service: ChatService | None = None
    status: str = "starting"
    load_error: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    shutting_down: bool = False
    live: set[Generation] = field(default_factory=set)  # in-flight generations (for graceful shutdown)
    background: set[asyncio.Task] = field(default_factory=set)  # commits that outlive their request
    # Called once if the engine loop dies (`slotserve serve` makes the process exit non-zero, so that a
    # supervisor restarts it); None: the app stays up and answers 503 with the reason.
    on_engine_failure: Callable[[str], None] | None = None

    @property
    def engine_failure(self) -> str | None:
        """Why the engine loop died, once it has."""
        return self.runtime.scheduler.failure if self.runtime is not None else None

    def engine_died(self, reason: str) -> None:
        log.error("the engine loop died; refusing every request from now on",
                  extra={"event": {"reason": reason, "in_flight": len(self.live)}})
        if self.on_engine_failure is not None:
            self.on_engine_failure(reason)

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new generations now; end the ones still running after ``grace_s`` (their streams get a
        final error event instead of being cut off when the server's own drain timeout expires)."""
        if self.shutting_down:
            return
        self.shutting_down = True
        log.info("shutting down", extra={"event": {"in_flight": len(self.live), "grace_s": grace_s}})

        def end_all() -> None:
            for gen in list(self.live):
                gen.cancel()

        timer = threading.Timer(grace_s, end_all)
        timer.daemon = True
        timer.start()

    def require_ready(self) -> ChatService:
        if self.engine_failure is not None:
            raise APIError(503, f"the engine loop died ({self.engine_failure}); the server must be restarted",
                           code="engine_failed")
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if not self.ready.is_set() or self.service is None:
            detail = f"model failed to load: {self.load_error}" if self.load_error else f"loading: {self.status}"
            raise APIError(503, f"the model is not ready ({detail})", code="model_not_ready",
                           headers={"Retry-After": "5"})
        return self.service


def _state(request: Request) -> ServerState:
    return request.app.state.slotserve


# --------------------------------------------------------------------------------------------------
# middleware: request ids, body limit, access log
# --------------------------------------------------------------------------------------------------


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body exceeds {limit} bytes")


class RequestContext:
    """Pure ASGI (streaming-safe): X-Request-Id echo, body size limit (413), one access log line."""

    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if _REQUEST_ID.fullmatch(given) else f"req_{uuid.uuid4().hex}"
        token = request_id_var.set(rid)
        scope.setdefault("state", {})["request_id"] = rid
        begin = time.perf_counter()
        status = {"code": 0}
        limit = self.max_body_bytes

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                body = json.dumps(error_body(f"the request body exceeds {limit} bytes", "request_too_large",
                                             None, "request_too_large")).encode()
                await send_with_id({"type": "http.response.start", "status": 413,
                                    "headers": [(b"content-type", b"application/json"),
                                                (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            received = 0

            async def limited_receive():
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        raise BodyTooLarge(limit)
                return message

            await self.app(scope, limited_receive, send_with_id)
        finally:
            if scope.get("path") not in ("/health", "/metrics", "/ready"):
                log.info("http", extra={"event": {
                    "method": scope.get("method"), "path": scope.get("path"), "status": status["code"],
                    "duration_ms": round((time.perf_counter() - begin) * 1e3, 2)}})
            request_id_var.reset(token)


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
            "request_id": request_id_var.get(), "msg": record.getMessage(),
        }
        event = getattr(record, "event", None)
        if isinstance(event, dict):
            out.update(event)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, "event", None)
        extra = " ".join(f"{k}={v}" for k, v in event.items()) if isinstance(event, dict) else ""
        base = f"{self.formatTime(record)} {record.levelname} [{request_id_var.get()}] {record.getMessage()}"
        return f"{base} {extra}".rstrip() + (f"\n{self.formatException(record.exc_info)}" if record.exc_info else "")


def configure_logging(level: str = "info", json_lines: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if json_lines else TextFormatter())
    root = logging.getLogger("slotserve")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


# --------------------------------------------------------------------------------------------------
# the app
# --------------------------------------------------------------------------------------------------


def create_app(
    config: ServerConfig | None = None,
    *,
    runtime_factory: RuntimeFactory | None = None,
    runtime: Runtime | None = None,
    own_runtime: bool | None = None,
) -> FastAPI:
    """The ASGI app. ``runtime_factory(progress)`` builds the runtime on a background thread (default:
    `build_runtime` from the config); or pass a ready ``runtime`` (shared by several apps: then the app
    does not stop it on shutdown unless ``own_runtime``)."""
    config = config or ServerConfig()
    if runtime is not None:
        given = runtime
        factory: RuntimeFactory = lambda progress: given  # noqa: E731
        own = bool(own_runtime)
    else:
        factory = runtime_factory or (lambda progress: build_runtime(config.runtime_options(), progress))
        own = True if own_runtime is None else own_runtime
    state = ServerState(config=config, factory=factory, own_runtime=own,
                        auth=Auth(config.auth.enabled, config.auth.admin_keys))
    state.metrics = Metrics(lambda: state.runtime, state.ready.is_set)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.store = _open_store(config)
        state.registry = AgentRegistry(state.store, config.agents_path())
        thread = threading.Thread(target=_load, args=(state,), name="slotserve-load", daemon=True)
        thread.start()
        try:
            yield
        finally:
            state.shutting_down = True
            if state.runtime is not None and state.own_runtime:
                await asyncio.to_thread(state.runtime.stop)
            await state.store.close()

    app = FastAPI(title="slotserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible multi-agent serving of one resident Gemma model.")
    app.state.slotserve = state
    install_error_handlers(app)
    app.add_middleware(RequestContext, max_body_bytes=config.limits.max_body_bytes)
    _add_routes(app)
    return app


def _open_store(config: ServerConfig) -> Store:
    s = config.store
    options = {"session_ttl": s.session_ttl_s or None, "max_sessions_per_agent": s.max_sessions_per_agent or None}
    if s.url.startswith(("redis://", "rediss://", "unix://")):
        from agents.redis_store import RedisStore

        return RedisStore(s.url, prefix=s.prefix, timeout_s=s.timeout_s, **options)
    return open_store(s.url, **options)


def _load(state: ServerState) -> None:
    """Background start-up: build (load + compile) the runtime, start the scheduler, then mark ready."""

    def progress(message: str) -> None:
        state.status = message
        print(f"slotserve: {message}", file=sys.stderr, flush=True)

    begin = time.perf_counter()
    try:
        runtime = state.factory(progress)
        runtime.scheduler.on_failure = state.engine_died
        runtime.start()
        limits = state.config.limits
        registry = state.registry
        state.service = ChatService(
            runtime, state.store, default_max_tokens=limits.default_max_tokens,
            max_tokens_limit=limits.max_tokens, max_prompt_tokens=limits.max_prompt_tokens,
            lease_s=state.config.store.lease_s,
            agent_in_store=lambda name: registry is not None and not registry.is_file_agent(name),
        )
        state.runtime = runtime
        state.metrics.set_model_info({**runtime.info(), "dtype_reason": runtime.dtype_reason,
                                      "precision_reason": runtime.precision_reason,
                                      "kv_dtype_reason": runtime.kv_dtype_reason})
        state.status = "ready"
        state.ready.set()
        progress(f"ready in {time.perf_counter() - begin:.1f} s ({runtime.model_name}, {runtime.dtype}, "
                 f"precision {runtime.precision}, KV {runtime.kv_dtype}, "
                 f"{runtime.num_slots} slots x {runtime.max_len})")
    except BaseException as e:  # noqa: BLE001 - reported by /ready, the process stays up for diagnosis
        state.load_error = f"{type(e).__name__}: {e}"
        state.status = "failed"
        log.exception("model load failed")


# --------------------------------------------------------------------------------------------------
# routes
# --------------------------------------------------------------------------------------------------


def _add_routes(app: FastAPI) -> None:
    @app.get("/health", tags=["operations"])
    async def health(request: Request) -> JSONResponse:
        failure = _state(request).engine_failure
        if failure is not None:
            return _engine_failed(failure)
        return JSONResponse({"status": "ok"})

    @app.get("/ready", tags=["operations"])
    async def ready(request: Request) -> JSONResponse:
        state = _state(request)
        if state.engine_failure is not None:
            return _engine_failed(state.engine_failure)
        try:
            await state.store.ping()
        except StoreUnavailableError as e:
            body = error_body(f"not ready: {e}", "service_unavailable", None, "store_unavailable")
            body.update(status="store_unavailable", store="unavailable")
            return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
        if state.ready.is_set() and not state.shutting_down:
            return JSONResponse({"status": "ready", "model": state.runtime.model_name, "store": "ok"})
        status = "shutting_down" if state.shutting_down else ("failed" if state.load_error else "loading")
        body = error_body(f"not ready: {state.load_error or state.status}", "service_unavailable", None, status)
        body["status"] = status
        body["detail"] = state.status
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    @app.get("/metrics", tags=["operations"])
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)

    # ---- OpenAI: /v1 (model = agent) and /agents/{agent}/v1 ---------------------------------------

    @app.get("/v1/models", tags=["openai"])
    async def list_models(request: Request) -> dict[str, Any]:
        state = _state(request)
        state.auth.require_key_if_enabled(request)
        agents = [a for a in await state.registry.list() if state.auth.may_use(request, a)]
        return {"object": "list", "data": [_model_card(a) for a in agents]}

    @app.get("/v1/models/{model}", tags=["openai"])
    async def get_model(request: Request, model: str) -> dict[str, Any]:
        agent = await _agent(request, model)
        return _model_card(agent)

    async def _agent_of(request: Request, model: str | None) -> Any:
        """On /v1 the `model` field names the agent."""
        if not model:
            raise APIError(400, "model is required: the name of an agent (see GET /v1/models)", param="model",
                           code="missing_required_parameter")
        return await _agent(request, model)

    @app.post("/v1/chat/completions", tags=["openai"])
    async def chat(request: Request, body: ChatCompletionRequest) -> Response:
        return await _chat(request, await _agent_of(request, body.model), body)

    @app.post("/v1/completions", tags=["openai"])
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await _complete(request, await _agent_of(request, body.model), body)

    @app.get("/agents/{agent}/v1/models", tags=["agents"])
    async def agent_models(request: Request, agent: AgentName) -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(await _agent(request, agent))]}

    @app.get("/agents/{agent}/v1/models/{model}", tags=["agents"])
    async def agent_model(request: Request, agent: AgentName, model: str) -> dict[str, Any]:
        spec = await _agent(request, agent)
        if model != spec.name:
            raise APIError(404, f"this endpoint serves agent {spec.name!r} only", param="model",
                           code="model_not_found")
        return _model_card(spec)

    @app.post("/agents/{agent}/v1/chat/completions", tags=["agents"])
    async def agent_chat(request: Request, agent: AgentName, body: ChatCompletionRequest) -> Response:
        return await _chat(request, await _agent(request, agent), body)

    @app.post("/agents/{agent}/v1/completions", tags=["agents"])
    async def agent_completions(request: Request, agent: AgentName, body: CompletionRequest) -> Response:
        return await _complete(request, await _agent(request, agent), body)

    # ---- sessions --------------------------------------------------------------------------------

    @app.get("/agents/{agent}/v1/sessions", tags=["sessions"])
    async def list_sessions(request: Request, agent: AgentName) -> dict[str, Any]:
        spec = await _agent(request, agent)
        caller = _state(request).auth.session_caller(request)
        infos = await _state(request).store.list_sessions(spec.name)
        return {"object": "list", "data": [
            {"id": i.id, "object": "session", "agent": i.agent, "created": i.created, "updated": i.updated,
             "expires_at": i.expires_at, "message_count": i.message_count}
            for i in infos if caller is None or caller.may_see(i)]}

    @app.get("/agents/{agent}/v1/sessions/{session_id}", tags=["sessions"])
    async def get_session(request: Request, agent: AgentName, session_id: SessionId) -> dict[str, Any]:
        spec = await _agent(request, agent)
        session = await _visible_session(request, spec, session_id)
        return {"id": session.id, "object": "session", "agent": session.agent, "created": session.created,
                "updated": session.updated, "expires_at": session.expires_at, "messages": session.messages}

    @app.delete("/agents/{agent}/v1/sessions/{session_id}", tags=["sessions"])
    async def delete_session(request: Request, agent: AgentName, session_id: SessionId) -> dict[str, Any]:
        spec = await _agent(request, agent)
        await _visible_session(request, spec, session_id)
        if not await _state(request).store.delete_session(spec.name, session_id):
            raise SessionNotFoundError(spec.name, session_id)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    # ---- admin -------------------------------------------------------------------------------------

    @app.post("/admin/agents", status_code=201, tags=["admin"])
    async def create_agent(request: Request, spec: AgentSpec) -> dict[str, Any]:
        state = _state(request)
        state.auth.require_admin(request)
        return _admin_view(state, await state.registry.create(spec))

    @app.get("/admin/agents", tags=["admin"])
    async def admin_list(request: Request) -> dict[str, Any]:
        state = _state(request)
        state.auth.require_admin(request)
        return {"object": "list", "data": [_admin_view(state, a) for a in await state.registry.list()]}

    @app.get("/admin/agents/{name}", tags=["admin"])
    async def admin_get(request: Request, name: str) -> dict[str, Any]:
        state = _state(request)
        state.auth.require_admin(request)
        return _admin_view(state, await state.registry.get(name))

    @app.put("/admin/agents/{name}", tags=["admin"])
    async def admin_put(request: Request, name: str, spec: AgentSpec) -> dict[str, Any]:
        state = _state(request)
        state.auth.require_admin(request)
        if spec.name != name:
            raise APIError(400, f"the body's name {spec.name!r} differs from the URL's {name!r}", param="name",
                           code="invalid_value")
        return _admin_view(state, await state.registry.update(spec))

    @app.patch("/admin/agents/{name}", tags=["admin"])
    async def admin_patch(request: Request, name: str, changes: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
        state = _state(request)
        state.auth.require_admin(request)
        return _admin_view(state, await state.registry.patch(name, changes))

    @app.delete("/admin/agents/{name}", tags=["admin"])
    async def admin_delete(request: Request, name: str) -> dict[str, Any]:
        state = _state(request)
        state.auth.require_admin(request)
        await state.registry.delete(name)
        return {"id": name, "object": "agent.deleted", "deleted": True}


def _model_card(agent: AgentSpec) -> dict[str, Any]:
    return {"id": agent.name, "object": "model", "created": 0, "owned_by": "slotserve",
            "description": agent.description}


def _admin_view(state: ServerState, agent: AgentSpec) -> dict[str, Any]:
    view = agent.public_dict()
    view["source"] = "file" if state.registry.is_file_agent(agent.name) else "store"
    return view


async def _agent(request: Request, name: str) -> AgentSpec:
    """The agent, after authentication: missing key 401 (auth on), unknown 404, wrong key 403."""
    state = _state(request)
    state.auth.require_key_if_enabled(request)
    agent = await state.registry.get(name)
    state.auth.require_agent(request, agent)
    return agent


def _check_supported(body: ChatCompletionRequest | CompletionRequest) -> None:
    problem = request_problem(body)
    if problem is not None:
        param, message, code = problem
        raise APIError(400, message, param=param, code=code)


async def _visible_session(request: Request, spec: AgentSpec, session_id: str) -> Any:
    """The session if it exists and the caller may see it (its creator's key, or an admin key), else 404."""
    session = await _state(request).store.get_session(spec.name, session_id)
    caller = _state(request).auth.session_caller(request)
    if session is None or (caller is not None and not caller.may_see(session)):
        raise SessionNotFoundError(spec.name, session_id)
    return session


NEW_SESSION = "new"  # X-Session-Id / session_id value asking the server to choose an unguessable id


def _session_id(request: Request, body: ChatCompletionRequest) -> str | None:
    """The request's session id; "new" makes one up (returned in the X-Session-Id response header)."""
    header = request.headers.get("x-session-id")
    if header and body.session_id and header != body.session_id:
        raise APIError(400, "X-Session-Id and session_id differ", param="session_id", code="invalid_value")
    sid = header or body.session_id
    return f"sess-{secrets.token_hex(16)}" if sid == NEW_SESSION else sid


def _usage(fin: FinishEvent) -> dict[str, Any]:
    u = fin.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class _Tracker:
    """Per-request metrics: TTFT, inter-token latency, tokens, finish reasons."""

    def __init__(self, state: ServerState, agent: str, endpoint: str) -> None:
        self.m = state.metrics
        self.agent = agent
        self.endpoint = endpoint
        self.begin = time.perf_counter()
        self.last: float | None = None
        self.user: str | None = None  # the request's `user` (logged, for abuse tracing)

    def token(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.m.ttft.labels(self.agent).observe(now - self.begin)
        else:
            self.m.inter_token.labels(self.agent).observe(now - self.last)
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


async def _watch_disconnect(request: Request, gen: Generation) -> None:
    """Non-streaming requests: cancel the generation when the client goes away."""
    while True:
        if await request.is_disconnected():
            gen.cancel()
            return
        await asyncio.sleep(0.1)


async def _collect(request: Request, gen: Generation, tracker: _Tracker) -> tuple[list[TokenEvent], str, FinishEvent]:
    events: list[TokenEvent] = []
    parts: list[str] = []
    watcher = asyncio.create_task(_watch_disconnect(request, gen))
    try:
        async for ev in gen.handle:
            if isinstance(ev, TokenEvent):
                tracker.token()
                events.append(ev)
                parts.append(ev.text)
            else:
                parts.append(ev.text)
                return events, "".join(parts), ev
    finally:
        watcher.cancel()
        _state(request).live.discard(gen)
        if gen.handle.finished is None:
            gen.cancel()
    raise RuntimeError("the event stream ended without a finish event")


CLIENT_CLOSED = 499  # the status metrics and logs give a request whose client went away (nginx's convention)


def _in_background(state: ServerState, work: Any) -> asyncio.Task:
    """Run ``work`` (a coroutine) to its end even if the request that started it is cancelled."""
    task = asyncio.ensure_future(work)
    state.background.add(task)
    task.add_done_callback(state.background.discard)
    return task


def _engine_failed(reason: str) -> JSONResponse:
    body = error_body(f"the engine loop died ({reason}); the server must be restarted", "service_unavailable",
                      None, "engine_failed")
    body["status"] = "failed"
    return JSONResponse(body, status_code=503)


def _generation_failed(fin: FinishEvent, state: ServerState) -> APIError:
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


def _chat_params(body: ChatCompletionRequest, session_id: str | None, caller: Any = None) -> ChatParams:
    rf = body.response_format.model_dump(by_alias=True, exclude_none=True) if body.response_format else None
    tool_choice = body.tool_choice
    if tool_choice is not None and not isinstance(tool_choice, str):
        tool_choice = tool_choice.model_dump()
    return ChatParams(
        messages=[m.model_dump(exclude_none=True, exclude={"refusal", "audio", "function_call", "annotations"})
                  for m in body.messages],
        max_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty, seed=body.seed, stop=body.stop_list(), logit_bias=body.bias(),
        logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0, response_format=rf,
        tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools is not None else None,
        tool_choice=tool_choice, ignore_eos=bool(body.ignore_eos), session_id=session_id, user=body.user,
        cache_salt=body.cache_salt, caller=caller, truncation=body.truncation,
    )


async def _submit(state: Any, service: Any, agent: Any, params: Any, tracker: Any) -> Any:
    """Submit a generation, counting a refusal under its own HTTP status in the metrics."""
    try:
        gen = await service.submit(agent, params)
    except Exception as exc:
        overloaded = isinstance(exc, QueueFullError | SessionLimitError | GrammarBusyError)
        tracker.done(None, 429 if overloaded else getattr(exc, "status", 400))
        raise
    state.live.add(gen)
    return gen


async def _chat(request: Request, agent: AgentSpec, body: ChatCompletionRequest) -> Response:
    state = _state(request)
    service = state.require_ready()
    _check_supported(body)
    caller = state.auth.session_caller(request)
    idem = None
    if (key := request.headers.get(idempotency.HEADER)) is not None:
        scope = f"{agent.name}\0{caller.owner if caller is not None and caller.owner else ''}"
        idem = idempotency.IdempotentRequest(state.store, scope, key, wait_s=IDEMPOTENT_WAIT_S,
                                             lease_s=state.config.store.lease_s)
        answer = await idem.start()
        if answer is not None:
            return _replay(answer, body)
    try:
        return await _chat_turn(request, state, service, agent, body, caller, idem)
    except BaseException:
        if idem is not None:
            _in_background(state, idem.abandon())
        raise


IDEMPOTENT_WAIT_S = 300.0  # how long a retry waits for the first request with its Idempotency-Key


async def _chat_turn(request: Request, state: ServerState, service: ChatService, agent: AgentSpec,
                     body: ChatCompletionRequest, caller: Any, idem: idempotency.IdempotentRequest | None) -> Response:
    params = _chat_params(body, _session_id(request, body), caller)
    tracker = _Tracker(state, agent.name, "chat")
    tracker.user = body.user
    gen = await _submit(state, service, agent, params, tracker)
    cid = f"chatcmpl-{secrets.token_hex(12)}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_chat_stream(state, gen, tracker, cid, include_usage, bool(body.logprobs), idem),
                                 media_type=MEDIA_TYPE, headers={**SSE_HEADERS, **_session_header(gen)})
    try:
        events, text, fin = await _collect(request, gen, tracker)
        if fin.reason not in (FinishReason.STOP, FinishReason.LENGTH):
            error = _generation_failed(fin, state)
            tracker.done(fin, error.status)
            raise error
        outcome = service.finish(gen, text, fin.reason)
        # Generation finished: the turn is committed even if the client is gone by now.
        await asyncio.shield(_in_background(state, service.commit(gen, outcome)))
    finally:
        if gen.claim is not None:  # the turn ended without a commit: free the session
            _in_background(state, service.release(gen))
    tracker.done(fin, 200, outcome.finish_reason)
    lp = [_chat_logprob(state, ev) for ev in events] if body.logprobs else None
    answer = _chat_body(state, gen, cid, outcome, fin, lp)
    if idem is not None:
        await asyncio.shield(_in_background(state, idem.finish(answer)))
    return JSONResponse(answer, headers=_session_header(gen))


def _chat_body(state: ServerState, gen: Generation, cid: str, outcome: Any, fin: FinishEvent,
               logprobs: list | None = None) -> dict[str, Any]:
    """A finished chat completion as the non-streaming API returns it (and idempotent retries replay it)."""
    choice: dict[str, Any] = {"index": 0, "message": {**outcome.message(), "refusal": None},
                              "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None,
                              "finish_reason": outcome.finish_reason}
    body = {"id": cid, "object": "chat.completion", "created": gen.created, "model": gen.agent.name,
            "system_fingerprint": _fingerprint(state), "choices": [choice], "usage": _usage(fin)}
    if gen.session_id:
        body["session_id"] = gen.session_id
    return body


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


def _session_header(gen: Generation) -> dict[str, str]:
    """The session a turn belongs to (the id the server chose, for X-Session-Id: new)."""
    return {"X-Session-Id": gen.session_id} if gen.session_id else {}


def _fingerprint(state: ServerState) -> str:
    rt = state.runtime
    return f"slotserve-{rt.dtype}-{rt.precision}-{rt.kv_dtype}" if rt is not None else "slotserve"


async def _chat_stream(state: ServerState, gen: Generation, tracker: _Tracker, cid: str, include_usage: bool,
                       logprobs: bool, idem: idempotency.IdempotentRequest | None = None) -> AsyncIterator[bytes]:
    service = state.service
    base = {"id": cid, "object": "chat.completion.chunk", "created": gen.created, "model": gen.agent.name,
            "system_fingerprint": _fingerprint(state)}

    def chunk(delta: dict[str, Any], finish: str | None = None, lp: list | None = None) -> bytes:
        out = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": {"content": lp, "refusal": None}
                                    if lp is not None else None, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return sse(out)

    filt = ToolCallFilter(gen.tool_mode)
    parts: list[str] = []
    status = 200
    fin: FinishEvent | None = None
    commit: asyncio.Task | None = None
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for ev in gen.handle:
            if isinstance(ev, TokenEvent):
                tracker.token()
                parts.append(ev.text)
                out = filt.push(ev.text)
                lp = [_chat_logprob(state, ev)] if logprobs else None
                if out or lp:
                    yield chunk({"content": out}, lp=lp)
                continue
            fin = ev
            parts.append(ev.text)
            tail = filt.push(ev.text)
            if ev.reason not in (FinishReason.STOP, FinishReason.LENGTH):
                error = _generation_failed(ev, state)
                status = error.status
                yield sse(error.body())
                return
            outcome = service.finish(gen, "".join(parts), ev.reason)
            if outcome.tool_calls:
                calls = [{"index": i, **call} for i, call in enumerate(outcome.tool_calls)]
                yield chunk({"tool_calls": calls})
            else:
                rest = tail if filt.released else filt.held
                if rest:
                    yield chunk({"content": rest})
            # Generation finished: the turn is committed whether or not the client stays for the finish chunk,
            # and before [DONE], so a client that saw DONE sees the turn.
            commit = _in_background(state, service.commit(gen, outcome))
            yield chunk({}, outcome.finish_reason)
            try:
                await asyncio.shield(commit)
            except Exception as e:  # noqa: BLE001 - reported in the stream; the response has started
                status = 429 if isinstance(e, SessionLimitError) else 404 if isinstance(e, AgentGoneError) else 500
                yield sse(error_body(f"the session turn was not stored: {e}", "server_error", "session_id",
                                     "session_commit_failed"))
                return
            if idem is not None:
                await asyncio.shield(_in_background(state, idem.finish(_chat_body(state, gen, cid, outcome, ev))))
                idem = None
            if include_usage:
                yield sse({**base, "choices": [], "usage": _usage(ev)})
            yield DONE
            tracker.done(ev, status, outcome.finish_reason)
            return
    finally:
        state.live.discard(gen)
        if gen.handle.finished is None:  # client went away (or shutdown): free the slot now
            gen.cancel()
            tracker.done(None, CLIENT_CLOSED)
        elif status != 200:
            tracker.done(fin, status)
        if gen.claim is not None and commit is None:  # the turn ended without a commit: free the session
            _in_background(state, service.release(gen))
        if idem is not None:  # no answer recorded: a retry runs the request again
            _in_background(state, idem.abandon())


def _completion_params(body: CompletionRequest) -> ChatParams:
    rf = body.response_format.model_dump(by_alias=True, exclude_none=True) if body.response_format else None
    return ChatParams(
        prompt=body.prompt, max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty, seed=body.seed,
        stop=body.stop_list(), logit_bias=body.bias(), logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0, response_format=rf, tools=None, tool_choice="none",
        ignore_eos=bool(body.ignore_eos), user=body.user, cache_salt=body.cache_salt,
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


async def _complete(request: Request, agent: AgentSpec, body: CompletionRequest) -> Response:
    state = _state(request)
    service = state.require_ready()
    _check_supported(body)
    tracker = _Tracker(state, agent.name, "completions")
    tracker.user = body.user
    params = _completion_params(body)
    gen = await _submit(state, service, agent, params, tracker)
    cid = f"cmpl-{secrets.token_hex(12)}"
    base = {"id": cid, "object": "text_completion", "created": gen.created, "model": agent.name,
            "system_fingerprint": _fingerprint(state)}
    want_lp = body.logprobs is not None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_completion_stream(state, gen, tracker, base, include_usage, want_lp),
                                 media_type=MEDIA_TYPE, headers=SSE_HEADERS)
    events, text, fin = await _collect(request, gen, tracker)
    if fin.reason not in (FinishReason.STOP, FinishReason.LENGTH):
        error = _generation_failed(fin, state)
        tracker.done(fin, error.status)
        raise error
    finish = str(fin.reason)
    tracker.done(fin, 200, finish)
    return JSONResponse({**base, "choices": [{
        "text": text, "index": 0, "logprobs": _legacy_logprobs(state, events) if want_lp else None,
        "finish_reason": finish}], "usage": _usage(fin)})


async def _completion_stream(state: ServerState, gen: Generation, tracker: _Tracker, base: dict[str, Any],
                             include_usage: bool, want_lp: bool) -> AsyncIterator[bytes]:
    def chunk(text: str, finish: str | None = None, lp: dict | None = None) -> bytes:
        out = {**base, "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return sse(out)

    status = 200
    fin: FinishEvent | None = None
    offset = 0
    try:
        async for ev in gen.handle:
            if isinstance(ev, TokenEvent):
                tracker.token()
                lp = _legacy_logprobs(state, [ev], offset) if want_lp else None
                offset += len(ev.text)
                if ev.text or lp:
                    yield chunk(ev.text, lp=lp)
                continue
            fin = ev
            if ev.reason not in (FinishReason.STOP, FinishReason.LENGTH):
                error = _generation_failed(ev, state)
                status = error.status
                yield sse(error.body())
                return
            yield chunk(ev.text, str(ev.reason))
            if include_usage:
                yield sse({**base, "choices": [], "usage": _usage(ev)})
            yield DONE
            tracker.done(ev, 200, str(ev.reason))
            return
    finally:
        state.live.discard(gen)
        if gen.handle.finished is None:
            gen.cancel()
            tracker.done(None, CLIENT_CLOSED)
        elif status != 200:
            tracker.done(fin, status)
