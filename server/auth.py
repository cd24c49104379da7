"""API keys: an admin key for /admin (it may also call every agent), per-agent keys for agent endpoints.

Keys come as ``Authorization: Bearer <key>`` (what the OpenAI clients send) or ``X-Api-Key``. With auth
off (the default) everything is open except agents that declare their own ``api_keys``, which always
require one of them, and /admin once any admin key is configured. Missing key: 401; a key that is not
valid for what it asks: 403.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from agents.chat_params import SessionCaller
from agents.registry import authorize
from agents.spec import AgentSpec
from server.errors import APIError

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def request_key(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return request.headers.get("x-api-key") or None


class Auth:
    def __init__(self, enabled: bool, admin_keys: list[str]) -> None:
        self.enabled = enabled
        self._admin = [k.encode() for k in admin_keys]

    def is_admin(self, key: str | None) -> bool:
        if not key:
            return False
        given = key.encode()
        matched = False
        for candidate in self._admin:  # every key compared, in constant time
            matched |= hmac.compare_digest(given, candidate)
        return matched

    def require_admin(self, request: Request) -> None:
        if not self.enabled and not self._admin:  # a configured admin key protects /admin, auth on or off
            return
        key = request_key(request)
        if key is None:
            raise APIError(401, "an admin API key is required (Authorization: Bearer <key>)",
                           code="missing_api_key", headers=_CHALLENGE)
        if not self.is_admin(key):
            raise APIError(403, "this key is not an admin key", code="forbidden")

    def require_key_if_enabled(self, request: Request) -> None:
        """With auth on, refuse a request without any key before revealing whether an agent exists."""
        if self.enabled and request_key(request) is None:
            raise APIError(401, "an API key is required (Authorization: Bearer <key>)", code="missing_api_key",
                           headers=_CHALLENGE)

    def may_use(self, request: Request, agent: AgentSpec) -> bool:
        key = request_key(request)
        return self.is_admin(key) or authorize(agent, key, self.enabled)

    def session_caller(self, request: Request) -> SessionCaller | None:
        """With auth on, a session belongs to the key that created it (stored as a fingerprint, never the key)
        and only an admin key sees every session; with auth off, sessions are shared (None)."""
        if not self.enabled:
            return None
        key = request_key(request)
        owner = hashlib.sha256(b"slotserve session owner\0" + key.encode()).hexdigest()[:32] if key else None
        return SessionCaller(owner=owner, admin=self.is_admin(key))

    def require_agent(self, request: Request, agent: AgentSpec) -> None:
        if self.may_use(request, agent):
            return
        if request_key(request) is None:
            raise APIError(401, f"agent {agent.name!r} requires an API key (Authorization: Bearer <key>)",
                           code="missing_api_key", headers=_CHALLENGE)
        raise APIError(403, f"this key may not use agent {agent.name!r}", code="forbidden")
