"""What the server holds while it runs (`ServerState`): config, store, registry, runtime, in-flight work."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Path, Request

from agents.registry import AgentRegistry
from agents.runtime import Runtime
from agents.service import ChatService, Generation
from agents.spec import AgentSpec
from agents.store import Store
from server.auth import Auth
from server.config import ServerConfig
from server.errors import NOT_READY_RETRY_AFTER_S, APIError
from server.metrics import Metrics
from server.startup import StartupProgress

log = logging.getLogger("slotserve.server")
AgentName = Annotated[str, Path(examples=["assistant"], description="the agent's name")]
SessionId = Annotated[str, Path(examples=["session-1"], description="a session id (namespaced per agent)")]
RuntimeFactory = Callable[[Callable[[str], None]], Runtime]


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
    startup: StartupProgress = field(default_factory=StartupProgress)  # start-up stages, for logs and /ready
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
            stage = self.startup.report()["stage"] or "starting"
            detail = f"model failed to load: {self.load_error}" if self.load_error else f"loading: {stage}"
            raise APIError(503, f"the model is not ready ({detail})", code="model_not_ready",
                           headers={"Retry-After": str(NOT_READY_RETRY_AFTER_S)})
        return self.service


def state_of(request: Request) -> ServerState:
    return request.app.state.slotserve


async def agent_for(request: Request, name: str) -> AgentSpec:
    """The agent, after authentication: missing key 401 (auth on), unknown 404, wrong key 403."""
    state = state_of(request)
    state.auth.require_key_if_enabled(request)
    agent = await state.registry.get(name)
    state.auth.require_agent(request, agent)
    return agent


async def agent_named_by_model(request: Request, model: str | None) -> AgentSpec:
    """On the shared /v1 routes the request's `model` field names the agent."""
    if not model:
        raise APIError(400, "model is required: the name of an agent (see GET /v1/models)", param="model",
                       code="missing_required_parameter")
    return await agent_for(request, model)
