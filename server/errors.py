"""Errors in the API's own shape: OpenAI's ``{"error": {"message", "type", "param", "code"}}``, and on the
Anthropic Messages routes Anthropic's ``{"type": "error", "error": {"type", "message"}}``.

Bad input is never a 500: validation errors, unsupported parameters and schema features, unknown
agents, full queues and oversize prompts all map to 4xx here.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from agents.chat_template import PromptTooLongError
from agents.errors import HistoryConflictError, InvalidRequestError, SessionBusyError, SessionNotFoundError
from agents.messages import MessageError, TemplateError
from agents.registry import AgentConflictError, ReadOnlyAgentError, UnknownAgentError
from agents.store import AgentGoneError, InvalidSessionIdError, SessionLimitError, StoreError, StoreUnavailableError
from scheduler.grammar_spec import GrammarBusyError, UnsupportedConstraintError
from scheduler.request import ContextLengthError, EngineFailedError, QueueFullError

log = logging.getLogger("slotserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:  # noqa: A002
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "invalid_request_error"),
                                           "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error as ``path``'s API writes errors."""
        body = self.anthropic_body() if is_anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# Anthropic's error types (its 529 "overloaded" is our 503).
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path.endswith("/v1/messages") or path.endswith("/v1/messages/count_tokens")


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:  # noqa: A002
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Location parts pydantic adds for the branch of a union it tried ("str", "list[tagged-union[...]]", a model's
# class name): not fields, whose names are all lower case.
_BRANCH_LABELS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_branch_label(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or part in _BRANCH_LABELS or part[:1].isupper())


def _loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header") and not _is_branch_label(p)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def _most_specific(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Of the errors about the first field named, the deepest: with a union, the branch that got furthest."""
    head = tuple(errors[0].get("loc", ()))[:2]
    same = [e for e in errors if tuple(e.get("loc", ()))[:2] == head]
    return max(same, key=lambda e: len(e.get("loc", ())))


def validation_error(errors: list[dict[str, Any]], status: int = 400) -> APIError:
    """The first problem of a pydantic error list, named (unknown fields: unsupported_parameter)."""
    extra = [e for e in errors if e.get("type") == "extra_forbidden"]
    if extra:
        names = sorted({_loc(tuple(e["loc"])) for e in extra})
        return APIError(status, f"Unsupported parameter(s): {', '.join(names)}. slotserve does not implement "
                                f"{'it' if len(names) == 1 else 'them'}; remove {'it' if len(names) == 1 else 'them'}.",
                        param=names[0], code="unsupported_parameter")
    if not errors:
        return APIError(status, "invalid request")
    first = _most_specific(errors)
    param = _loc(tuple(first.get("loc", ()))) or None
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        return APIError(status, f"the body is not valid JSON: {first.get('ctx', {}).get('error', msg)}",
                        code="invalid_json")
    if first.get("type") == "missing":
        return APIError(status, f"missing required parameter: {param}", param=param, code="missing_required_parameter")
    return APIError(status, f"invalid value for {param}: {msg}" if param else msg, param=param, code="invalid_value")


RETRY_AFTER_S = 2  # what a 429 tells the client to wait before retrying
NOT_READY_RETRY_AFTER_S = 5  # a server still loading (or its store down) is polled less often


def install_error_handlers(app: FastAPI) -> None:
    def handler(status: int, code: str | None = None, param_of=None):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None

        async def handle(request: Request, exc: Exception) -> JSONResponse:
            param = param_of(exc) if param_of else None
            return APIError(status, str(exc), code=code, param=param, headers=headers).response(request.url.path)

        return handle

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        status = 422 if request.url.path.startswith("/admin") else 400
        return validation_error(list(exc.errors()), status).response(request.url.path)

    @app.exception_handler(ValidationError)
    async def _pydantic(request: Request, exc: ValidationError) -> JSONResponse:
        status = 422 if request.url.path.startswith("/admin") else 400
        return validation_error(list(exc.errors()), status).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response(request.url.path)

    @app.exception_handler(UnsupportedConstraintError)
    async def _constraint(request: Request, exc: UnsupportedConstraintError) -> JSONResponse:
        return APIError(400, str(exc), param=exc.feature, code="unsupported_schema_feature").response(request.url.path)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return APIError(400, str(exc), param=exc.param, code=exc.code).response(request.url.path)

    app.add_exception_handler(UnknownAgentError, handler(404, "model_not_found"))
    app.add_exception_handler(AgentConflictError, handler(409, "agent_exists"))
    app.add_exception_handler(SessionBusyError, handler(409, "session_busy"))
    app.add_exception_handler(SessionNotFoundError, handler(404, "session_not_found"))
    app.add_exception_handler(AgentGoneError, handler(404, "agent_deleted"))
    app.add_exception_handler(HistoryConflictError, handler(409, "session_conflict", lambda e: f"messages[{e.index}]"))
    app.add_exception_handler(ReadOnlyAgentError, handler(403, "agent_read_only"))
    app.add_exception_handler(QueueFullError, handler(429, "queue_full"))
    app.add_exception_handler(EngineFailedError, handler(503, "engine_failed"))
    app.add_exception_handler(SessionLimitError, handler(429, "session_limit"))
    app.add_exception_handler(GrammarBusyError, handler(429, "grammar_busy"))
    app.add_exception_handler(ContextLengthError, handler(400, "context_length_exceeded"))
    app.add_exception_handler(PromptTooLongError, handler(400, "context_length_exceeded"))
    app.add_exception_handler(InvalidSessionIdError, handler(400, "invalid_session_id"))
    app.add_exception_handler(MessageError, handler(400, "invalid_message", lambda e: "messages"))
    app.add_exception_handler(TemplateError, handler(400, "invalid_message", lambda e: "messages"))
    app.add_exception_handler(StoreUnavailableError, handler(503, "store_unavailable"))
    app.add_exception_handler(StoreError, handler(500, "store_error"))

    @app.exception_handler(ValueError)
    async def _value(request: Request, exc: ValueError) -> JSONResponse:
        # Validation raised deep inside (sampling parameters, request shapes): the client's input.
        return APIError(400, str(exc), code="invalid_value").response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", code="internal_error").response(request.url.path)
