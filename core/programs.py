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
from collections.abc import Callable, Hashable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import jax
from jax import export

from core.program_store import ProgramStore, program_key

ProgramKey = tuple[Hashable, ...]  # (kind, then the sizes that fix its shapes), e.g. ("decode", 1024)
# Programs compiled at once during warm-up: tracing holds the GIL while XLA's compiler and the compilation
# cache's loading do not, so two threads overlap one program's tracing with another's compile or load.
COMPILE_THREADS = 2
# Work that may wait (programs nobody asked for, the grammar bridge) starts only after the caller has served
# nothing for this long: a restarted server's first requests arrive right after ready, and a load already
# started (~0.5 s of CPU, not interruptible) would compete with them.
QUIET_S = 2.0
# While the caller serves, a program it wants (a speedup left out until loaded) loads only once this many steps
# have asked for it: a restarted server's first wave of streams passes through a step or two with one stream
# alone (the others wait for its shared prefix), and loading the lone stream's verify program then (~3 s of a
# core on a 2-core host) slowed the eight streams that followed by ~10%. Once serving pauses it loads at once.
ASKS_WHILE_SERVING = 8
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
        self.calls = 0  # how many times it ran

    @property
    def identity(self) -> str:
        """What names this program in the program store: its function and static arguments."""
        return self._identity

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
            begin = time.perf_counter()
            self.compile(*args)
            log.info("program %s was not loaded: a call waited %.2f s for it", self.name, time.perf_counter() - begin)
            compiled = self._compiled
        self.calls += 1
        return compiled(*args)


class ProgramTable(Mapping[ProgramKey, Program]):
    """Every program of an engine, and their warm-up: compiled ahead from abstract arguments
    (``example_args(key)``), all at once or the first ones now and the rest on a background thread.

    ``first_needed(key)``: compiled before a background warm-up reports ready (what a short first request
    runs); ``order(key)``: the sort key of the rest on the background thread."""

    def __init__(self, programs: dict[ProgramKey, Program], example_args: Callable[[ProgramKey], tuple[Any, ...]],
                 first_needed: Callable[[ProgramKey], bool], order: Callable[[ProgramKey], Any]) -> None:
        self._programs = programs
        self._example_args = example_args
        self._first_needed = first_needed
        self._order = order
        self.background: threading.Thread | None = None  # the background warm-up, once started
        self._stop = threading.Event()  # set by `stop_background`: compile no further program
        self._wake = threading.Condition()  # guards the four below; notified when they change or on stop
        self._serving = False  # the caller has work: load only what steps keep asking for
        self._idle_since = time.monotonic()  # when the caller last stopped serving
        self._loop_started = False  # a caller has reported serving or waiting at least once
        self._wanted: list[ProgramKey] = []  # asked for by a caller, loaded before the rest
        self._asks: collections.Counter[ProgramKey] = collections.Counter()  # how many times each was wanted
        # Called with a program's key right after warm-up compiles it, unless a call ran it meanwhile (the
        # engine's `first_run`: one run on throwaway inputs, so that requests never pay a first run's set-up):
        # for every program a background thread compiles, and for the first needed ones before ready.
        self.first_run: Callable[[ProgramKey], None] | None = None
        self.compile_seconds = 0.0  # spent in `warmup` before it returned
        self.warmup_seconds: dict[str, float] = {}  # per program name, as each is compiled

    def __getitem__(self, key: ProgramKey) -> Program:
        return self._programs[key]

    def __iter__(self) -> Iterator[ProgramKey]:
        return iter(self._programs)

    def __len__(self) -> int:
        return len(self._programs)

    def warmup(self, progress: Callable[[str, int, int], None] | None = None, background: bool = False,
               meanwhile: Callable[[], None] | None = None) -> float:
        """Compile every program (never running one: nothing is written), `COMPILE_THREADS` at a time.
        ``background``: compile the first needed now and the rest on a daemon thread (`background`); a call
        that needs one of those before it is ready waits for it. ``meanwhile``: the caller's own work, run on
        this thread once the programs are handed to the compile threads (they mostly wait on XLA, outside the
        GIL). Returns the seconds spent here."""
        begin = time.perf_counter()
        keys = list(self._programs)
        now = [k for k in keys if self._first_needed(k)] if background else keys
        later = sorted((k for k in keys if k not in now), key=self._order)
        if progress and now:
            progress(self._programs[now[0]].name, 0, len(now))
        with ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="slotserve-compile") as pool:
            # Compiled before ready with no background thread (every program), only the first needed also
            # run once now: a batch run pays each of the others' set-up once, only if it uses the program.
            pending = [pool.submit(self._compile, key, self._first_needed(key)) for key in now]
            if meanwhile:
                meanwhile()
            for done, future in enumerate(as_completed(pending)):
                name = future.result()
                if progress:
                    progress(name, done + 1, len(now))
        if progress:
            progress("ready", len(now), len(now))
        self.compile_seconds = time.perf_counter() - begin
        if later:
            with self._wake:  # quiet counts from ready too: a serving loop may have idled through the warm-up
                self._idle_since = time.monotonic()
            self.background = threading.Thread(target=self._compile_later, args=(later,), name="slotserve-warmup",
                                               daemon=True)
            self.background.start()
        return self.compile_seconds

    def _compile(self, key: ProgramKey, run_once: bool = True) -> str:
        program = self._programs[key]
        begin = time.perf_counter()
        program.compile(*self._example_args(key))
        self.warmup_seconds[program.name] = program.compile_seconds or 0.0
        if run_once and self.first_run is not None and program.calls == 0:
            self.first_run(key)
        log.debug("program %s loaded (and run once: %s) in %.2f s", program.name, run_once,
                  time.perf_counter() - begin)
        return program.name

    def serving(self, busy: bool) -> None:
        """The caller has work (True) or waits for it (False). While it has work, a background warm-up loads
        only the programs its steps keep asking for (`want`), so that loading does not slow the steps it runs
        meanwhile."""
        with self._wake:
            if not busy:  # quiet counts from here (also from a serving loop's start)
                self._idle_since = time.monotonic()
            self._serving, self._loop_started = busy, True
            self._wake.notify_all()

    def _quiet_for(self) -> float:
        """Seconds until the caller has been idle for `QUIET_S` (0: it has); call holding ``_wake``."""
        return 1.0 if self._serving else max(0.0, self._idle_since + QUIET_S - time.monotonic())

    def wait_quiet(self) -> bool:
        """Block until a serving loop has started and served nothing for `QUIET_S` seconds, when other
        start-up work (the grammar bridge) may take the cores: True; False if the warm-up was stopped first."""
        with self._wake:
            while not self._stop.is_set() and (not self._loop_started or (wait := self._quiet_for()) > 0):
                self._wake.wait(wait if self._loop_started and not self._serving else None)
            return not self._stop.is_set()

    def want(self, key: ProgramKey) -> None:
        """A caller would run this program now if it were ready (a speedup left out meanwhile): a background
        warm-up loads it next, once serving pauses or once `ASKS_WHILE_SERVING` steps have asked for it."""
        if key in self._programs and not self._programs[key].ready:
            with self._wake:
                self._asks[key] += 1
                if key not in self._wanted:
                    self._wanted.append(key)
                self._wake.notify_all()

    def _next_later(self, keys: list[ProgramKey]) -> ProgramKey | None:
        """The background warm-up's next program: a wanted one (while serving, one asked for often enough),
        else the next of ``keys`` (in order) once the caller has been idle `QUIET_S`; None when stopped or
        done. Blocks meanwhile."""
        with self._wake:
            while not self._stop.is_set():
                self._wanted = [key for key in self._wanted if not self._programs[key].ready]
                due = [key for key in self._wanted
                       if not self._serving or self._asks[key] >= ASKS_WHILE_SERVING]
                if due:
                    self._wanted.remove(due[0])
                    return due[0]
                while keys and self._programs[keys[0]].ready:  # compiled meanwhile by a call needing it
                    keys.pop(0)
                if not keys:
                    return None
                wait = self._quiet_for()
                if wait == 0:
                    return keys.pop(0)
                self._wake.wait(None if self._serving else wait)
            return None

    def _compile_later(self, keys: list[ProgramKey]) -> None:
        begin, left = time.perf_counter(), list(keys)
        try:
            while (key := self._next_later(left)) is not None:
                self._compile(key)
        except Exception:  # a call needing the program compiles it itself (and reports what fails)
            log.exception("background compilation stopped")
            return
        if self._stop.is_set():
            log.info("background compilation stopped with %d programs left", sum(not p.ready for p in self.values()))
        else:
            log.info("compiled %d more programs in the background in %.1f s", len(keys),
                     time.perf_counter() - begin)

    def stop_background(self, timeout: float) -> bool:
        """Let a background warm-up finish the program it is compiling and start no other; wait up to
        ``timeout`` seconds for it. A daemon thread still inside XLA's compiler when the interpreter exits
        aborts the process, so whoever stops the engine calls this. Returns whether no warm-up is left."""
        with self._wake:
            self._stop.set()
            self._wake.notify_all()
        if self.background is not None:
            self.background.join(timeout)
            return not self.background.is_alive()
        return True

    def programs_run(self) -> int:
        """How many programs have run at least once. A program's first run on XLA:CPU carries one-time set-up
        (the default model's first decode step after warm-up took 3.3 s against 40 ms after, its first batched
        verify 0.37 s against 60 ms), so a caller timing steps can tell a first run by this count moving."""
        return sum(p.calls > 0 for p in self._programs.values())

    def counts(self) -> dict[str, int]:
        """How many programs exist, are compiled, came from the XLA compilation cache and had their exported
        module read back from the program store (one pass, so the counts agree with each other while a
        background warm-up runs)."""
        ready = [p for p in self._programs.values() if p.ready]  # a ready program's from_* flags are final
        return {"total": len(self._programs), "compiled": len(ready),
                "from_compile_cache": sum(p.from_cache for p in ready),
                "from_program_store": sum(p.from_store for p in ready)}
