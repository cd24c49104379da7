"""The serving runtime: the model, the engine's compiled steps, the grammar compiler and the scheduler.

`build_runtime(options)` loads a model, compiles the engine's steps, warms the grammar compiler and builds the
`Scheduler`: everything that touches JAX is created here (the server never imports it). `assemble_runtime`
does the same from an engine and tokenizer you built yourself (tests, embedding).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.chat_template import DEFAULT_BUILTIN, ChatTemplate
from core.engine import ROWS_VERIFY_WIDTH, EngineConfig
from scheduler.grammar import COMPILE_TIMEOUT_S, DEFAULT_BACKEND, MAX_SCHEMA_BYTES, GrammarCompiler
from scheduler.scheduler import SchedulerConfig

log = logging.getLogger(__name__)

__all__ = ["Progress", "Runtime", "RuntimeOptions", "assemble_runtime", "build_runtime", "grammar_compiler"]

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
    int4_ple: bool = False  # Gemma 4's per-layer-embedding table as packed int4
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
    # Several streams verify their drafts in one batched pass (EngineConfig.rows_verify_width; W8A8 +
    # int8 KV only). Its rows equal decode rows bit for bit on every host class the suite has passed on,
    # checked at the logits by tests/test_batched_verify.py wherever `make test` runs (docs/design-notes.md).
    batched_speculation: bool = True
    # A decode step carries one short prompt chunk (a chat turn's new tokens) of another slot in the same pass
    # (EngineConfig.chunk_in_decode; W8A8 + int8 KV only, exact as the batched verify is).
    chunk_in_decode: bool = True
    carry_sizes: tuple[int, ...] = EngineConfig.carry_sizes  # the widths a carried chunk is padded to
    # Sample inside the decode program and queue the next decode step before the previous one's tokens are
    # read (EngineConfig.fused_sampling + SchedulerConfig.overlap_steps); None: chosen per device
    # (core.device.choose_overlap: on for GPU / TPU, off on CPU).
    overlap_steps: bool | None = None
    host_tier_bytes: int = SchedulerConfig.host_tier_bytes
    # The disk tier's directory: None for the default (`disk_tier_dir`), "off" for none.
    disk_tier_dir: str | None = None
    disk_tier_bytes: int = SchedulerConfig.disk_tier_bytes
    disk_tier_flush_s: float = SchedulerConfig.disk_tier_flush_s
    # LoRA adapter slots compiled into every step (0: no adapter path) and the largest rank they hold.
    adapter_slots: int = EngineConfig.adapter_slots
    adapter_rank: int = EngineConfig.adapter_rank
    adapter_dtype: str | None = EngineConfig.adapter_dtype  # None: the compute dtype
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

    def adapter_reader(self) -> Callable[[Path], Any] | None:
        """Reads and checks one PEFT adapter directory against this model (`core.lora.read_adapter` at the
        engine's maximum rank); None where the engine has no adapter slots."""
        from core.lora import read_adapter

        engine = self.engine
        if not engine.config.adapter_slots:
            return None
        return lambda directory: read_adapter(directory, engine.cfg, engine.config.adapter_rank)

    def start(self) -> None:
        if not self._started:
            self.scheduler.start()
            self._started = True

    def stop(self, timeout: float = 30.0) -> None:
        """End every stream with a finish event, stop the engine thread and the background warm-up (after the
        program it is compiling), close the compiler pool."""
        if self._started:
            self.scheduler.stop(timeout)
            self._started = False
        self.engine.programs.stop_background(timeout)
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
            "adapter_slots": str(self.engine.config.adapter_slots),
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
            disk_tier_dir=disk_tier_dir(options.disk_tier_dir),
            disk_tier_bytes=options.disk_tier_bytes,
            disk_tier_flush_s=options.disk_tier_flush_s,
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


DISK_TIER_ENV = "SLOTSERVE_KV_DISK_DIR"


def disk_tier_dir(option: str | None) -> str | None:
    """The disk tier's directory for an option: "off" none; a path itself; None ``$SLOTSERVE_KV_DISK_DIR``
    ("off" or a path) if set, else ``kv`` under the cache directory (shared by every replica of this user)."""
    from core.device import default_cache_dir

    choice = option or os.environ.get(DISK_TIER_ENV)
    if choice == "off":
        return None
    return str(Path(choice).expanduser()) if choice else str(default_cache_dir() / "kv")


def grammar_compiler(tokenizer: Any, options: RuntimeOptions, vocab_size: int, *,
                     bridge_after: Callable[[], bool] | None = None) -> GrammarCompiler:
    """The grammar compiler with its tokenizer bridge (the slow part: a pass over the vocabulary) built, or,
    given ``bridge_after``, built on its own worker once that returns True."""
    compiler = GrammarCompiler(tokenizer, options.grammar_backend, compile_timeout_s=options.grammar_compile_timeout_s,
                               max_schema_bytes=options.max_schema_bytes, vocab_size=vocab_size)
    if bridge_after is None:
        compiler.warm_up()
    else:
        compiler.warm_up_in_background(bridge_after)
    return compiler


def engine_config(options: RuntimeOptions, kv_dtype: str | None, overlap: bool) -> EngineConfig:
    """The engine's configuration for these options, with the KV dtype and the overlap choice made
    (`core.device.choose_kv_dtype`, `choose_overlap`): overlapped steps need the fused sampler."""
    from core.device import choose_transfer_sizes

    return EngineConfig(num_slots=options.num_slots, max_len=options.max_len, chunk_sizes=tuple(options.chunk_sizes),
                        kv_dtype=kv_dtype, rows_verify_width=ROWS_VERIFY_WIDTH if options.batched_speculation else 0,
                        chunk_in_decode=options.chunk_in_decode, carry_sizes=tuple(options.carry_sizes),
                        fused_sampling=overlap,
                        transfer_sizes=choose_transfer_sizes(), adapter_slots=options.adapter_slots,
                        adapter_rank=options.adapter_rank, adapter_dtype=options.adapter_dtype)


def build_runtime(options: RuntimeOptions, progress: Progress | None = None) -> Runtime:
    """Load the model, compile every engine step (warm-up), warm the grammar compiler, build the scheduler."""
    from core.compile_cache import enable_compile_cache
    from core.device import choose_kv_dtype, choose_overlap, default_cache_dir
    from core.engine import Engine
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
    model = load_model(options.model, dtype=options.dtype, precision=options.precision, int4_ple=options.int4_ple,
                       progress=(lambda done, total: progress("load the model", done, total, str(options.model)))
                       if progress else None, weights_cache=weights_cache)
    if progress and model.weights_from_cache:
        progress("load the model", detail=f"{options.model}, prepared weights from {weights_cache}")
    kv_dtype, kv_reason = choose_kv_dtype(options.kv_dtype, model.precision)
    overlap, overlap_reason = choose_overlap(options.overlap_steps)
    engine = Engine(model.cfg, model.params, engine_config(options, kv_dtype, overlap), model.dtype, program_store)
    engine.weights_identity = model.weights_identity
    if progress:
        progress("allocate the KV pool", detail=(
            f"{engine.num_slots} slots x {engine.max_len} positions ({engine.spec.dtype}: {kv_reason}), "
            f"{engine.bytes_per_slot / 2**20:.1f} MiB per slot, "
            f"{engine.bytes_per_slot * engine.num_slots / 2**20:.1f} MiB in all; compute {model.dtype} "
            f"({model.dtype_reason}); precision {model.precision} ({model.precision_reason}); "
            f"overlapped decode steps {'on' if overlap else 'off'} ({overlap_reason})"))
    def compiling(name: str, done: int, total: int) -> None:
        detail = f"{total} programs; the tokenizer loaded meanwhile" if done == total else name
        progress("compile the step programs", done, total, detail)

    # The tokenizer loads while the compile threads wait on XLA, which runs outside the GIL.
    engine.warmup(compiling if progress else None, background=options.background_compile,
                  meanwhile=lambda: model.tokenizer, first_runs=True)
    # The grammar tokenizer bridge is seconds of work holding the GIL: with a background warm-up it is built
    # after ready once nothing has been served for a while, like the programs nobody asked for (a constrained
    # request meanwhile builds it or waits for it).
    if progress and not options.background_compile:
        progress("build the grammar tokenizer bridge")
    compiler = grammar_compiler(model.tokenizer, options, model.cfg.vocab_size,
                                bridge_after=engine.wait_quiet if options.background_compile else None)
    return assemble_runtime(engine, model.tokenizer, options, compiler=compiler, model_name=str(options.model),
                            dtype_reason=model.dtype_reason, precision=model.precision,
                            precision_reason=model.precision_reason, kv_dtype_reason=kv_reason,
                            load_seconds=model.load_seconds, weights_from_cache=model.weights_from_cache,
                            progress=progress)
