"""The chat service between the HTTP server and the scheduler.

`ChatService` turns an agent plus a transport-free request (`agents.chat_params.ChatParams`) into a
`GenerationRequest` and back: history (`agents.history`) -> prompt (the agent's system prompt, tools, the chat
template) -> constraint (response_format / tools) -> sampling (agent defaults overridden by the request) ->
request; after generation it parses tool calls and commits the session turn under its lease
(`agents.store.lease`). The runtime it serves on is built by `agents.runtime`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agents.adapters import AdapterLibrary
from agents.chat_params import ChatParams, SessionCaller
from agents.chat_template import PromptTooLongError, RenderedPrompt
from agents.errors import InvalidRequestError, SessionBusyError, SessionNotFoundError
from agents.history import merge_history
from agents.messages import normalize_messages
from agents.prompt_text import leading_system_count
from agents.runtime import Runtime
from agents.spec import AgentSpec
from agents.store import Session, SessionLimitError, Store
from agents.store.lease import LEASE_S, TurnClaim
from agents.tool_calls import ToolCallStream, begins_call, parse_partial_calls, parse_tool_calls, split_answer
from core import dry
from core.sampling import SamplingParams
from scheduler.grammar_spec import ConstraintSpec
from scheduler.request import (
    DEFAULT_MAX_TOKENS,
    FinishReason,
    GenerationRequest,
    RequestHandle,
    generation_room,
)

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_TOKENS", "ChatService", "Generation", "Outcome", "response_format_spec"]



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
        adapters: AdapterLibrary | None = None,
    ) -> None:
        self.runtime = runtime
        self.store = store
        # The LoRA adapters agents name; an agent from the store names one through the adapter directories only.
        self.adapters = adapters or AdapterLibrary(runtime.adapter_reader())
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
        adapter = None
        if agent.adapter is not None:
            trusted = not self.agent_in_store(agent.name)  # an agent file is trusted like the config
            adapter = await asyncio.to_thread(self.adapters.load, agent.adapter, trusted)
        room = generation_room(len(rendered.ids), self.runtime.max_len)
        wanted = p.max_tokens or agent.defaults.max_tokens or self.default_max_tokens
        max_tokens = min(wanted, room, self.max_tokens_limit or wanted)
        # The template's turn-end text is the turn's EOS: ignore_eos ignores it too (the client's stops hold).
        turn_end = () if p.ignore_eos else rendered.stop
        stop = [*(p.stop if p.stop is not None else (agent.defaults.stop or [])), *turn_end]
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
            adapter=adapter,
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
