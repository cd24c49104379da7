"""The serving runtime and the chat service between the HTTP server and the scheduler.

* `build_runtime(options)` loads a model, compiles the engine's steps, warms the grammar compiler and
  builds the `Scheduler`: everything that touches JAX is created here (the server never imports it).
  `assemble_runtime` does the same from an engine and tokenizer you built yourself (tests, embedding).
* `ChatService` turns an agent plus an OpenAI-style request (`ChatParams`) into a `GenerationRequest`:
  session history, the prompt (agent system prompt, tools), sampling parameters (agent defaults
  overridden by the request), the output constraint (response_format / tools); it submits it, and
  after generation parses tool calls and commits the session turn.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agents.chat_template import DEFAULT_BUILTIN, ChatTemplate, PromptTooLongError, RenderedPrompt
from agents.messages import normalize_messages
from agents.prompt_text import leading_system_count
from agents.spec import AgentSpec
from agents.store import Session, SessionInfo, SessionLimitError, Store, StoreError
from agents.tool_calls import ToolCallStream, begins_call, parse_partial_calls, parse_tool_calls, split_answer
from core import dry
from core.engine import ROWS_VERIFY_WIDTH, EngineConfig
from core.sampling import SamplingParams
from scheduler.grammar import COMPILE_TIMEOUT_S, DEFAULT_BACKEND, MAX_SCHEMA_BYTES, GrammarCompiler
from scheduler.grammar_spec import ConstraintSpec
from scheduler.request import (
    DEFAULT_MAX_TOKENS,
    FinishReason,
    GenerationRequest,
    RequestHandle,
    generation_room,
)
from scheduler.scheduler import SchedulerConfig

log = logging.getLogger(__name__)

__all__ = [
    "ChatParams",
    "ChatService",
    "Generation",
    "Runtime",
    "RuntimeOptions",
    "assemble_runtime",
    "build_runtime",
]

# Start-up progress: progress(stage, done, total, detail); a stage lasts until the next one is named.
Progress = Callable[..., None]


# --------------------------------------------------------------------------------------------------
# runtime
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeOptions:
    """What `build_runtime` needs (the server's YAML config maps onto this)."""

    model: str = "default"
    dtype: str | None = None  # None: chosen per device
    kv_dtype: str | None = None  # "int8", a float dtype or "compute"; None: chosen (core.device.choose_kv_dtype)
    precision: str | None = None  # "float" | "w8a8"; None: chosen per device (core.device.choose_precision)
    # The built-in chat template for a checkpoint without its own (agents.chat_template.BUILTIN_TEMPLATES).
    chat_template: str = DEFAULT_BUILTIN
    # Each default below is the one its owner states (the engine's, the scheduler's, the grammar compiler's);
    # the server's config and the CLI take theirs from here.
    num_slots: int = EngineConfig.num_slots
    max_len: int = EngineConfig.max_len
    chunk_sizes: tuple[int, ...] = EngineConfig.chunk_sizes
    compile_cache: str | None = None  # directory; None: the default cache dir; "off": disabled
    # Ready once what a short first request runs is compiled; the rest compile on a thread
    # (core.engine.Engine.warmup).
    background_compile: bool = True
    prefill_budget: int | None = SchedulerConfig.prefill_budget
    max_waiting: int = SchedulerConfig.max_waiting
    prefix_caching: bool = SchedulerConfig.prefix_caching
    speculative: bool = SchedulerConfig.speculative
    # Several greedy streams verify their drafts in one batched pass (EngineConfig.rows_verify_width): off
    # unless asked for, since its exactness depends on the CPU (docs/design-notes.md).
    batched_speculation: bool = False
    host_tier_bytes: int = SchedulerConfig.host_tier_bytes
    grammar_backend: str = DEFAULT_BACKEND
    grammar_compile_timeout_s: float = COMPILE_TIMEOUT_S
    max_schema_bytes: int = MAX_SCHEMA_BYTES


@dataclass
class Runtime:
    """One resident model and everything that serves it."""

    engine: Any  # core.engine.Engine
    scheduler: Any  # scheduler.scheduler.Scheduler
    tokenizer: Any  # core.tokenizer.Tokenizer
    compiler: GrammarCompiler
    template: ChatTemplate
    model_name: str
    dtype: str
    dtype_reason: str = ""
    precision: str = "float"
    precision_reason: str = ""
    kv_dtype_reason: str = ""
    load_seconds: float = 0.0
    weights_from_cache: bool = False  # the prepared weights were read back from the weights cache
    compile_seconds: float = 0.0
    _started: bool = field(default=False, repr=False)

    @property
    def kv_dtype(self) -> str:
        return str(self.engine.spec.dtype)

    @property
    def num_slots(self) -> int:
        return self.engine.num_slots

    @property
    def max_len(self) -> int:
        return self.engine.max_len

    @property
    def vocab_size(self) -> int:
        return self.engine.cfg.vocab_size

    def start(self) -> None:
        if not self._started:
            self.scheduler.start()
            self._started = True

    def stop(self, timeout: float = 30.0) -> None:
        """End every stream with a finish event, stop the engine thread, close the compiler pool."""
        if self._started:
            self.scheduler.stop(timeout)
            self._started = False
        self.compiler.close()

    def info(self) -> dict[str, str]:
        return {
            "model": self.model_name,
            "dtype": self.dtype,
            "precision": self.precision,
            "kv_dtype": self.kv_dtype,
            "slots": str(self.num_slots),
            "max_len": str(self.max_len),
            "kv_bytes_per_slot": str(self.engine.bytes_per_slot),
            "grammar_backend": self.compiler.backend,
        }


def assemble_runtime(
    engine: Any,
    tokenizer: Any,
    options: RuntimeOptions | None = None,
    *,
    model_name: str = "custom",
    dtype_reason: str = "",
    precision: str = "float",
    precision_reason: str = "",
    kv_dtype_reason: str = "",
    load_seconds: float = 0.0,
    weights_from_cache: bool = False,
    progress: Progress | None = None,
    compiler: GrammarCompiler | None = None,
) -> Runtime:
    """Grammar compiler (built here unless given) + scheduler + chat template around an already warm
    engine."""
    from scheduler.scheduler import Scheduler

    options = options or RuntimeOptions()
    if compiler is None:
        if progress:
            progress("build the grammar tokenizer bridge")
        compiler = grammar_compiler(tokenizer, options, engine.cfg.vocab_size)
    scheduler = Scheduler(
        engine,
        tokenizer,
        SchedulerConfig(
            prefill_budget=options.prefill_budget,
            max_waiting=options.max_waiting,
            prefix_caching=options.prefix_caching,
            speculative=options.speculative,
            host_tier_bytes=options.host_tier_bytes,
        ),
        stop_ids=compiler.stop_ids,
    )
    return Runtime(
        engine=engine, scheduler=scheduler, tokenizer=tokenizer, compiler=compiler,
        template=ChatTemplate(tokenizer, builtin=options.chat_template), model_name=model_name, dtype=engine.dtype,
        dtype_reason=dtype_reason, precision=precision, precision_reason=precision_reason,
        kv_dtype_reason=kv_dtype_reason, load_seconds=load_seconds, compile_seconds=engine.compile_seconds,
        weights_from_cache=weights_from_cache,
    )


def grammar_compiler(tokenizer: Any, options: RuntimeOptions, vocab_size: int, *,
                     bridge_now: bool = True) -> GrammarCompiler:
    """The grammar compiler with its tokenizer bridge (the slow part: a pass over the vocabulary) built, or
    being built on its own worker unless ``bridge_now``."""
    compiler = GrammarCompiler(tokenizer, options.grammar_backend, compile_timeout_s=options.grammar_compile_timeout_s,
                               max_schema_bytes=options.max_schema_bytes, vocab_size=vocab_size)
    if bridge_now:
        compiler.warm_up()
    else:
        compiler.warm_up_in_background()
    return compiler


def build_runtime(options: RuntimeOptions, progress: Progress | None = None) -> Runtime:
    """Load the model, compile every engine step (warm-up), warm the grammar compiler, build the scheduler."""
    from core.compile_cache import enable_compile_cache
    from core.device import choose_kv_dtype, default_cache_dir
    from core.engine import Engine, EngineConfig
    from core.program_store import ProgramStore
    from core.runtime import load_model

    if options.compile_cache != "off":
        enable_compile_cache(options.compile_cache)
    if progress:
        progress("load the model", detail=str(options.model))
    # Prepared weights and exported programs are cached beside the compiled programs ("off": none of them).
    caching = options.compile_cache != "off"
    weights_cache = default_cache_dir() / "weights" if caching else None
    program_store = ProgramStore(default_cache_dir() / "programs") if caching else None
    model = load_model(options.model, dtype=options.dtype, precision=options.precision,
                       progress=(lambda done, total: progress("load the model", done, total, str(options.model)))
                       if progress else None, weights_cache=weights_cache)
    if progress and model.weights_from_cache:
        progress("load the model", detail=f"{options.model}, prepared weights from {weights_cache}")
    kv_dtype, kv_reason = choose_kv_dtype(options.kv_dtype, model.precision)
    engine = Engine(model.cfg, model.params,
                    EngineConfig(num_slots=options.num_slots, max_len=options.max_len,
                                 chunk_sizes=tuple(options.chunk_sizes), kv_dtype=kv_dtype,
                                 rows_verify_width=ROWS_VERIFY_WIDTH if options.batched_speculation else 0),
                    model.dtype, program_store)
    if progress:
        progress("allocate the KV pool", detail=(
            f"{engine.num_slots} slots x {engine.max_len} positions ({engine.spec.dtype}: {kv_reason}), "
            f"{engine.bytes_per_slot / 2**20:.1f} MiB per slot, "
            f"{engine.bytes_per_slot * engine.num_slots / 2**20:.1f} MiB in all; compute {model.dtype} "
            f"({model.dtype_reason}); precision {model.precision} ({model.precision_reason})"))
    def compiling(name: str, done: int, total: int) -> None:
        detail = f"{total} programs; the tokenizer loaded meanwhile" if done == total else name
        progress("compile the step programs", done, total, detail)

    # The tokenizer loads while the compile threads wait on XLA, which runs outside the GIL.
    engine.warmup(compiling if progress else None, background=options.background_compile,
                  meanwhile=lambda: model.tokenizer)
    # The grammar tokenizer bridge is seconds of work holding the GIL: with a background warm-up it is built
    # after ready, like the larger programs (a constrained request meanwhile waits for it).
    if progress and not options.background_compile:
        progress("build the grammar tokenizer bridge")
    compiler = grammar_compiler(model.tokenizer, options, model.cfg.vocab_size,
                                bridge_now=not options.background_compile)
    return assemble_runtime(engine, model.tokenizer, options, compiler=compiler, model_name=str(options.model),
                            dtype_reason=model.dtype_reason, precision=model.precision,
                            precision_reason=model.precision_reason, kv_dtype_reason=kv_reason,
                            load_seconds=model.load_seconds, weights_from_cache=model.weights_from_cache,
                            progress=progress)


# --------------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------------


@dataclass
class ChatParams:
    """A validated OpenAI request, transport-free. None means "not given" (the agent default applies)."""

    messages: list[dict[str, Any]] | None = None  # chat
    prompt: str | list[int] | None = None  # completions: text, or token ids fed as given
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: tuple[str, ...] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    ignore_eos: bool = False
    close_within_budget: bool = True  # a constrained output near max_tokens closes along its grammar
    session_id: str | None = None
    user: str | None = None
    cache_salt: str | None = None  # requests share cached KV only with the same salt (vLLM's API)
    caller: SessionCaller | None = None  # who asks, for session ownership; None: sessions are shared
    truncation: str | None = None  # "auto" | "disabled"; None: the agent's
    instructions: str | None = None  # a system message for this request only: rendered first, never stored
    only_new: bool = False  # the messages are only what follows the session's history (never a resent history)
    # True: up to MAX_PARALLEL_CALLS calls in one turn. Not given: one (unlike OpenAI's default, since a small
    # model offered more calls tends to run on into calls nobody asked for).
    parallel_tool_calls: bool | None = None


class InvalidRequestError(ValueError):
    """A request the service refuses before generating (HTTP 400); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        self.param = param
        self.code = code
        super().__init__(message)


@dataclass(frozen=True)
class SessionCaller:
    """Who is asking, as far as sessions go: the fingerprint of their API key (never the key), and whether they
    may see every session (an admin key)."""

    owner: str | None
    admin: bool = False

    def may_see(self, session: Session | SessionInfo) -> bool:
        return self.admin or session.owner == self.owner


class SessionNotFoundError(LookupError):
    """No such session for this caller: absent, or owned by another key (HTTP 404 either way)."""

    def __init__(self, agent: str, sid: str) -> None:
        super().__init__(f"no session {sid!r} for agent {agent!r}")


# A session's turn claim (and a request's Idempotency-Key claim) lapses this long after its last renewal, so a
# crashed server frees them; renewed every third of it while the turn runs.
LEASE_S = 30.0


class SessionBusyError(RuntimeError):
    """Another turn of this session is still running, here or on another server (HTTP 409)."""

    def __init__(self, agent: str, sid: str) -> None:
        super().__init__(f"session {sid!r} of agent {agent!r} has a turn running; send the next turn after it "
                         "finishes")


@dataclass(eq=False)
class TurnClaim:
    """One turn's exclusive hold on its session (Store.begin_turn), renewed while the turn runs."""

    store: Store
    agent: str
    sid: str
    token: str
    lease_s: float = LEASE_S
    renewal: asyncio.Task | None = None
    handle: RequestHandle | None = None  # the turn's generation, once submitted

    async def keep(self) -> None:
        """Renew until released; a generation that finished a whole lease ago without a commit (its response
        was never read) lets the claim lapse rather than hold the session."""
        finished_for = 0.0
        while True:
            await asyncio.sleep(self.lease_s / 3)
            if self.handle is not None and self.handle.finished is not None:
                finished_for += self.lease_s / 3
                if finished_for >= self.lease_s:
                    return
            try:
                if not await self.store.renew_turn(self.agent, self.sid, self.token, self.lease_s):
                    log.warning("a turn's session claim lapsed", extra={"event": {"session": self.sid}})
                    return
            except StoreError as e:  # the store is down: the claim lapses on its own, the turn goes on
                log.warning("could not renew a session claim: %s", e)

    async def release(self) -> None:
        if self.renewal is not None:
            self.renewal.cancel()
        await self.store.end_turn(self.agent, self.sid, self.token)


@dataclass(eq=False)  # identity semantics: the server keeps in-flight generations in a set
class Generation:
    """One submitted request: its handle plus what is needed to finish it (tool calls, session commit)."""

    handle: RequestHandle
    agent: AgentSpec
    rendered: RenderedPrompt
    spec: ConstraintSpec | None  # the output constraint (tool calls are parsed with it)
    session_id: str | None
    new_messages: list[dict[str, Any]]  # what this turn adds to the session, before the reply
    created: int = field(default_factory=lambda: int(time.time()))
    claim: TurnClaim | None = None  # the session's turn claim, released by commit or release
    owner: str | None = None  # the key fingerprint a new session is created under

    @property
    def prompt_tokens(self) -> int:
        return len(self.rendered.ids)

    @property
    def tool_mode(self) -> str | None:
        return self.spec.tool_mode if self.spec is not None and self.spec.kind == "tools" else None

    def cancel(self) -> None:
        self.handle.cancel()


@dataclass
class Outcome:
    """The final assistant message of a generation."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str
    budget_closed: bool = False  # the document was closed along its grammar to fit max_tokens

    def extensions(self) -> dict[str, Any]:
        """slotserve's fields beside an API's own in the finished choice / message / response."""
        return {"budget_closed": True} if self.budget_closed else {}

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def _with_ids(calls: list[dict[str, Any]], call_ids: list[str] | None) -> list[dict[str, Any]]:
    for call, call_id in zip(calls, call_ids or (), strict=False):
        call["id"] = call_id
    return calls


class HistoryConflictError(ValueError):
    """A resent history that contradicts the stored session (HTTP 409); ``index`` is the first differing
    message of the request."""

    def __init__(self, index: int, detail: str) -> None:
        self.index = index
        super().__init__(f"messages[{index}] {detail}; send only the new messages, the unchanged history, "
                         "or start a new session")


def _same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as a conversation turn: role, name, tool call id and tool calls (arguments as JSON values), and
    content up to surrounding whitespace (clients strip or re-indent what they send back)."""
    if any(a.get(k) != b.get(k) for k in ("role", "name", "tool_call_id")):
        return False
    if (a.get("content") or "").strip() != (b.get("content") or "").strip():
        return False
    return _calls(a) == _calls(b)


def _calls(message: dict[str, Any]) -> list[tuple[Any, Any]]:
    out = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", {})
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = arguments.strip()
        out.append((fn.get("name"), arguments))
    return out


def merge_history(history: list[dict[str, Any]], incoming: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages of ``incoming`` (normalised) that the stored ``history`` does not hold yet.

    A client either sends only the new message(s), or resends the conversation with the new messages at the
    end (agent frameworks do). A resend is recognised by its first message matching the stored first one
    (with more than one message sent, or a system message first): it must then match the stored history
    message by message (`_same_message`) and add something after it, else `HistoryConflictError`; never is
    a resent history appended twice."""
    if not history or not incoming:
        return incoming
    resend = _same_message(incoming[0], history[0]) and (len(incoming) > 1 or incoming[0]["role"] == "system")
    if not resend:
        if incoming[0]["role"] == "system" and history[0]["role"] == "system":
            raise HistoryConflictError(0, "is a system message that differs from the session's")
        if incoming[0]["role"] == "system" and len(incoming) > 1 and _same_message(incoming[1], history[0]):
            raise HistoryConflictError(0, "is a system message the session does not start with")
        return incoming
    for i, (sent, stored) in enumerate(zip(incoming, history, strict=False)):
        if not _same_message(sent, stored):
            raise HistoryConflictError(i, f"differs from the session's message {i} ({stored['role']})")
    if len(incoming) <= len(history):
        raise HistoryConflictError(len(incoming) - 1, "ends the resent history without a new message")
    return incoming[len(history):]


def response_format_spec(response_format: dict[str, Any] | None) -> ConstraintSpec | None:
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec.json_object()
    if kind == "regex":  # vLLM's structured_outputs extension (the server's own spelling)
        return ConstraintSpec.regex(response_format.get("regex"))
    if kind == "choice":
        return ConstraintSpec.choice(response_format.get("choice") or [])
    if kind == "json_schema":
        body = response_format.get("json_schema") or {}
        if "schema" not in body:
            raise InvalidRequestError("response_format.json_schema.schema is required", "response_format")
        return ConstraintSpec.json_schema(body["schema"], strict=bool(body.get("strict", False)))
    raise InvalidRequestError(f"unsupported response_format type {kind!r}", "response_format.type")


class ChatService:
    """Agent + request -> scheduler request -> finished message (+ session turn)."""

    def __init__(
        self,
        runtime: Runtime,
        store: Store,
        *,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        max_tokens_limit: int | None = None,
        max_prompt_tokens: int | None = None,
        session_ttl: float | None = None,
        lease_s: float = LEASE_S,
        agent_in_store: Callable[[str], bool] = lambda name: False,
    ) -> None:
        self.runtime = runtime
        self.store = store
        # Whether an agent was created in the store (not a config file): its turns are stored only while it
        # still exists there, so deleting it mid-turn cannot resurrect its sessions.
        self.agent_in_store = agent_in_store
        self.default_max_tokens = default_max_tokens
        self.max_tokens_limit = max_tokens_limit
        self.max_prompt_tokens = max_prompt_tokens
        self.session_ttl = session_ttl
        self.lease_s = lease_s

    # ---- building blocks (also used by tests as debug hooks) ------------------------------------

    def prompt_limit(self, agent: AgentSpec) -> int:
        limits = [self.runtime.max_len - 1]
        if agent.context_limit:
            limits.append(agent.context_limit)
        if self.max_prompt_tokens:
            limits.append(self.max_prompt_tokens)
        return min(limits)

    def render_chat(self, agent: AgentSpec, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None, truncation: str = "disabled") -> RenderedPrompt:
        """The prompt ids for a conversation under ``agent`` (the exact ids the model is fed). Over the prompt
        limit, ``truncation="auto"`` drops the oldest turns (never the system messages, never the last turn:
        it ends the conversation) until the rest fits, as the Responses API's truncation does; "disabled"
        raises `PromptTooLongError`."""
        limit = self.prompt_limit(agent)
        render = self.runtime.template.render
        try:
            return render(agent.system_prompt, messages, tools=tools, max_prompt_tokens=limit)
        except PromptTooLongError:
            if truncation != "auto":
                raise
        lead = leading_system_count(messages)
        cuts = [i for i in range(lead + 1, len(messages)) if messages[i]["role"] == "user"]  # where turns start
        lo, hi, best = 0, len(cuts) - 1, None  # the fewest turns dropped that fit: binary search over cuts
        while lo <= hi:
            mid = (lo + hi) // 2
            try:
                best = render(agent.system_prompt, messages[:lead] + messages[cuts[mid]:], tools=tools,
                              max_prompt_tokens=limit)
                hi = mid - 1
            except PromptTooLongError:
                lo = mid + 1
        if best is None:  # even the last turn alone is too long
            return render(agent.system_prompt, messages[:lead] + messages[cuts[-1]:] if cuts else messages,
                          tools=tools, max_prompt_tokens=limit)
        return best

    def sampling(self, agent: AgentSpec, p: ChatParams) -> SamplingParams:
        d = agent.defaults

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(p, name)
            if value is None:
                value = getattr(d, name, None)
            return fallback if value is None else value

        bias = p.logit_bias or {}
        vocab = self.runtime.vocab_size
        for token in bias:
            if not 0 <= token < vocab:
                raise InvalidRequestError(f"logit_bias token id {token} is outside the vocabulary [0, {vocab})",
                                          "logit_bias")
        try:
            return SamplingParams(
                temperature=float(pick("temperature", 1.0)),
                top_k=int(pick("top_k", 0)),
                top_p=float(pick("top_p", 1.0)),
                min_p=float(pick("min_p", 0.0)),
                seed=p.seed,
                repetition_penalty=float(pick("repetition_penalty", 1.0)),
                frequency_penalty=float(pick("frequency_penalty", 0.0)),
                presence_penalty=float(pick("presence_penalty", 0.0)),
                logit_bias=tuple(sorted(bias.items())),
                logprobs=p.top_logprobs if p.logprobs else 0,
                dry_multiplier=float(pick("dry_multiplier", 0.0)),
                dry_base=float(pick("dry_base", dry.DEFAULT_BASE)),
                dry_allowed_length=int(pick("dry_allowed_length", dry.DEFAULT_ALLOWED_LENGTH)),
                dry_penalty_last_n=int(pick("dry_penalty_last_n", dry.DEFAULT_PENALTY_LAST_N)),
                dry_sequence_breakers=tuple(pick("dry_sequence_breakers", dry.DEFAULT_BREAKERS)),
            )
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None

    def constraint_spec(self, agent: AgentSpec, p: ChatParams) -> tuple[ConstraintSpec | None, list | None]:
        """(the output constraint, the tools to describe in the prompt)."""
        tools = p.tools if p.tools is not None else agent.tools
        choice = p.tool_choice if p.tool_choice is not None else (agent.tool_choice if p.tools is None else "auto")
        response_format = p.response_format if p.response_format is not None else agent.response_format
        format_spec = response_format_spec(response_format)
        # With both, the model calls a tool (as tool_choice allows) or answers with a document of the format.
        spec = format_spec
        if tools or choice not in ("auto", "none"):
            spec = ConstraintSpec.tools(tools, choice, answer=format_spec, parallel=p.parallel_tool_calls is True)
        described = tools if tools and choice != "none" else None
        return spec, described

    async def session_messages(self, agent: AgentSpec, session_id: str | None, messages: list[dict[str, Any]],
                               caller: SessionCaller | None = None, only_new: bool = False
                               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(the full conversation to render, the new messages this turn adds to the session). A session owned
        by another key is `SessionNotFoundError`, as if it did not exist. ``only_new``: ``messages`` follow the
        history (a chained response's input), never a resend of it."""
        incoming = normalize_messages(messages)
        if session_id is None:
            return incoming, incoming
        session = await self.store.get_session(agent.name, session_id)
        if session is not None and caller is not None and not caller.may_see(session):
            raise SessionNotFoundError(agent.name, session_id)
        history = session.messages if session is not None else []
        limit = self.store.max_sessions_per_agent
        if session is None and limit and len(await self.store.list_sessions(agent.name)) >= limit:
            raise SessionLimitError(agent.name, limit)  # refuse before generating, not at commit
        new = incoming if only_new else merge_history(history, incoming)
        return history + new, new

    # ---- the request ---------------------------------------------------------------------------

    async def submit(self, agent: AgentSpec, p: ChatParams) -> Generation:
        """Validate, render, compile the constraint and submit; raises before any token is generated. A session
        turn first claims its session (one turn at a time per session, across servers sharing the store);
        the claim is released by `commit`, or by `release` if the turn ends without one."""
        claim = await self._claim(agent, p.session_id) if p.session_id is not None else None
        try:
            gen = await self._submit(agent, p)
        except BaseException:
            if claim is not None:
                await claim.release()
            raise
        if claim is not None:
            claim.handle = gen.handle
        gen.claim = claim
        return gen

    async def _claim(self, agent: AgentSpec, sid: str) -> TurnClaim:
        token = await self.store.begin_turn(agent.name, sid, self.lease_s)
        if token is None:
            raise SessionBusyError(agent.name, sid)
        claim = TurnClaim(self.store, agent.name, sid, token, self.lease_s)
        claim.renewal = asyncio.create_task(claim.keep())
        return claim

    async def release(self, gen: Generation) -> None:
        """End the turn's claim on its session without committing (failed, refused or cancelled turns)."""
        claim, gen.claim = gen.claim, None
        if claim is not None:
            await claim.release()

    async def render(self, agent: AgentSpec, p: ChatParams
                     ) -> tuple[ConstraintSpec | None, RenderedPrompt, list[dict[str, Any]]]:
        """(the output constraint, the prompt as the model sees it, the messages this turn adds to its session)."""
        spec, tools = self.constraint_spec(agent, p)
        if p.messages is not None:
            conversation, new_messages = await self.session_messages(agent, p.session_id, p.messages, p.caller,
                                                                     p.only_new)
            if not conversation:
                raise InvalidRequestError("messages must not be empty", "messages")
            truncation = p.truncation or agent.truncation
            if p.instructions:
                conversation = [{"role": "system", "content": p.instructions}, *conversation]
            rendered = await asyncio.to_thread(self.render_chat, agent, conversation, tools, truncation)
        else:
            if p.session_id is not None:
                raise InvalidRequestError("sessions are supported on chat completions only", "session_id")
            new_messages = []
            rendered = await asyncio.to_thread(self._render_completion, agent, p.prompt)
        return spec, rendered, new_messages

    async def _submit(self, agent: AgentSpec, p: ChatParams) -> Generation:
        spec, rendered, new_messages = await self.render(agent, p)
        sampling = self.sampling(agent, p)
        constraint = None
        if spec is not None:
            compiled = await asyncio.wrap_future(self.runtime.compiler.compile_async(spec))
            constraint = self.runtime.compiler.matcher(compiled)
        room = generation_room(len(rendered.ids), self.runtime.max_len)
        wanted = p.max_tokens or agent.defaults.max_tokens or self.default_max_tokens
        max_tokens = min(wanted, room, self.max_tokens_limit or wanted)
        stop = [*(p.stop if p.stop is not None else (agent.defaults.stop or [])), *rendered.stop]
        request = GenerationRequest(
            prompt_ids=tuple(rendered.ids),
            sampling=sampling,
            max_tokens=max_tokens,
            stop=tuple(stop),
            ignore_eos=p.ignore_eos,
            close_within_budget=p.close_within_budget,
            # The scheduler knows groups, not agents: an agent is a fair-share group and a cache scope (with
            # the client's salt); a session is an affinity key within its agent and the dashboard's label.
            affinity=f"{agent.name}:{p.session_id}" if p.session_id else None,
            group=agent.name,
            priority=agent.priority,
            cache_scope=(agent.name, p.cache_salt),
            label=p.session_id,
            boundaries=rendered.boundaries,
            want_logprobs=p.logprobs,
            constraint=constraint,
        )
        handle = self.runtime.scheduler.submit(request, loop=asyncio.get_running_loop())
        return Generation(handle, agent, rendered, spec, p.session_id, new_messages,
                          owner=p.caller.owner if p.caller is not None else None)

    def _render_completion(self, agent: AgentSpec, prompt: str | list[int] | None) -> RenderedPrompt:
        if prompt is None:
            raise InvalidRequestError("prompt is required", "prompt")
        if isinstance(prompt, list):
            vocab = self.runtime.vocab_size
            if not prompt or any(not 0 <= t < vocab for t in prompt):
                raise InvalidRequestError(f"prompt token ids must be a non-empty list in [0, {vocab})", "prompt")
            limit = self.prompt_limit(agent)
            if len(prompt) > limit:
                from agents.chat_template import PromptTooLongError

                raise PromptTooLongError(len(prompt), limit)
            return RenderedPrompt(list(prompt), 0, "")
        return self.runtime.template.render_completion(prompt, max_prompt_tokens=self.prompt_limit(agent))

    def finish(self, gen: Generation, text: str, reason: FinishReason, call_ids: list[str] | None = None,
               budget_closed: bool = False) -> Outcome:
        """The assistant message for the generated ``text`` (tool calls parsed) and the OpenAI finish reason.
        ``call_ids``: the ids the stream already gave the calls. A call cut short by max_tokens is still the
        call it was becoming (finish reason "length"), never leaked into the content. ``budget_closed``: the
        scheduler closed the output to fit max_tokens (its finish reason stays the natural one)."""
        outcome = ChatService._outcome(gen, text, reason, call_ids)
        outcome.budget_closed = budget_closed
        return outcome

    @staticmethod
    def _outcome(gen: Generation, text: str, reason: FinishReason, call_ids: list[str] | None) -> Outcome:
        finish = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(reason, str(reason))
        if gen.tool_mode is not None:
            after_text = gen.spec.answer_schema is None
            lead = split_answer(text, gen.spec)[0] if gen.tool_mode == "auto" else ""  # the text before calls
            try:
                calls = parse_tool_calls(text, gen.spec)
            except ValueError:  # cut short (max_tokens, a stop sequence)
                partial = parse_partial_calls(text, gen.tool_mode, after_text)
                if partial:
                    return Outcome(lead or None, _with_ids(partial, call_ids), finish)
                if begins_call(text, gen.tool_mode, after_text):  # cut before it named a function
                    return Outcome(lead, None, finish)
                calls = None
            if calls:
                return Outcome(lead or None, _with_ids(calls, call_ids), "tool_calls")
        return Outcome(text, None, finish)

    def call_stream(self, gen: Generation) -> ToolCallStream:
        """Splits the generation's text into answer text and tool-call pieces as it arrives."""
        after_text = gen.tool_mode is not None and gen.spec.answer_schema is None
        return ToolCallStream(gen.tool_mode, calls_after_text=after_text)

    async def commit(self, gen: Generation, outcome: Outcome) -> Session | None:
        """Store this turn (new messages + the reply) in the session, if the request has one, then release the
        session for its next turn. Returns the session as stored after this turn."""
        if gen.session_id is None:
            return None
        reply = outcome.message()
        if reply["content"] is None:
            reply["content"] = ""
        try:
            return await self.store.append_turn(gen.agent.name, gen.session_id, [*gen.new_messages, reply],
                                                ttl=self.session_ttl, owner=gen.owner,
                                                require_agent=self.agent_in_store(gen.agent.name))
        finally:
            await self.release(gen)
