"""Structured output: per-slot grammars inside the batched decode step.

A request's `ConstraintSpec` (JSON schema, any JSON object, regex, choice, tool calls) is compiled
once per (spec, tokenizer) by a `GrammarCompiler`, off the engine thread; each request then gets its
own `GrammarMatcher`, and `fill_masks` writes the allowed-token bitmasks of all constrained slots in
one parallel call before sampling. Backends: llguidance (default) or outlines-core, see
`scheduler.grammar_backends`; the tool-call output format is described in `scheduler.grammar_spec`.

Fail closed: a constraint the backend cannot enforce exactly raises `UnsupportedConstraintError`
(HTTP 400) naming the feature, before any token is generated. Known departures, all in the safe
direction (some valid outputs cannot be produced, no invalid one can): JSON is compact and object
keys come in schema order; `format` is asserted, not just annotated; equal numbers have one spelling
in const/enum (``1`` but not ``1.0``).

Usage::

    compiler = GrammarCompiler(tokenizer)          # once; compiler.warm_up() at start-up
    compiled = compiler.compile(spec)              # or compile_async(spec) -> Future
    m = compiler.matcher(compiled)                 # per request
    fill_masks([(m, slot)], bitmask)               # per decode step, all constrained slots at once
    m.consume(sampled_token)
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.tokenizer import Tokenizer
from scheduler.grammar_backends import Backend, GrammarMatcher, mask_words, repeats_possible
from scheduler.grammar_llguidance import (
    LLGuidanceBackend,
    LLGuidanceMatcher,
    fill_llguidance_masks,
    llguidance_tokenizer,
)
from scheduler.grammar_outlines import OutlinesCoreBackend, OutlinesMatcher
from scheduler.grammar_spec import ConstraintSpec, GrammarBusyError, UnsupportedConstraintError
from scheduler.json_keys import KeyTracker, QuoteTokens, quote_tokens
from scheduler.tool_protocol import TOOL_CALL_MARKER
from scheduler.unique_items import SchemaNav, call_nav, document_nav

# What the compiler does unless told otherwise (the server's config and the runtime read these).
DEFAULT_BACKEND = "llguidance"
COMPILE_TIMEOUT_S = 10.0  # a schema still compiling after this is refused as too complex
MAX_SCHEMA_BYTES = 256_000  # larger constraints are refused before compiling

__all__ = [
    "CompiledGrammar",
    "ConstraintSpec",
    "GrammarBusyError",
    "GrammarCompiler",
    "GrammarMatcher",
    "UnsupportedConstraintError",
    "fill_masks",
    "llguidance_tokenizer",
]

BACKENDS: dict[str, type[Backend]] = {"llguidance": LLGuidanceBackend, "outlines-core": OutlinesCoreBackend}


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled, shareable grammar; `GrammarCompiler.matcher` makes per-request state from it."""

    spec: ConstraintSpec
    backend: str
    compile_s: float  # wall time of the compile itself
    handle: Any = field(repr=False, compare=False)  # LLMatcher template / outlines-core Index
    # The schemas the host's key tracker follows the document and each tool call by (`scheduler.unique_items`):
    # which arrays it keeps unique, which objects may repeat a key.
    nav: SchemaNav | None = field(default=None, repr=False, compare=False)
    call_nav: SchemaNav | None = field(default=None, repr=False, compare=False)
    repeats_possible: bool = True  # some key or unique item could repeat: the host's tracker checks each step


class GrammarCompiler:
    """Compiles `ConstraintSpec`s for one tokenizer and backend; cached, thread-safe.

    Compiles run on a small thread pool (both backends release the GIL while compiling). Each has
    ``compile_timeout_s`` from its submission: a schema still compiling then is refused as too complex,
    one still queued behind others gets `GrammarBusyError` (HTTP 429; nothing is cached, a retry may
    succeed). At most ``max_pending`` compiles are queued or running (one that timed out still holds its
    worker until it ends); a new schema beyond that gets `GrammarBusyError` at once, so a flood of slow
    schemas costs bounded work. A constraint over ``max_schema_bytes`` is refused before compiling; refusals
    are cached like results, so a pathological schema costs one compile. ``vocab_size`` is the model's
    (logit) vocabulary if it is larger than the tokenizer's; the extra ids are never allowed.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        backend: str = DEFAULT_BACKEND,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
        max_schema_bytes: int = MAX_SCHEMA_BYTES,
        cache_size: int = 256,
        *,
        vocab_size: int | None = None,
        max_workers: int = 2,
        max_pending: int = 8,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown grammar backend {backend!r}; choose from {sorted(BACKENDS)}")
        self.tokenizer = tokenizer
        self.backend = backend
        self.compile_timeout_s = compile_timeout_s
        self.max_schema_bytes = max_schema_bytes
        self.cache_size = cache_size
        self._backend = BACKENDS[backend](tokenizer, vocab_size)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self.max_pending = max_pending
        self._pending = 0  # compiles queued or running
        self._started: set[int] = set()  # ids of futures whose compile has begun
        self._lock = threading.Lock()
        self._cache: OrderedDict[ConstraintSpec, Future[CompiledGrammar]] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self._quotes: QuoteTokens | None = None

    @property
    def vocab_size(self) -> int:
        """Masks are [rows, ceil(vocab_size / 32)] words."""
        return self._backend.vocab_size

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._backend.stop_ids

    def warm_up(self) -> None:
        """Build the tokenizer bridge now (seconds, once per process and tokenizer); call at start-up."""
        self._backend.warm_up()
        self.quote_tokens()

    def warm_up_in_background(self, after: Callable[[], bool] | None = None) -> Future[None]:
        """Build the tokenizer bridge on a compile worker once ``after`` returns True (a server passes "when
        no step has run for a while": the bridge is seconds of Python holding the GIL; False: never, the
        future is cancelled); a compile submitted meanwhile builds it or waits for it (its time counts
        against that compile's timeout)."""
        if after is None:
            return self._pool.submit(self.warm_up)
        built: Future[None] = Future()

        def when_ready() -> None:
            if not after():
                built.cancel()
                return
            try:
                done = self._pool.submit(self.warm_up)
            except RuntimeError as e:  # closed meanwhile
                built.set_exception(e)
                return
            done.add_done_callback(lambda f: _pass_on(f, built))

        threading.Thread(target=when_ready, name="grammar-bridge-wait", daemon=True).start()
        return built

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        """The compiled grammar for ``spec`` (blocking); raises UnsupportedConstraintError."""
        return self.compile_async(spec).result()

    def compile_async(self, spec: ConstraintSpec) -> Future[CompiledGrammar]:
        """A future of the compiled grammar; concurrent requests for one spec share one compile."""
        if not isinstance(spec, ConstraintSpec):
            raise TypeError(f"expected a ConstraintSpec, got {type(spec).__name__}")
        size = len(spec.value.encode())
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(spec)
                self.hits += 1
                return future
            self.misses += 1
            future = Future()
            if size > self.max_schema_bytes:
                future.set_exception(UnsupportedConstraintError(
                    "schema size", f"{size} bytes, over the limit of {self.max_schema_bytes}"))
            elif self._pending >= self.max_pending:
                future.set_exception(GrammarBusyError(f"{self._pending} schemas are compiling; try again shortly"))
                return future  # not cached: a retry may find room
            else:
                self._pending += 1
            self._cache[spec] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        if future.done():
            return future
        timer = threading.Timer(self.compile_timeout_s, self._expire, (spec, future))
        timer.daemon = True
        timer.start()
        future.add_done_callback(lambda _: timer.cancel())
        self._pool.submit(self._run, spec, future)
        return future

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """Fresh per-request state for ``compiled`` (cheap: a copy of the compiled template), with a key tracker
        where the output holds JSON (`scheduler.json_keys`)."""
        if compiled.backend != self.backend:
            raise ValueError(f"grammar compiled by {compiled.backend}, this compiler uses {self.backend}")
        matcher = self._backend.matcher(compiled.handle)
        spec = compiled.spec
        if spec.kind in ("json_schema", "json_object", "tools"):
            # Tool calls: each marker starts a document; free text before a call (tool choice auto with no
            # answer format) is not JSON, so tracking starts at the first marker.
            calls = spec.kind == "tools"
            first_is_call = calls and spec.tool_mode != "auto"  # no marker before a required call
            matcher.keys = KeyTracker(self.quote_tokens(), restart_at=TOOL_CALL_MARKER.encode() if calls else b"",
                                      armed=not calls or spec.answer_schema is not None or spec.tool_mode != "auto",
                                      schema=compiled.call_nav if first_is_call else compiled.nav,
                                      call_schema=compiled.call_nav, checks=compiled.repeats_possible)
        return matcher

    def quote_tokens(self) -> QuoteTokens:
        """The tokenizer's tokens holding a quote (`scheduler.json_keys`), found on first use (~0.3 s)."""
        with self._lock:
            if self._quotes is None:
                self._quotes = quote_tokens(self.tokenizer)
            return self._quotes

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "size": len(self._cache)}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- internals ------------------------------------------------------------------------------

    def _run(self, spec: ConstraintSpec, future: Future[CompiledGrammar]) -> None:
        try:
            with self._lock:
                if future.done():  # timed out or cancelled while queued
                    return
                self._started.add(id(future))
            self._backend.warm_up()  # the one-time tokenizer bridge (built at start-up in serving)
            start = time.perf_counter()
            try:
                handle = self._backend.compile(spec)
            except UnsupportedConstraintError as e:
                self._settle(future, error=e)
            except Exception as e:  # a bug or resource error, not a verdict on the spec: do not cache it
                self._forget(spec, future)
                self._settle(future, error=e)
            else:
                unique = calls = None
                if self.backend == "llguidance":
                    patterns = self._backend.pattern_language()
                    unique, calls = document_nav(spec, patterns), call_nav(spec, patterns)
                compiled = CompiledGrammar(spec, self.backend, time.perf_counter() - start, handle, unique,
                                           calls, repeats_possible(spec))
                self._settle(future, result=compiled)
        finally:
            with self._lock:
                self._pending -= 1
                self._started.discard(id(future))

    def _expire(self, spec: ConstraintSpec, future: Future[CompiledGrammar]) -> None:
        """compile_timeout_s after submission: a running compile is refused as too complex (it finishes in the
        background and is dropped: it cannot be interrupted); a queued one is refused as busy, uncached."""
        with self._lock:
            running = id(future) in self._started
        if running:
            detail = f"compiling took longer than {self.compile_timeout_s:g} s"
            self._settle(future, error=UnsupportedConstraintError("grammar too complex", detail))
        else:
            self._forget(spec, future)
            self._settle(future, error=GrammarBusyError(
                f"the schema waited {self.compile_timeout_s:g} s for a compile worker; try again shortly"))

    def _forget(self, spec: ConstraintSpec, future: Future[CompiledGrammar]) -> None:
        with self._lock:
            if self._cache.get(spec) is future:
                del self._cache[spec]

    @staticmethod
    def _settle(
        future: Future[CompiledGrammar], result: CompiledGrammar | None = None, error: BaseException | None = None
    ) -> None:
        try:  # first writer wins (compile vs. timeout vs. cancel)
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]
        except InvalidStateError:
            pass


def fill_masks(rows: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
    """Fill the listed rows of a C-contiguous [S, ceil(V/32)] uint32 (or int32) bitmask: bit j of word
    w allows token 32*w + j (LSB first). llguidance rows are computed in parallel without the GIL;
    rows not listed are left untouched. A row whose matcher is finished or in error allows only the
    stop tokens, so the sequence ends (check `GrammarMatcher.error` to tell which)."""
    if bitmask.ndim != 2 or bitmask.dtype not in (np.uint32, np.int32) or not bitmask.flags.c_contiguous:
        raise ValueError("bitmask must be a C-contiguous 2-D uint32 or int32 array")
    llg_rows: list[tuple[GrammarMatcher, int]] = []
    oc_rows: list[tuple[OutlinesMatcher, int]] = []
    for matcher, row in rows:
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"row {row} outside a bitmask of {bitmask.shape[0]} rows")
        if mask_words(matcher.vocab_size) != bitmask.shape[1]:
            raise ValueError(f"{bitmask.shape[1]} words per row; the vocabulary needs {mask_words(matcher.vocab_size)}")
        if isinstance(matcher, LLGuidanceMatcher):
            llg_rows.append((matcher, row))
        elif isinstance(matcher, OutlinesMatcher):
            oc_rows.append((matcher, row))
        else:
            raise TypeError(f"unknown matcher type {type(matcher).__name__}")
    if llg_rows:
        fill_llguidance_masks(llg_rows, bitmask.view(np.int32))
    words = bitmask.view(np.uint32)
    for matcher, row in oc_rows:
        matcher.fill_row(words[row])


def _pass_on(source: Future[None], target: Future[None]) -> None:
    """Settle ``target`` as ``source`` settled."""
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(None)
