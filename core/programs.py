"""Compiled programs: one jitted step at fixed shapes, compiled ahead of its first call.

A `Program` is compiled from abstract arguments (shapes and dtypes, `abstract`), so warm-up never runs a
step and may compile on another thread while the engine serves: nothing it touches is a live buffer. It is
exported first (`jax.export`: traced and lowered once), then its exported module is compiled; with a
`ProgramStore` an earlier process's export is read back instead of tracing again, and the XLA compilation
cache, when enabled, serves the executable an earlier process compiled. Programs may compile on
several threads at once (their lowering is serialized, their compilation is not). A call to a program
not compiled yet compiles it first, or waits for the thread compiling it: a call never switches to another
program (a larger attention bucket is not bit-identical on every backend).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax
from jax import export

from core.program_store import ProgramStore, program_key

ProgramKey = tuple[Hashable, ...]  # (kind, then the sizes that fix its shapes), e.g. ("decode", 1024)
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_hits: collections.Counter[int] = collections.Counter()  # thread id -> XLA cache hits, to tell what was loaded
# One program is traced and lowered at a time, in any thread. JAX's tracing caches are shared between
# threads, and two threads lowering at once were seen to produce different (equivalent) modules run to
# run: different compilation-cache keys, so a restart missed the cache. Compiling (or loading a compiled
# program from the cache) runs outside the lock, overlapping the next program's lowering.
_lowering = threading.Lock()
log = logging.getLogger(__name__)


def _count_hit(event: str, **_: Any) -> None:
    if event == _CACHE_HIT:
        _hits[threading.get_ident()] += 1


jax.monitoring.register_event_listener(_count_hit)


def abstract(tree: Any) -> Any:
    """Shapes and dtypes of every array in a pytree (what a program is compiled for)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


class Program:
    """One jitted function at one signature. Thread-safe: two threads compiling it compile it once.

    ``identity`` names the function and its static arguments for the store's key (the caller's promise:
    two programs with one identity trace alike for the same abstract arguments)."""

    def __init__(self, name: str, fn: Callable[..., Any], donate: tuple[int, ...] = (), identity: str = "",
                 store: ProgramStore | None = None) -> None:
        self.name = name  # what a person reads in the progress display
        self._fn = fn  # jax.jit-wrapped with these donated arguments
        self._donate = donate
        self._identity = identity or name
        self._store = store
        self._compiled: Any = None  # jax.stages.Compiled once `compile` has run
        self._lock = threading.Lock()
        self.compile_seconds: float | None = None  # None: not compiled ahead
        self.from_cache = False  # its executable came from the XLA compilation cache
        self.from_store = False  # its exported module came from the program store (no tracing)

    @property
    def ready(self) -> bool:
        return self._compiled is not None

    def compile(self, *args: Any) -> float:
        """Lower and compile for these (abstract or concrete) arguments; seconds taken (0 if it was ready)."""
        with self._lock:
            if self._compiled is not None:
                return 0.0
            begin, hits = time.perf_counter(), _hits[threading.get_ident()]
            with _lowering:
                lowered = self._lower(abstract(args))
            compiled = lowered.compile()
            self.from_cache = _hits[threading.get_ident()] > hits  # set before `ready` turns true
            self._compiled = compiled
            self.compile_seconds = round(time.perf_counter() - begin, 3)
            return self.compile_seconds

    def _lower(self, args: tuple[Any, ...]) -> jax.stages.Lowered:
        """The exported module (from the store, or traced now) wrapped in a jitted call with the donation."""
        def make() -> export.Exported:
            return export.export(self._fn)(*args)

        try:
            if self._store is None:
                exported = make()
            else:
                exported, self.from_store = self._store.exported(program_key(self._identity, args), make)
        except Exception as e:  # e.g. a custom call outside export's stable set: the same choice every start
            log.warning("program %s cannot be exported (%s): lowered directly, traced at every start", self.name, e)
            return self._fn.lower(*args)
        return jax.jit(exported.call, donate_argnums=self._donate).lower(*args)

    def __call__(self, *args: Any) -> Any:
        compiled = self._compiled
        if compiled is None:  # not warmed up yet: compile now (or wait for the thread compiling it)
            self.compile(*args)
            compiled = self._compiled
        return compiled(*args)
