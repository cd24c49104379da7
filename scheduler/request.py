"""What callers hand the scheduler and what they get back."""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from core.sampling import SamplingParams


class SchedulerError(Exception):
    """Base of the errors a caller can act on (the server maps them to HTTP statuses)."""


class QueueFullError(SchedulerError):
    """The bounded waiting queue is full (HTTP 429)."""


class ContextLengthError(SchedulerError, ValueError):
    """The prompt does not fit a slot (HTTP 400)."""


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    session: str | None = None  # drives slot affinity; None: no affinity
    agent: str = "default"
    priority: int = 1  # weight in the fair share across agents
    # Prompt positions where a message ends (the system prompt, each turn): prefill chunks end there, so a later
    # request resuming at one computes the rest in the very chunks a cold run uses.
    boundaries: tuple[int, ...] = ()
    cache_salt: str | None = None  # requests share cached KV only with the same agent and the same salt
    seed: int | None = None  # None: drawn at admission (also the sampling seed unless sampling.seed is set)
    want_logprobs: bool = False  # the sampled token's logprob (top alternatives: sampling.logprobs)
    constraint: Any = None  # structured-output state (per slot); None: unconstrained

    @property
    def cache_scope(self) -> tuple[str, str | None]:
        """Cached KV is reused only within one scope: one agent and one cache salt."""
        return self.agent, self.cache_salt

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.priority < 1:
            raise ValueError("priority must be a positive integer")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class TokenEvent:
    """One generated token: its id, the text it completes (may be empty while a UTF-8 character or a
    possible stop string is held back), and logprobs when asked for."""

    token_id: int
    text: str
    iteration: int  # the scheduler iteration that produced it (tests count iterations, not seconds)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class FinishEvent:
    reason: FinishReason
    usage: Usage
    text: str = ""  # text released at the end (held-back characters), not yet sent in a TokenEvent
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)


Event = TokenEvent | FinishEvent


class RequestHandle:
    """The caller's side of one request: an event stream (sync or asyncio) and cancel().

    Events are produced on the engine thread. With an asyncio loop they are handed over with
    call_soon_threadsafe; otherwise through a thread-safe queue for blocking readers.
    """

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.request = request
        self.cancelled = threading.Event()
        self._loop = loop
        self._async_queue: asyncio.Queue[Event] | None = asyncio.Queue() if loop else None
        self._sync_queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.finished: FinishEvent | None = None

    def cancel(self) -> None:
        """Ask the engine loop to stop this request; its slot is freed within one iteration."""
        self.cancelled.set()

    def _deliver(self, events: list[Event]) -> None:
        """Called on the engine thread with one iteration's events for this request."""
        for event in events:
            if isinstance(event, FinishEvent):
                self.finished = event
        if self._loop is not None and self._async_queue is not None:
            self._loop.call_soon_threadsafe(_put_all, self._async_queue, events)
        else:
            for event in events:
                self._sync_queue.put(event)

    def events(self, timeout: float | None = None):
        """Blocking iterator over events (for threads, tests and benchmarks), ending after the finish."""
        while True:
            event = self._sync_queue.get(timeout=timeout)
            yield event
            if isinstance(event, FinishEvent):
                return

    def __aiter__(self):
        return self._aiter()

    async def _aiter(self):
        assert self._async_queue is not None, "submit with loop= to iterate asynchronously"
        while True:
            event = await self._async_queue.get()
            yield event
            if isinstance(event, FinishEvent):
                return

    def result(self, timeout: float | None = None) -> tuple[list[int], str, FinishEvent]:
        """Block until done: (generated token ids, text, finish event)."""
        ids: list[int] = []
        parts: list[str] = []
        for event in self.events(timeout):
            if isinstance(event, TokenEvent):
                ids.append(event.token_id)
                parts.append(event.text)
            else:
                parts.append(event.text)
                return ids, "".join(parts), event
        raise RuntimeError("event stream ended without a finish event")


def _put_all(target: asyncio.Queue, events: list[Event]) -> None:
    for event in events:
        target.put_nowait(event)
