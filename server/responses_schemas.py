"""OpenAI Responses API request bodies as pydantic models (``POST /v1/responses``).

Unknown fields are refused with a 400 naming them, as on Chat Completions. Fields that frameworks send
and that change nothing here (``reasoning``, ``service_tier``, ``prompt_cache_key``, ...) are accepted
and documented as no-ops; fields that would change the output and are not implemented (``background``,
``conversation``, ``prompt``, hosted tools, image and file inputs) are refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from agents.spec import RepetitionControls
from agents.store import SESSION_ID_PATTERN

_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- input items ---------------------------------------------------------------------------------


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = Field(None, max_length=0)
    logprobs: list[Any] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=_NAME)
    arguments: str
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[InputText]
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(BaseModel):
    """Another model's reasoning, sent back by a client that replays its history: dropped (nothing here
    reasons before answering)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]


def _item_kind(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


# ---- tools and formats ---------------------------------------------------------------------------


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=_NAME)


class AllowedTools(_Strict):
    """The model may call only these tools (and must call one of them with mode "required")."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[NamedFunction] = Field(min_length=1, max_length=128)


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJSONObject(_Strict):
    type: Literal["json_object"]


class TextFormatJSONSchema(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    name: str = Field(pattern=_NAME)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")]


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="no-op")


class Reasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = Field(None, description="no-op: no obfuscation padding is sent")


# Include values that ask for what this server never produces (reasoning, hosted tool results): no-ops.
NO_OP_INCLUDES = ("reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                  "web_search_call.action.sources", "code_interpreter_call.outputs",
                  "computer_call_output.output.image_url", "message.input_image.image_url")


class ResponsesRequest(_Strict, RepetitionControls):
    model: str | None = Field(None, max_length=256, examples=["assistant"],
                              description="an agent name (optional on /agents/{agent}/v1/responses)")
    input: str | list[InputItem] = Field(examples=["Hello"])
    instructions: str | None = Field(None, description="a system message for this response only (not carried "
                                                       "to responses chained from it)")
    previous_response_id: str | None = Field(None, max_length=256)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | AllowedTools | None = None
    parallel_tool_calls: bool | None = Field(None, description="true: up to 4 calls in one turn; otherwise "
                                                                "(the default here) one")
    max_tool_calls: int | None = Field(None, ge=1, description="1 makes at most one call; more: up to 4 per turn")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    store: bool | None = Field(None, description="default true: the response is kept and can be chained")
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Literal[NO_OP_INCLUDES]] | None = Field(None, description="accepted: nothing to include")  # type: ignore[valid-type]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256, description="logged as the request's user")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(None, description="no-op")
    reasoning: Reasoning | None = Field(None, description="no-op: the served models do not reason")
    prompt_cache_key: str | None = Field(None, max_length=256, description="no-op: every shared prefix is cached")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(None, description="no-op")
    top_logprobs: Literal[0] | None = Field(None, description="only 0: per-token logprobs are not returned here")
    background: Literal[False] | None = Field(None, description="only false: responses run in the foreground")
    # extensions, as on Chat Completions
    top_k: int | None = Field(None, ge=0, description="extension")
    close_within_budget: bool | None = Field(
        None, description="extension: false lets a constrained output near max_tokens be cut rather than closed")
    cache_salt: str | None = Field(None, min_length=1, max_length=256, description="extension (as vLLM's)")
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN,
                                   description="extension: continue this server-side session (or X-Session-Id)")
