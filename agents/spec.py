"""`AgentSpec`: one agent's definition (prompt, sampling defaults, output constraints, access keys).

Specs come from YAML files (`configs/agents/*.yaml`) or from the admin API; both are validated here, so
a bad field fails with a pydantic ``ValidationError`` naming it (the server answers 400/422 with it).
Tool and response-format shapes are checked by the scheduler's own `ConstraintSpec`, so an agent that
validates here is one the scheduler can constrain.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator, model_validator

from agents.messages import invalid_text_path
from core import dry
from scheduler.grammar_spec import ConstraintSpec

__all__ = ["AGENT_NAME_PATTERN", "AgentSpec", "RepetitionControls", "SamplingDefaults"]

AGENT_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
_AGENT_NAME = re.compile(AGENT_NAME_PATTERN)
_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")

ApiKey = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^\S+$")]


class RepetitionControls(BaseModel):
    """Extensions on every API: vLLM's repetition penalty and llama.cpp's DRY sampler, same names and meanings
    (docs/structured-output.md). Not given: the agent's default, else off."""

    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description="extension (vLLM's)")
    dry_multiplier: float | None = Field(None, ge=0.0, le=1000.0, description="extension (llama.cpp's): 0 = off")
    dry_base: float | None = Field(None, ge=1.0, le=1000.0, description="extension (llama.cpp's)")
    dry_allowed_length: int | None = Field(None, ge=0, le=65536, description="extension (llama.cpp's)")
    dry_penalty_last_n: int | None = Field(None, ge=-1, lt=2**31,
                                           description="extension (llama.cpp's): -1 = the whole context, 0 = off")
    dry_sequence_breakers: list[Annotated[str, StringConstraints(min_length=1, max_length=dry.MAX_BREAKER_CHARS)]] \
        | None = Field(None, min_length=1, max_length=dry.MAX_BREAKERS, description="extension (llama.cpp's)")

    def repetition_values(self) -> dict[str, Any]:
        """The fields given, as agents.chat_params.ChatParams takes them."""
        out: dict[str, Any] = {name: getattr(self, name) for name in RepetitionControls.model_fields}
        if self.dry_sequence_breakers is not None:
            out["dry_sequence_breakers"] = tuple(self.dry_sequence_breakers)
        return out


class SamplingDefaults(RepetitionControls):
    """Per-agent sampling defaults; a request's own value wins, None means the server's default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="0 disables top-k")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: list[str] | None = Field(None, max_length=16)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        # OpenAI accepts a single string or a list; normalise so consumers see one shape.
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value


class AgentSpec(BaseModel):
    """An agent: its own OpenAI-compatible endpoint with a fixed system prompt and defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=AGENT_NAME_PATTERN, description="slug: lowercase letters, digits, '_' and '-'")
    description: str = Field("", max_length=2000)
    system_prompt: str = Field("", max_length=100_000)
    defaults: SamplingDefaults = Field(default_factory=SamplingDefaults)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    context_limit: int | None = Field(None, ge=1, description="max prompt tokens for this agent")
    truncation: Literal["auto", "disabled"] = Field(
        "disabled", description="a conversation over the context: drop its oldest turns (auto) or refuse it (400)")
    priority: int = Field(1, ge=1)
    api_keys: list[ApiKey] = Field(default_factory=list)
    # A PEFT LoRA adapter directory the agent's requests run under (agents.adapters: from a config file any
    # path, relative to the file; over HTTP only inside the server's adapter directories). None: the base model.
    adapter: str | None = Field(None, min_length=1, max_length=4096)

    @model_validator(mode="after")
    def _check_text(self) -> AgentSpec:
        where = invalid_text_path(self.model_dump(exclude={"api_keys"}))
        if where is not None:
            raise ValueError(f"{where} is not valid Unicode text (it holds a lone surrogate)")
        return self

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        kind = value.get("type")
        if kind not in _RESPONSE_FORMAT_TYPES:
            raise ValueError(f"response_format.type must be one of {', '.join(_RESPONSE_FORMAT_TYPES)}; got {kind!r}")
        if kind != "json_schema":
            if set(value) != {"type"}:
                raise ValueError(f"response_format of type {kind!r} takes no other fields")
            return value
        body = value.get("json_schema")
        if not isinstance(body, dict):
            raise ValueError("response_format.json_schema must be an object with 'name' and 'schema'")
        name = body.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ValueError("response_format.json_schema.name must match [A-Za-z0-9_-]{1,64}")
        strict = body.get("strict", False)
        if not isinstance(strict, bool):
            raise ValueError("response_format.json_schema.strict must be a boolean")
        if "schema" not in body:
            raise ValueError("response_format.json_schema.schema is required")
        ConstraintSpec.json_schema(body["schema"], strict=strict)  # shape and JSON-serialisability
        return value

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value is not None:
            if not value:
                raise ValueError("tools must be omitted or a non-empty list")
            for i, tool in enumerate(value):
                if not isinstance(tool, dict) or tool.get("type") != "function" or "function" not in tool:
                    raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
            ConstraintSpec.tools(value, "auto")  # names, duplicates, parameters
        return value

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, value: str | dict[str, Any], info: ValidationInfo) -> str | dict[str, Any]:
        # Runs after `tools` (declared first). "auto" without tools is simply unconstrained; anything
        # stronger needs a declared function.
        if "tools" not in info.data:  # tools itself failed validation and is reported on its own
            return value
        tools = info.data["tools"]
        if value != "none" and (tools or value != "auto"):
            ConstraintSpec.tools(tools, value)
        return value

    # ---- helpers --------------------------------------------------------------------------------

    @staticmethod
    def is_valid_name(name: str) -> bool:
        return isinstance(name, str) and _AGENT_NAME.fullmatch(name) is not None

    def to_json(self) -> str:
        """Canonical JSON (what the stores persist)."""
        return self.model_dump_json(exclude_defaults=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> AgentSpec:
        return cls.model_validate_json(text)

    def patched(self, changes: dict[str, Any]) -> AgentSpec:
        """A validated copy with ``changes`` applied (for partial updates); the name cannot change."""
        if "name" in changes and changes["name"] != self.name:
            raise ValueError("an agent's name cannot be changed")
        return AgentSpec.model_validate({**self.model_dump(), **changes})

    def public_dict(self) -> dict[str, Any]:
        """The spec as a dict for listing: api keys are never echoed, only whether any are set."""
        data = self.model_dump(exclude={"api_keys"})
        data["auth_required"] = bool(self.api_keys)
        return data
