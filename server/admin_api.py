"""The admin API: ``/admin/agents`` (POST, GET) and ``/admin/agents/{name}`` (GET, PUT, PATCH, DELETE). An agent
whose spec names a LoRA adapter is stored only once the adapter loads from an adapter directory
(`agents.adapters`)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Body, Request

from agents.spec import AgentSpec
from server.errors import APIError
from server.state import ServerState, state_of

router = APIRouter()


@router.post("/admin/agents", status_code=201, tags=["admin"])
async def create_agent(request: Request, spec: AgentSpec) -> dict[str, Any]:
    state = state_of(request)
    state.auth.require_admin(request)
    await check_adapter(state, spec)
    return _admin_view(state, await state.registry.create(spec))

@router.get("/admin/agents", tags=["admin"])
async def admin_list(request: Request) -> dict[str, Any]:
    state = state_of(request)
    state.auth.require_admin(request)
    return {"object": "list", "data": [_admin_view(state, a) for a in await state.registry.list()]}

@router.get("/admin/agents/{name}", tags=["admin"])
async def admin_get(request: Request, name: str) -> dict[str, Any]:
    state = state_of(request)
    state.auth.require_admin(request)
    return _admin_view(state, await state.registry.get(name))

@router.put("/admin/agents/{name}", tags=["admin"])
async def admin_put(request: Request, name: str, spec: AgentSpec) -> dict[str, Any]:
    state = state_of(request)
    state.auth.require_admin(request)
    if spec.name != name:
        raise APIError(400, f"the body's name {spec.name!r} differs from the URL's {name!r}", param="name",
                       code="invalid_value")
    await check_adapter(state, spec)
    return _admin_view(state, await state.registry.update(spec))

@router.patch("/admin/agents/{name}", tags=["admin"])
async def admin_patch(request: Request, name: str, changes: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
    state = state_of(request)
    state.auth.require_admin(request)
    if state.registry.is_file_agent(name):
        return _admin_view(state, await state.registry.patch(name, changes))  # refused: read-only
    spec = (await state.registry.get(name)).patched(changes)
    await check_adapter(state, spec)
    return _admin_view(state, await state.registry.update(spec))

@router.delete("/admin/agents/{name}", tags=["admin"])
async def admin_delete(request: Request, name: str) -> dict[str, Any]:
    state = state_of(request)
    state.auth.require_admin(request)
    await delete_agent(state, name)
    return {"id": name, "object": "agent.deleted", "deleted": True}


async def check_adapter(state: ServerState, spec: AgentSpec) -> None:
    """Refuse (400) a spec from HTTP whose adapter is not inside an adapter directory or does not load."""
    if spec.adapter is None:
        return
    if state.service is None:
        raise APIError(503, "the model is still loading: an adapter is checked against it; retry when ready",
                       code="not_ready")
    await asyncio.to_thread(state.service.adapters.load, spec.adapter, False)


async def delete_agent(state: ServerState, name: str) -> None:
    """Delete a store agent, and forget the adapter it read."""
    spec = await state.registry.get(name) if not state.registry.is_file_agent(name) else None
    await state.registry.delete(name)
    if spec is not None and spec.adapter is not None and state.service is not None:
        state.service.adapters.forget(spec.adapter)


def _admin_view(state: ServerState, agent: AgentSpec) -> dict[str, Any]:
    view = agent.public_dict()
    view["source"] = "file" if state.registry.is_file_agent(agent.name) else "store"
    return view
