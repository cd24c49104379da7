"""OpenAI request bodies as pydantic models.

Every model forbids unknown fields, so a parameter slotserve does not implement (``audio``,
``functions``, ``prediction``, a typo...) is answered with HTTP 400 naming it instead of
being silently ignored. Known parameters with values we cannot honour (``n`` > 1, ``modalities``
other than text) are refused by `unsupported_values`.

Extensions (not in OpenAI's API): ``top_k``, ``min_p``, ``ignore_eos``, ``close_within_budget``, ``session_id``,
``cache_salt`` (as vLLM's), and `RepetitionControls` (also on the Responses and Anthropic APIs).

A router in front of several replicas (vllm-router) re-serialises chat and completion bodies and adds
SGLang's fields at its defaults (``no_stop_trim: false``, ``skip_special_tokens: true``, ...): `ROUTER_FIELDS`
accepts each at the value that means what slotserve does anyway, and refuses any other value with a 400
naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agents.messages import invalid_text_path
from agents.spec import RepetitionControls
from agents.store import SESSION_ID_PATTERN

_FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
MAX_STOP = 16
MAX_STOP_CHARS = 512  # per stop sequence; matching is linear in it, and nothing longer is a sensible stop
MAX_LOGIT_BIAS = 300


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- messages -------------------------------------------------------------------------------------


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(min_length=1, max_length=64)
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Strict):
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, min_length=1, max_length=256)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)
    # Fields of a returned assistant message that clients send back unchanged; only empty values.
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list[Any] | None = Field(None, max_length=0)


# ---- output constraints ---------------------------------------------------------------------------


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJSONObject(_Strict):
    type: Literal["json_object"]


class JSONSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = False


class ResponseFormatJSONSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema, Field(discriminator="type")
]


class FunctionDefinition(_Strict):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(pattern=_FUNCTION_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(_Strict):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1, max_length=128)


class AllowedToolsChoice(_Strict):
    """The model may call only these tools (and must call one of them with mode "required")."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class StreamOptions(_Strict):
    include_usage: bool | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` extension: exactly one of a regex, a list of choices, a JSON schema."""

    regex: str | None = Field(None, max_length=16_000, description="the whole output matches this regex")
    choice: list[str] | None = Field(None, min_length=1, max_length=1024, description="the output is one of these")
    json_: dict[str, Any] | bool | None = Field(None, alias="json", description="a JSON schema")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# ---- requests -------------------------------------------------------------------------------------


class _Sampling(_Strict, RepetitionControls):
    model: str | None = Field(None, max_length=256, examples=["assistant"],
                              description="an agent name (optional on /agents/{agent}/v1)")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=128, description="only 1 is supported")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    seed: int | None = Field(None, ge=0, lt=2**63)
    user: str | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    # extensions
    top_k: int | None = Field(None, ge=0, description="extension: 0 disables top-k")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="extension")
    ignore_eos: bool | None = Field(None, description="extension: keep generating past end-of-sequence tokens")
    close_within_budget: bool | None = Field(
        None, description="extension: false lets a constrained output near max_tokens be cut rather than closed")
    cache_salt: str | None = Field(None, min_length=1, max_length=256,
                                   description="extension (as vLLM's): requests share cached prompt KV only with "
                                               "requests of the same agent that carry the same salt")
    structured_outputs: StructuredOutputs | None = Field(None, description="extension (as vLLM's)")
    guided_regex: str | None = Field(None, max_length=16_000, description="extension (vLLM's older spelling)")
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=1024,
                                            description="extension (vLLM's older spelling)")
    guided_json: dict[str, Any] | bool | None = Field(None, description="extension (vLLM's older spelling)")
    # Added by a router (vllm-router, SGLang's fields): accepted only at these values (see ROUTER_FIELDS).
    no_stop_trim: bool | None = Field(None, description="router field: only false (stop strings are trimmed)")
    skip_special_tokens: bool | None = Field(None, description="router field: only true (no special tokens in text)")
    return_hidden_states: bool | None = Field(None, description="router field: only false")

    def output_format(self) -> dict[str, Any] | None:
        """The requested output constraint as a response_format-shaped dict (regex and choice are internal
        types); None when none is asked for. Two ways of asking at once are refused by `request_problem`."""
        so = self.structured_outputs
        regex = so.regex if so else self.guided_regex
        choice = so.choice if so else self.guided_choice
        schema = so.json_ if so else self.guided_json
        if regex is not None:
            return {"type": "regex", "regex": regex}
        if choice is not None:
            return {"type": "choice", "choice": choice}
        if schema is not None:
            return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        rf = getattr(self, "response_format", None)
        return rf.model_dump(by_alias=True, exclude_none=True) if rf is not None else None

    def constraint_count(self) -> int:
        so = self.structured_outputs
        given = [so.regex, so.choice, so.json_] if so else []
        given += [self.guided_regex, self.guided_choice, self.guided_json, getattr(self, "response_format", None)]
        return sum(g is not None for g in given)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for token, bias in value.items():
            if not token.isdigit() or len(token) > 9:
                raise ValueError(f"keys must be token ids, got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias for token {token} must be in [-100, 100]")
        return value

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def bias(self) -> dict[int, float] | None:
        return {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, examples=[[{"role": "user", "content": "Hello"}]])
    max_completion_tokens: int | None = Field(None, ge=1, examples=[4])
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="true: up to 4 calls in one turn; otherwise "
                                                                "(the default here) one")
    modalities: list[Literal["text"]] | None = None
    # Sent by frameworks and proxies; none changes what is generated here, so each is accepted as a no-op.
    store: bool | None = Field(None, description="no-op: chat completions are not stored (sessions are: "
                                                 "X-Session-Id)")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="no-op: accepted, not stored")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="no-op: one tier")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="no-op: the served models do not reason before answering")
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN, examples=["session-1"],
                                   description="extension (or X-Session-Id)")
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="extension (as the Responses API's): over the context, drop the oldest turns (auto) or "
                          "refuse with 400 (disabled); default: the agent's")
    # Added by a router (vllm-router, SGLang's fields): accepted only at these values (see ROUTER_FIELDS).
    continue_final_message: bool | None = Field(None, description="router field: only false")
    separate_reasoning: bool | None = Field(None, description="router field: only true (nothing reasons here)")
    stream_reasoning: bool | None = Field(None, description="router field: only true (nothing reasons here)")
    include_reasoning: bool | None = Field(None, description="router field: only true (nothing reasons here)")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] = Field(description="text, a list of one text, or token ids")
    logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = Field(None, description="extension: constrain the completion")
    echo: bool | None = Field(None, description="only false: the prompt is not echoed")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str] | list[int]) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("only one prompt per request is supported")
            return value[0]
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        return value


# Fields a router adds to every body it forwards (vllm-router fills in SGLang's defaults), with the one value
# that means what slotserve does: any other value asks for a behaviour slotserve does not have.
ROUTER_FIELDS: dict[str, tuple[bool, str]] = {
    "no_stop_trim": (False, "a matched stop string is always trimmed from the output"),
    "skip_special_tokens": (True, "special tokens are never part of the output text"),
    "return_hidden_states": (False, "hidden states are not returned"),
    "continue_final_message": (False, "a final assistant message is never continued: the answer is a new turn"),
    "separate_reasoning": (True, "the served models do not reason before answering"),
    "stream_reasoning": (True, "the served models do not reason before answering"),
    "include_reasoning": (True, "the served models do not reason before answering"),
    "echo": (False, "the prompt is not echoed"),
}


def router_field_problem(body: _Sampling) -> tuple[str, str, str] | None:
    for name, (accepted, meaning) in ROUTER_FIELDS.items():
        value = getattr(body, name, None)
        if value is not None and value != accepted:
            return (name, f"{name}: {str(value).lower()} is not supported; only {str(accepted).lower()} is "
                    f"accepted ({meaning})", "unsupported_parameter")
    return None


def request_problem(body: _Sampling) -> tuple[str, str, str] | None:
    """(param, message, code) for a request that passed the schema but cannot be served as asked."""
    if (problem := router_field_problem(body)) is not None:
        return problem
    if body.n is not None and body.n != 1:
        return "n", "n > 1 is not supported: one choice per request", "unsupported_parameter"
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
        return "top_logprobs", "top_logprobs requires logprobs: true", "unsupported_parameter"
    if body.constraint_count() > 1:
        return ("structured_outputs", "ask for one output constraint: response_format, structured_outputs or one "
                "guided_* field", "invalid_value")
    rf = body.response_format
    if isinstance(rf, ResponseFormatJSONSchema) and rf.json_schema.schema_ is None:
        return ("response_format.json_schema.schema", "response_format json_schema needs a schema (use type "
                "json_object for any JSON object)", "invalid_value")
    where = invalid_text_path(body.model_dump(by_alias=True, exclude_none=True))
    if where is not None:
        return where, f"{where} is not valid Unicode text (it holds a lone surrogate)", "invalid_value"
    return None
