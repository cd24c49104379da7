"""vLLM's runtime LoRA routes, so vLLM users' scripts work: ``POST /v1/load_lora_adapter`` creates an agent named
``lora_name`` with the base agent's settings (`adapters.base_agent`) and the adapter at ``lora_path``, and
``POST /v1/unload_lora_adapter`` deletes it; ``GET /v1/models`` then lists it like any agent. Loading follows
the admin API's rules: an admin key when auth is on, the path inside an adapter directory (docs/lora.md)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from agents.registry import UnknownAgentError
from agents.spec import AGENT_NAME_PATTERN, AgentSpec
from server.admin_api import check_adapter, delete_agent
from server.errors import APIError
from server.state import ServerState, state_of

router = APIRouter()


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's other fields (lora_int_id, base_model_name) mean nothing here

    lora_name: str = Field(pattern=AGENT_NAME_PATTERN, description="the new agent's name (a model id)")
    lora_path: str = Field(min_length=1, max_length=4096, description="a PEFT adapter directory")
    load_inplace: bool = Field(False, description="replace the adapter of an agent of this name")


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(max_length=256)


@router.post("/v1/load_lora_adapter", tags=["vllm"], response_class=PlainTextResponse)
async def load_lora_adapter(request: Request, body: LoadLoraAdapter) -> PlainTextResponse:
    state = state_of(request)
    state.auth.require_admin(request)
    base = await state.registry.get(state.config.adapters.base_agent)
    spec = AgentSpec.model_validate({**base.model_dump(), "name": body.lora_name, "adapter": body.lora_path,
                                     "description": f"{base.name} with the LoRA adapter {body.lora_name}"})
    await check_adapter(state, spec)
    if body.load_inplace and not state.registry.is_file_agent(spec.name) and await _exists(state, spec.name):
        await state.registry.update(spec)
    else:
        await state.registry.create(spec)
    return PlainTextResponse(f"Success: LoRA adapter '{spec.name}' added successfully.")


@router.post("/v1/unload_lora_adapter", tags=["vllm"], response_class=PlainTextResponse)
async def unload_lora_adapter(request: Request, body: UnloadLoraAdapter) -> PlainTextResponse:
    state = state_of(request)
    state.auth.require_admin(request)
    agent = await state.registry.get(body.lora_name)
    if agent.adapter is None:
        raise APIError(400, f"agent {agent.name!r} has no LoRA adapter to unload", param="lora_name",
                       code="invalid_value")
    await delete_agent(state, agent.name)
    return PlainTextResponse(f"Success: LoRA adapter '{agent.name}' removed successfully.")


async def _exists(state: ServerState, name: str) -> bool:
    try:
        await state.registry.get(name)
    except UnknownAgentError:
        return False
    return True
