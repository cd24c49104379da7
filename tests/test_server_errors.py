"""Refusals for overload carry Retry-After: a full queue, the session limit, busy grammar workers (HTTP 429)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from agents.store import SessionLimitError
from scheduler.grammar_spec import GrammarBusyError
from scheduler.request import QueueFullError
from server.errors import RETRY_AFTER_S, install_error_handlers


@pytest.mark.parametrize(("error", "code"), [
    (QueueFullError("256 requests are already waiting"), "queue_full"),
    (SessionLimitError("assistant", 10), "session_limit"),
    (GrammarBusyError("8 schemas are compiling"), "grammar_busy"),
])
def test_overload_is_429_with_retry_after(error, code):
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/fail")
    async def fail():
        raise error

    r = TestClient(app).get("/fail")
    assert r.status_code == 429 and r.headers["retry-after"] == str(RETRY_AFTER_S)
    assert r.json()["error"]["code"] == code and r.json()["error"]["type"] == "rate_limit_error"
