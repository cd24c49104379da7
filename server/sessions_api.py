"""Server-side sessions: ``GET /agents/{agent}/v1/sessions``, ``GET|DELETE /agents/{agent}/v1/sessions/{id}``.
A session is visible to the key that created it and to admin keys (with auth on), to everyone without."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from agents.errors import SessionNotFoundError
from agents.spec import AgentSpec
from server.state import AgentName, SessionId, agent_for, state_of

router = APIRouter()


@router.get("/agents/{agent}/v1/sessions", tags=["sessions"])
async def list_sessions(request: Request, agent: AgentName) -> dict[str, Any]:
    spec = await agent_for(request, agent)
    caller = state_of(request).auth.session_caller(request)
    infos = await state_of(request).store.list_sessions(spec.name)
    return {"object": "list", "data": [
        {"id": i.id, "object": "session", "agent": i.agent, "created": i.created, "updated": i.updated,
         "expires_at": i.expires_at, "message_count": i.message_count}
        for i in infos if caller is None or caller.may_see(i)]}

@router.get("/agents/{agent}/v1/sessions/{session_id}", tags=["sessions"])
async def get_session(request: Request, agent: AgentName, session_id: SessionId) -> dict[str, Any]:
    spec = await agent_for(request, agent)
    session = await _visible_session(request, spec, session_id)
    return {"id": session.id, "object": "session", "agent": session.agent, "created": session.created,
            "updated": session.updated, "expires_at": session.expires_at, "messages": session.messages}

@router.delete("/agents/{agent}/v1/sessions/{session_id}", tags=["sessions"])
async def delete_session(request: Request, agent: AgentName, session_id: SessionId) -> dict[str, Any]:
    spec = await agent_for(request, agent)
    await _visible_session(request, spec, session_id)
    if not await state_of(request).store.delete_session(spec.name, session_id):
        raise SessionNotFoundError(spec.name, session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


async def _visible_session(request: Request, spec: AgentSpec, session_id: str) -> Any:
    """The session if it exists and the caller may see it (its creator's key, or an admin key), else 404."""
    session = await state_of(request).store.get_session(spec.name, session_id)
    caller = state_of(request).auth.session_caller(request)
    if session is None or (caller is not None and not caller.may_see(session)):
        raise SessionNotFoundError(spec.name, session_id)
    return session
