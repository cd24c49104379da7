"""Anthropic Messages API request bodies as pydantic models.

As for the OpenAI bodies, unknown fields are refused with a 400 naming them. ``cache_control`` is accepted
on every block and tool as a no-op: prefix caching here needs no markers (any shared prefix is reused).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agents.spec import RepetitionControls
from server.schemas import MAX_STOP, MAX_STOP_CHARS

_TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = Field(None, max_length=0)


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=_TOOL_NAME)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content)


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Strict):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, pattern=_TOOL_NAME)
    disable_parallel_tool_use: bool | None = Field(None, description="false: up to 4 calls; otherwise one")


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=256)


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


class JSONOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class OutputConfig(_Strict):
    format: JSONOutputFormat | None = Field(None, description="structured output: the answer is a document of "
                                                              "this schema (with tools: a call or such a document)")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(None, description="no-op")


class _Prompt(_Strict):
    model: str | None = Field(None, max_length=256, examples=["assistant"],
                              description="an agent name (optional on /agents/{agent}/v1/messages)")
    messages: list[Message] = Field(min_length=1, examples=[[{"role": "user", "content": "Hello"}]])
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingDisabled | None = Field(None, description="only disabled: the served models do not think")
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = Field(None, description="no-op: every shared prefix is cached")

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "".join(block.text for block in self.system)


class MessagesRequest(_Prompt, RepetitionControls):
    max_tokens: int = Field(ge=1, examples=[16])
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP)
    stream: bool | None = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="no-op: one tier")
    speed: Literal["standard", "fast"] | None = Field(None, description="no-op: one speed")
    inference_geo: str | None = Field(None, max_length=64, description="no-op: served here")
    workspace_id: str | None = Field(None, max_length=256, description="no-op")
    user_profile_id: str | None = Field(None, max_length=256, description="logged as the request's user")
    # Sampling parameters of earlier API versions, still sent by older clients.
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    close_within_budget: bool | None = Field(
        None, description="extension: false lets a constrained output near max_tokens be cut rather than closed")

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, value: list[str] | None) -> list[str] | None:
        if value and any(not s or len(s) > MAX_STOP_CHARS for s in value):
            raise ValueError(f"stop sequences must be 1 to {MAX_STOP_CHARS} characters")
        return value


class CountTokensRequest(_Prompt):
    """``POST /v1/messages/count_tokens``: the prompt part of a messages request."""
