"""The HTTP app: configuration, start-up (the model loads on a background thread, so /health answers at
once and /ready reports progress), request ids and body limits, logging, and the operations routes
(``/health``, ``/ready``, ``/get_load``, ``/metrics``). The APIs live in their own modules, each a translation onto the
one turn pipeline of `server.turns`:

* `server.openai_api`: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (``model`` names the
  agent) and the same under ``/agents/{agent}/v1`` (a complete OpenAI base URL per agent);
* `server.responses_api`: the Responses API; `server.anthropic_api`: the Anthropic Messages API;
* `server.sessions_api`: server-side sessions; `server.admin_api`: agents created and changed over HTTP.

Nothing here imports JAX: the runtime is built by `agents.runtime.build_runtime`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from agents.adapters import AdapterLibrary
from agents.registry import AgentRegistry
from agents.runtime import Runtime, build_runtime
from agents.service import ChatService
from agents.store import Store, StoreUnavailableError, open_store
from server.admin_api import router as admin_router
from server.anthropic_api import router as anthropic_router
from server.auth import Auth
from server.config import ServerConfig
from server.dashboard import router as dashboard_router
from server.errors import NOT_READY_RETRY_AFTER_S, APIError, error_body, install_error_handlers, is_anthropic_path
from server.lora_api import router as lora_router
from server.metrics import CONTENT_TYPE, Metrics
from server.openai_api import router as openai_router
from server.responses_api import router as responses_router
from server.sessions_api import router as sessions_router
from server.state import RuntimeFactory, ServerState, state_of

log = logging.getLogger("slotserve.server")
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


# --------------------------------------------------------------------------------------------------
# state
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# middleware: request ids, body limit, access log
# --------------------------------------------------------------------------------------------------


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body exceeds {limit} bytes")


REPLICA_HEADER = b"x-slotserve-replica"


class RequestContext:
    """Pure ASGI (streaming-safe): X-Request-Id echo, X-Slotserve-Replica (which replica answered, behind a
    router), body size limit (413), one access log line."""

    def __init__(self, app, max_body_bytes: int, replica_name: str | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.replica_name = replica_name.encode() if replica_name else None
        self.hostname = socket.gethostname()

    def replica(self, scope) -> bytes:
        """The configured name, else hostname:port (the port this request came in on)."""
        if self.replica_name is not None:
            return self.replica_name
        server = scope.get("server") or (None, None)
        return f"{self.hostname}:{server[1]}".encode("latin-1", "replace")

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
        replica = self.replica(scope)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode()),
                                      (REPLICA_HEADER, replica)]
            await send(message)

        try:
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                error = APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
                shaped = error.anthropic_body() if is_anthropic_path(scope.get("path", "")) else error.body()
                body = json.dumps(shaped).encode()
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
            if scope.get("path") not in ("/health", "/metrics", "/ready", "/get_load"):
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
        factory = runtime_factory or (lambda progress: build_runtime(
            config.runtime_options(adapters_in_files=any(a.adapter for a in state.registry.file_agents)), progress))
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
    app.add_middleware(RequestContext, max_body_bytes=config.limits.max_body_bytes,
                       replica_name=config.server.replica_name)
    _add_routes(app)
    app.include_router(openai_router)
    app.include_router(anthropic_router)
    app.include_router(responses_router)
    app.include_router(sessions_router)
    app.include_router(admin_router)
    app.include_router(lora_router)
    app.include_router(dashboard_router)
    return app


def _open_store(config: ServerConfig) -> Store:
    s = config.store
    options = {"session_ttl": s.session_ttl_s or None, "max_sessions_per_agent": s.max_sessions_per_agent or None}
    if s.url.startswith(("redis://", "rediss://", "unix://")):
        from agents.store.redis_store import RedisStore

        return RedisStore(s.url, prefix=s.prefix, timeout_s=s.timeout_s, **options)
    return open_store(s.url, **options)


def _load(state: ServerState) -> None:
    """Background start-up: build (load + compile) the runtime, start the scheduler, then mark ready."""

    progress = state.startup
    begin = time.perf_counter()
    try:
        runtime = state.factory(progress)
        progress("start the scheduler")
        runtime.scheduler.on_failure = state.engine_died
        runtime.start()
        limits = state.config.limits
        registry = state.registry
        state.service = ChatService(
            runtime, state.store, default_max_tokens=limits.default_max_tokens,
            max_tokens_limit=limits.max_tokens, max_prompt_tokens=limits.max_prompt_tokens,
            lease_s=state.config.store.lease_s,
            agent_in_store=lambda name: registry is not None and not registry.is_file_agent(name),
            adapters=AdapterLibrary(runtime.adapter_reader(), state.config.adapter_dirs()),
        )
        if registry is not None:  # an agent file's adapter that does not load is a start-up error, as the file
            progress("read the agents' LoRA adapters")
            for agent in registry.file_agents:
                if agent.adapter is not None:
                    state.service.adapters.load(agent.adapter, trusted=True)
        state.runtime = runtime
        state.metrics.set_model_info({**runtime.info(), "dtype_reason": runtime.dtype_reason,
                                      "precision_reason": runtime.precision_reason,
                                      "kv_dtype_reason": runtime.kv_dtype_reason})
        progress.finish()
        state.ready.set()
        print(f"slotserve: ready in {time.perf_counter() - begin:.1f} s ({runtime.model_name}, {runtime.dtype}, "
              f"precision {runtime.precision}, KV {runtime.kv_dtype}, {runtime.num_slots} slots x "
              f"{runtime.max_len})", file=sys.stderr, flush=True)
    except BaseException as e:  # noqa: BLE001 - reported by /ready, the process stays up for diagnosis
        state.load_error = f"{type(e).__name__}: {e}"
        progress.finish()
        log.exception("model load failed")


# --------------------------------------------------------------------------------------------------
# routes
# --------------------------------------------------------------------------------------------------


def _engine_failed(reason: str) -> JSONResponse:
    body = error_body(f"the engine loop died ({reason}); the server must be restarted", "service_unavailable",
                      None, "engine_failed")
    body["status"] = "failed"
    return JSONResponse(body, status_code=503)


def _startup_summary(state: ServerState) -> dict[str, Any]:
    """What start-up took and what it loaded rather than built (the caches of a restart)."""
    runtime = state.runtime
    engine = runtime.engine
    timed = dict(engine.programs.warmup_seconds)  # copied at once: a background warm-up adds entries meanwhile
    slowest = sorted(timed.items(), key=lambda kv: -kv[1])[:5]
    return {"startup_s": state.startup.report()["stages_s"], "slowest_programs_s": dict(slowest),
            "weights_from_cache": runtime.weights_from_cache,
            "programs": engine.programs.counts()}


def _add_routes(app: FastAPI) -> None:
    @app.get("/health", tags=["operations"])
    async def health(request: Request) -> JSONResponse:
        failure = state_of(request).engine_failure
        if failure is not None:
            return _engine_failed(failure)
        return JSONResponse({"status": "ok"})

    @app.get("/ready", tags=["operations"])
    async def ready(request: Request) -> JSONResponse:
        state = state_of(request)
        if state.engine_failure is not None:
            return _engine_failed(state.engine_failure)
        try:
            await state.store.ping()
        except StoreUnavailableError as e:
            body = error_body(f"not ready: {e}", "service_unavailable", None, "store_unavailable")
            body.update(status="store_unavailable", store="unavailable")
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(NOT_READY_RETRY_AFTER_S)})
        if state.ready.is_set() and not state.shutting_down:
            return JSONResponse({"status": "ready", "model": state.runtime.model_name, "store": "ok",
                                 **_startup_summary(state)})
        status = "shutting_down" if state.shutting_down else ("failed" if state.load_error else "loading")
        where = state.startup.report()
        body = error_body(f"not ready: {state.load_error or where['stage'] or status}", "service_unavailable", None,
                          status)
        body.update(status=status, detail=where["stage"], progress=where)
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(NOT_READY_RETRY_AFTER_S)})

    @app.get("/get_load", tags=["operations"])
    async def get_load(request: Request) -> JSONResponse:
        """What a router balancing on load reads (vllm-router: ``load``): requests waiting plus running."""
        runtime = state_of(request).runtime
        waiting = runtime.scheduler.waiting if runtime is not None else 0
        running = runtime.scheduler.running if runtime is not None else 0
        return JSONResponse({"load": waiting + running, "waiting": waiting, "running": running})

    @app.get("/metrics", tags=["operations"])
    async def metrics(request: Request) -> Response:
        return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE)
