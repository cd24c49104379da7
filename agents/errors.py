"""What the agents layer refuses, each mapped by the server to one HTTP status in the API's own error shape."""

from __future__ import annotations

__all__ = ["HistoryConflictError", "InvalidRequestError", "SessionBusyError", "SessionNotFoundError"]


class InvalidRequestError(ValueError):
    """A request the service refuses before generating (HTTP 400); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        self.param = param
        self.code = code
        super().__init__(message)


class SessionNotFoundError(LookupError):
    """No such session for this caller: absent, or owned by another key (HTTP 404 either way)."""

    def __init__(self, agent: str, sid: str) -> None:
        super().__init__(f"no session {sid!r} for agent {agent!r}")


class SessionBusyError(RuntimeError):
    """Another turn of this session is still running, here or on another server (HTTP 409)."""

    def __init__(self, agent: str, sid: str) -> None:
        super().__init__(f"session {sid!r} of agent {agent!r} has a turn running; send the next turn after it "
                         "finishes")


class HistoryConflictError(ValueError):
    """A resent history that contradicts the stored session (HTTP 409); ``index`` is the first differing
    message of the request."""

    def __init__(self, index: int, detail: str) -> None:
        self.index = index
        super().__init__(f"messages[{index}] {detail}; send only the new messages, the unchanged history, "
                         "or start a new session")
