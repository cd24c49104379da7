"""The slot engine: one resident model, S KV slots, a fixed set of compiled steps.

Verbs the scheduler reads aloud: `prefill` a slot from position P (continuing what it holds),
`decode` one token for every slot at once, `sample` the next tokens, `save_slot` / `restore_slot`
to and from host memory, `copy_prefix` from slot to slot on the device. Every step donates the
cache, and every shape is compiled in `warmup()` (`core.programs`), never per request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from core.config import ModelConfig
from core.kv_cache import CacheSpec, cache_bytes_per_slot, init_cache
from core.lora import LoraAdapter, adapted_groups, attach_slots, with_adapter
from core.model import decode_step, decode_with_chunk, prefill_chunk, slot_batched_lora_form, verify_chunk
from core.program_store import ProgramStore, environment_fingerprint
from core.programs import Program, ProgramKey, ProgramTable, abstract
from core.sampling import (
    MAX_LOGPROBS,
    SamplerState,
    SamplingParams,
    SlotRequest,
    draw_tokens,
    init_state,
    sample,
    set_slots,
)
from core.weights import all_matmuls_integer

log = logging.getLogger(__name__)
# Programs that only speed up what other programs also do (a verify step is a few decode steps, a batched
# prefill several single ones): a background warm-up compiles them after reporting ready.
OPTIONAL_KINDS = ("verify", "verify_rows", "prefill_rows", "decode_sample", "decode_sample_full", "decode_chunk")
# The width of a batched verify pass when one is asked for: the last token plus two drafts per slot.
ROWS_VERIFY_WIDTH = 3
NO_ADAPTER = -1  # a KV slot whose rows get no LoRA terms
ADAPTER_DTYPES = (None, "float32", "bfloat16")  # EngineConfig.adapter_dtype (None: the compute dtype)
FOLLOWING = -1  # a decode input token meaning "the token the previous step sampled for this slot"
PACKED_WIDTH = 2 + 2 * MAX_LOGPROBS  # a sampler program's packed result per row (`_packed_sample`)


@dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 8
    max_len: int = 8192
    chunk_sizes: tuple[int, ...] = (32, 128, 512)
    kv_dtype: str | None = None  # None: the compute dtype; "int8": quantized with per-position scales
    # Programs by how far the global layers attend: each attends over cache positions [0, bucket), the
    # smallest bucket that covers every position the call reads (decode, verify and prefill alike; slot ranges
    # also move to the host and between slots in these sizes). None: powers of two from 1024 up to max_len;
    # (): one program over max_len.
    attention_buckets: tuple[int, ...] | None = None
    # Speculative verification width for a lone greedy stream: the last token plus up to width-1 drafted ones,
    # checked in one pass over one slot. None: num_slots (the token rows of one decode step, so a verify
    # costs about one step); 0: no verify program.
    verify_width: int | None = None
    # Batched speculative verification: every slot checks its last token plus up to width-1 drafted ones in one
    # pass ([num_slots, width] rows; ROWS_VERIFY_WIDTH when asked for). Its rows must equal decode steps bit
    # for bit, which needs every product exact whatever the row count (`Engine.rows_verify_exact`: W8A8
    # weights and int8 KV) and XLA's float kernels computing a row alike in both shapes, which holds on some
    # CPUs and not on others (docs/design-notes.md), so it is opt-in. 0 or 1: no program.
    rows_verify_width: int = 0
    # A decode step may carry one prompt chunk for a slot that is not decoding (a chat turn's new tokens after a
    # prefix-cache hit): the weight products take both at once, so the chunk costs its extra rows instead of a
    # call that reads every weight again. Like the batched verify, it needs every product exact whatever the
    # row count (`Engine.rows_exact`); elsewhere there is no such program.
    chunk_in_decode: bool = False
    # The widths a carried chunk is padded to (the smallest covering it), one program per width and bucket.
    # Padded rows cost full compute: on the default model (Zen 5, 7 rows at the 2,048 bucket) carrying 32 rows
    # adds 25 ms to a 28 ms decode step and 64 rows 44 ms (benchmarks/carry_cost.py), so a 33-64-token chat turn
    # rides in one 64-row carry instead of two 32-row ones (51 ms), and a turn of up to 32 tokens pays for 32.
    carry_sizes: tuple[int, ...] = (32, 64)
    # Decode and sample in one program for steps with no constrained row: one dispatch instead of two, the
    # logits never leave the device (the step a device-side token feedback would build on). Off: on an H200
    # the sampler dispatched right after the decode already overlaps it (two calls 5.42 ms vs fused 5.77 ms per
    # E2B step, benchmarks/results/engine-gpu-gemma4-e2b-fused.json), and on CPU each attention bucket would
    # add two programs to compile at every start for a saving lost in a ~100 ms step.
    fused_sampling: bool = False
    # Slot ranges move to and from the host (saves, restores) in the smallest size covering them: these, where
    # below the smallest attention bucket, then the buckets. Each size adds a read and a write program. (): the
    # buckets only (on CPU a host copy is a memcpy; off a TPU v5e a 1,024-position save of the 270M's slot
    # moved ~19 MB for a 150-token chat and took ~16 ms).
    transfer_sizes: tuple[int, ...] = ()
    # LoRA adapter slots compiled into every model step (docs/lora.md): each KV slot's rows use one of them or
    # none, and loading an adapter writes into a slot (no program changes). 0: no adapter path at all.
    adapter_slots: int = 0
    adapter_rank: int = 16  # every slot holds an adapter of up to this rank (smaller ones are zero-padded)
    # What the slots store and multiply in: None, the compute dtype; "bfloat16", half the bytes a step under
    # many adapters must read, the adapter products' inputs rounded to bfloat16 (accumulated in float32).
    adapter_dtype: str | None = None
    # A decode step whose rows use more adapter slots than this computes every slot's products at once (where the
    # host rounds that as the per-slot products, `core.model.lora_delta`): on the default model (Zen 4) per-slot
    # products cost ~5-8 ms for one slot in use and ~30 ms for eight, the wide form ~11 ms (float32, not exact
    # there) or ~7-8 ms (bfloat16 slots) whatever the mix (docs/lora.md).
    slot_batched_lora_over: int = 1

    def __post_init__(self) -> None:
        if self.num_slots < 1 or self.max_len < 1:
            raise ValueError("num_slots and max_len must be positive")
        if self.adapter_slots < 0 or self.adapter_rank < 1:
            raise ValueError("adapter_slots must be >= 0 and adapter_rank positive")
        if self.adapter_dtype not in ADAPTER_DTYPES:
            raise ValueError(f"adapter_dtype must be one of {ADAPTER_DTYPES}, not {self.adapter_dtype!r}")
        for name in ("chunk_sizes", "carry_sizes"):
            sizes = getattr(self, name)
            if not sizes or sorted(set(sizes)) != list(sizes) or sizes[0] < 1:
                raise ValueError(f"{name} must be a non-empty strictly increasing tuple of positive sizes")
        buckets = self.attention_buckets
        if buckets and (sorted(set(buckets)) != list(buckets) or buckets[0] < 1 or buckets[-1] > self.max_len):
            raise ValueError("attention_buckets must be strictly increasing lengths within max_len")

    @property
    def verify_tokens(self) -> int:
        return self.num_slots if self.verify_width is None else self.verify_width

    def bucket_lengths(self) -> tuple[int, ...]:
        """The attention lengths programs are compiled for (prefill, decode, verify, slot copies alike),
        ending with max_len."""
        if self.attention_buckets is None:
            sizes, size = [], 1024
            while size < self.max_len:
                sizes.append(size)
                size *= 2
        else:
            sizes = [b for b in self.attention_buckets if b < self.max_len]
        return (*sizes, self.max_len)


@dataclass
class SampleResult:
    """Host copies of one sampling step: tokens [R] (-1 where a mask allowed nothing), their logprobs [R],
    and the MAX_LOGPROBS most likely tokens [R, MAX_LOGPROBS] with logprobs (callers slice what they asked)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    @classmethod
    def unpack(cls, packed: jax.Array) -> SampleResult:
        """From a sampler program's one output [R, PACKED_WIDTH] int32 (`_packed_sample`): one host copy."""
        host = np.asarray(packed)
        top = 2 + MAX_LOGPROBS
        return cls(host[:, 0], host[:, 1].view(np.float32), host[:, 2:top], host[:, top:].view(np.float32))


class PendingSample:
    """A dispatched decode + sample step: its packed results [S, PACKED_WIDTH] stay on the device (a later
    step may read its tokens there) while their copy to the host runs; `result()` waits for them."""

    def __init__(self, packed: jax.Array) -> None:
        self.packed = packed
        packed.copy_to_host_async()
        self._result: SampleResult | None = None

    def result(self) -> SampleResult:
        if self._result is None:
            self._result = SampleResult.unpack(self.packed)
        return self._result


Layers = dict[str, dict[str, np.ndarray]]  # cache key -> array name -> [positions, ...]


class SlotSnapshot:
    """Host copy of a slot's KV for positions [start, end) in every owning layer: written on top of a slot that
    holds positions 0..start-1, it lets that slot continue at any position up to `end`.

    Either its arrays, or ``pending``: what makes them once the copy off the device lands (`Engine.save_slot`
    with wait=False); the first thread reading `layers` runs it (the disk tier's writer, say, instead of the
    engine thread), and later readers get the same arrays."""

    def __init__(self, start: int, end: int, layers: Layers | None = None, *,
                 pending: Callable[[], Layers] | None = None, position_bytes: int | None = None) -> None:
        """``position_bytes``: the bytes one position takes in all arrays together, given with ``pending`` so
        that `nbytes` is known before the arrays are made (without it, asking makes them)."""
        if (layers is None) == (pending is None):
            raise ValueError("a snapshot needs either its arrays or what makes them")
        self.start, self.end = start, end
        self._layers, self._pending = layers, pending
        self._position_bytes = position_bytes
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        """Whether its arrays are made (reading `layers` then waits for nothing)."""
        return self._layers is not None

    @property
    def layers(self) -> Layers:
        """[end - start, ...] per array of every owning layer."""
        if self._layers is None:
            with self._lock:
                if self._layers is None:
                    self._layers, self._pending = self._pending(), None
        return self._layers

    @property
    def nbytes(self) -> int:
        """The bytes of its arrays (known without making them)."""
        return (self.end - self.start) * self.position_bytes

    @property
    def position_bytes(self) -> int:
        if self._position_bytes is None:
            total = sum(a.nbytes for entry in self.layers.values() for a in entry.values())
            self._position_bytes = total // max(self.end - self.start, 1)
        return self._position_bytes

    def suffix(self, start: int) -> SlotSnapshot:
        """Positions [start, end) of this snapshot (views, not copies)."""
        if not self.start <= start <= self.end:
            raise ValueError(f"position {start} is outside [{self.start}, {self.end}]")
        cut = start - self.start
        return SlotSnapshot(start, self.end, {k: {n: a[cut:] for n, a in e.items()} for k, e in self.layers.items()})


class Engine:
    def __init__(self, cfg: ModelConfig, params: dict[str, Any], config: EngineConfig, dtype: str,
                 program_store: ProgramStore | None = None) -> None:
        """``program_store``: where exported programs are read back from and kept (`core.program_store`)."""
        self.cfg = cfg
        self.program_store = program_store
        if config.adapter_slots:
            params = attach_slots(params, [None] * config.adapter_slots, cfg, config.adapter_rank,
                                  every_projection=True, dtype=config.adapter_dtype)
        self.params = params
        self.config = config
        self.dtype = dtype
        self.spec = CacheSpec(config.num_slots, config.max_len, config.kv_dtype or dtype)
        # LoRA adapter products are float, but each slot's are one `slot_terms` over the call's rows, whose bits
        # do not depend on the row count (`core.model.lora_delta`; tests/test_batched_verify.py checks it).
        self.rows_exact = self.spec.quantized and all_matmuls_integer(params)
        self.rows_verify_exact = config.rows_verify_width > 1 and self.rows_exact
        self.chunk_in_decode = config.chunk_in_decode and self.rows_exact
        self.carry_sizes = config.carry_sizes if self.chunk_in_decode else ()
        # A decode step of rows under many adapters batches their products over the slots, where that rounds as
        # the per-slot pairs do on this host (`core.model.lora_delta`); the probe runs once per process and shapes.
        form = slot_batched_lora_form(
            tuple(sorted(set(adapted_groups(cfg).values()))), config.num_slots, config.adapter_slots,
            config.adapter_rank, str(self.adapter_dtype)) if config.adapter_slots else None
        self.slot_batched_lora = (form, config.slot_batched_lora_over) if form else None
        self.slot_adapters = np.full(config.num_slots, NO_ADAPTER, np.int32)  # each KV slot's adapter slot
        self.loaded_adapters: list[str | None] = [None] * config.adapter_slots  # each adapter slot's fingerprint
        self.cache = init_cache(cfg, self.spec)
        self.weights_identity: str | None = None  # set by a loader that knows the checkpoint (kv_identity)
        self._kv_identity: str | None = None
        self.buckets = config.bucket_lengths()
        self.transfer_lengths = (*sorted({n for n in config.transfer_sizes if 0 < n < self.buckets[0]}), *self.buckets)
        self.fused_sampling = config.fused_sampling
        # Decode and both verify steps read the sliding layers through one view length, so their rows
        # compute alike bit for bit (core.kv_cache.sliding_view_length).
        model = {"cfg": cfg, "view_width": max(config.verify_tokens, config.rows_verify_width, 1)}
        # Committed to the device, as every program's outputs are: a plain jit (the sampling-parameter install)
        # compiles once per committed-ness of its arguments, so a state that starts uncommitted and turns
        # committed after the first step would compile that install again during the first requests.
        self.sampler: SamplerState = jax.device_put(
            init_state(config.num_slots, cfg.vocab_size, history=config.max_len), jax.devices()[0])
        self.programs = ProgramTable(self._build_programs(model), self._example_args, self._first_needed,
                                     self._background_order)
        # A KV cache that the first runs before ready pass on to each other (`first_run`); None after ready,
        # when a background first run makes its own for as long as it runs (a whole cache's memory).
        self._scratch_cache: Any = None
        self._no_previous: jax.Array | None = None  # see _no_previous_step
        self._keep_scratch = False
        self._scratch_lock = threading.Lock()

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    @property
    def max_len(self) -> int:
        return self.config.max_len

    @property
    def bytes_per_slot(self) -> int:
        return cache_bytes_per_slot(self.cfg, self.spec)

    def kv_identity(self) -> str:
        """What a slot's KV depends on besides its tokens and adapter: the model's config and weights, the
        compute dtype, the KV layout and dtype, and the `core` sources and versions that compute it. KV kept
        beyond this process (the disk tier) is reused only under an equal identity. The weights are named by
        ``weights_identity`` where the loader set one (the checkpoint's hash and the precision), else hashed."""
        if self._kv_identity is None:
            weights = self.weights_identity or _params_digest(self.params)
            text = json.dumps({"model": repr(self.cfg), "weights": weights, "dtype": self.dtype,
                               "adapters": str(self.adapter_dtype), "kv": [self.spec.dtype, self.spec.max_len],
                               "env": environment_fingerprint()})
            self._kv_identity = hashlib.sha256(text.encode()).hexdigest()
        return self._kv_identity

    # ---- LoRA adapter slots ------------------------------------------------------------------------------
    def load_adapter(self, index: int, adapter: LoraAdapter | None) -> None:
        """Write ``adapter`` (None: zeros) into adapter slot ``index``. The programs are unchanged; a KV slot
        whose rows use this adapter slot must not be mid-request (the caller's to ensure)."""
        if not 0 <= index < self.config.adapter_slots:
            raise ValueError(f"adapter slot {index} out of range (this engine has {self.config.adapter_slots})")
        if adapter is not None and adapter.rank > self.config.adapter_rank:
            raise ValueError(f"adapter rank {adapter.rank} is over the engine's {self.config.adapter_rank}")
        self.params = with_adapter(self.params, index, adapter)
        self.loaded_adapters[index] = None if adapter is None else adapter.fingerprint

    def use_adapter(self, slot: int, index: int) -> None:
        """The adapter slot whose terms KV slot ``slot``'s rows get from now on (NO_ADAPTER: none)."""
        if not (index == NO_ADAPTER or 0 <= index < self.config.adapter_slots):
            raise ValueError(f"adapter slot {index} out of range (this engine has {self.config.adapter_slots})")
        self.slot_adapters[slot] = index

    @property
    def adapter_dtype(self) -> Any:
        """The dtype the adapter slots store and multiply in (None without slots)."""
        layers = [lp["lora"] for lp in self.params["layers"] if lp.get("lora")]
        return next(iter(layers[0].values()))[0].dtype if layers else None

    @property
    def adapter_bytes_per_slot(self) -> int:
        """Device bytes one adapter slot takes (every projection at the maximum rank)."""
        if not self.config.adapter_slots:
            return 0
        arrays = jax.tree_util.tree_leaves([lp.get("lora", {}) for lp in self.params["layers"]])
        return sum(a.nbytes for a in arrays) // self.config.adapter_slots

    # ---- programs --------------------------------------------------------------------------
    def _build_programs(self, model: dict[str, Any]) -> dict[ProgramKey, Program]:
        """Every compiled step, keyed by kind and the sizes that fix its shapes; `model` holds the cfg and
        view_width every model step is called with."""
        def jit(name: str, fn: Callable[..., Any], donate: int | tuple[int, ...] | None = 1, **static: Any
                ) -> Program:
            donated = () if donate is None else donate if isinstance(donate, tuple) else (donate,)
            identity = f"{fn.__module__}.{fn.__qualname__}{sorted(static.items())!r}{donated}"
            return Program(name, jax.jit(partial(fn, **static), donate_argnums=donated), donated, identity,
                           self.program_store)

        rows, width, verify = self.num_slots, self.config.rows_verify_width, self.config.verify_tokens
        decode = {**model, "slot_batched_lora": self.slot_batched_lora}
        table: dict[ProgramKey, Program] = {}
        for attend in self.buckets:
            # Prefill attends over the bucket covering the slot's positions once its chunk is written, so a
            # chunk near the start of a slot does not pay for attention over max_len masked positions.
            for size in self.config.chunk_sizes:
                table["prefill", size, attend] = jit(f"prefill chunk {size} (attends {attend})", _prefill_step,
                                                     attend=attend, **model)
            table["decode", attend] = jit(f"decode step (attends {attend})", _decode_step, attend=attend, **decode)
            for width in self.carry_sizes:
                table["decode_chunk", width, attend] = jit(
                    f"decode step + prefill chunk {width} (attends {attend})", _decode_chunk_step,
                    attend=attend, **decode)
            if self.fused_sampling:
                for kind, needs_full in (("decode_sample", False), ("decode_sample_full", True)):
                    table[kind, attend] = jit(f"decode + sampler{' full' if needs_full else ''} (attends {attend})",
                                              _decode_sample_step, (1, 4), attend=attend, needs_full=needs_full,
                                              **decode)
            table["prefill_rows", attend] = jit(f"batched prefill {rows} x {self.row_chunk} (attends {attend})",
                                                _prefill_rows_step, attend=attend, **model)
            if verify > 1:
                table["verify", attend] = jit(f"speculative verify (attends {attend})", _verify_step,
                                              attend=attend, **model)
            if self.rows_verify_exact:
                table["verify_rows", attend] = jit(f"batched speculative verify {rows} x {width} (attends {attend})",
                                                   _verify_rows_step, attend=attend, **model)
            # Slot ranges move between slots in bucket-sized pieces (static shapes).
            table["copy", attend] = jit(f"slot copy ({attend} positions)", _copy_prefix, 0, size=attend)
        for size in self.transfer_lengths:  # and to and from the host in these
            table["read", size] = jit(f"slot save ({size} positions)", _read_range, None, size=size)
            table["write", size] = jit(f"slot restore ({size} positions)", _write_range, 0)
        # Top logprobs are always computed at the maximum width (a blocked top-20 costs ~1% of a decode
        # step) so that a request's `top_logprobs` never selects another compiled program.
        for needs_full in (False, True):
            for masked in (False, True):
                table["sample", needs_full, masked] = jit(
                    f"sampler{' full' if needs_full else ''}{' masked' if masked else ''}", _sample_step,
                    needs_full=needs_full)
        for masked in (False, True):
            table["sample_row", masked] = jit(f"first-token sampler{' masked' if masked else ''}", _sample_row)
        return table

    def _example_args(self, key: ProgramKey) -> tuple[Any, ...]:
        """The abstract arguments program `key` is compiled for: the shapes its call site passes."""
        def i32(*shape: int) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, jnp.int32)

        params, cache, sampler = abstract(self.params), abstract(self.cache), abstract(self.sampler)
        rows, words = self.num_slots, -(-self.cfg.vocab_size // 32)
        logits = jax.ShapeDtypeStruct((rows, self.cfg.vocab_size), jnp.float32)
        kind = key[0]
        if kind == "prefill":
            return params, cache, i32(1, key[1]), i32(4)
        if kind == "prefill_rows":
            return params, cache, i32(rows, self.row_chunk), i32(3, rows)
        if kind == "decode":
            return params, cache, i32(4, rows)
        if kind == "decode_chunk":
            return params, cache, i32(4, rows), i32(1, key[1]), i32(4)
        if kind in ("decode_sample", "decode_sample_full"):
            return params, cache, i32(4, rows), i32(rows, PACKED_WIDTH), sampler, i32(rows), i32(rows)
        if kind == "verify":
            return params, cache, i32(1, self.config.verify_tokens), i32(5), sampler
        if kind == "verify_rows":
            return params, cache, i32(rows, self.config.rows_verify_width), i32(4, rows), sampler
        if kind == "read":
            return cache, i32(), i32()
        if kind == "write":
            values = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((key[1], *a.shape[2:]), a.dtype), cache)
            return cache, jax.eval_shape(partial(_pack_positions, xp=jnp), values), i32(4)
        if kind == "copy":
            return cache, i32(3)
        mask = jax.ShapeDtypeStruct((rows if kind == "sample" else 1, words), jnp.uint32) if key[-1] else None
        if kind == "sample":
            return logits, sampler, mask, i32(rows), jax.ShapeDtypeStruct((rows,), jnp.bool_), i32(rows)
        return jax.ShapeDtypeStruct((self.cfg.vocab_size,), jnp.float32), sampler, i32(), i32(), mask, i32()

    def _first_needed(self, key: ProgramKey) -> bool:
        """Whether a background warm-up compiles this program before reporting ready: what short first
        requests run (every sampler, the smallest prefill chunk, the decode step over the smallest bucket, and
        there the batched prefill and both verify steps that several of them arriving together use: a
        restarted server's first wave of streams runs at full speed, its slowest stream, which ends alone,
        included), and the slot copy (a stream whose prompt prefix another slot holds copies it: left to load
        on demand, it loaded during every restart's first wave). The masked samplers (~0.2 s each) load before
        ready too: loaded right after it, they shared a 2-core host with the first wave (first / loaded wave
        0.86x-0.99x over three restarts on the AMX Xeon, 0.93x-0.99x with them before ready, ready no later).
        The rest follow on the background thread, the smallest bucket first; a request needing one of them
        waits for it, and the other speedups (larger buckets) are left out until theirs are compiled."""
        first = self.buckets[0]
        if key[0] in ("sample", "sample_row"):
            return True
        return key in {("decode", first), ("prefill_rows", first), ("verify_rows", first), ("verify", first),
                       ("prefill", self.config.chunk_sizes[0], first), ("copy", first)}

    def _background_order(self, key: ProgramKey) -> tuple[int, bool]:
        """Smallest bucket first; within a bucket what every request may need before the speedups."""
        return key[-1], key[0] in OPTIONAL_KINDS

    def warmup(self, progress: Callable[[str, int, int], None] | None = None, background: bool = False,
               meanwhile: Callable[[], None] | None = None, first_runs: bool = False) -> float:
        """Compile every step ahead (`ProgramTable.warmup`); with ``first_runs``, each program also runs once
        right after it is compiled (`first_run`), before ready or on the background thread, and so does the
        install of a request's sampling parameters. CPU only: the set-up is XLA:CPU's, and on an accelerator
        a scratch KV cache would take a second cache's memory. The sampling-parameter install is compiled and
        run either way. Seconds spent before returning."""
        first_runs = first_runs and jax.default_backend() == "cpu"
        self.programs.first_run = self.first_run if first_runs else None
        self._keep_scratch = True
        try:
            seconds = self.programs.warmup(progress, background, meanwhile)
        finally:
            with self._scratch_lock:
                self._keep_scratch, self._scratch_cache = False, None
        # The install of sampling parameters has two shapes (one admission, or several): both are compiled
        # and run once now, so that no request compiles one (on an accelerator too).
        begin = time.perf_counter()
        zeros = jax.device_put(jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), abstract(self.sampler)),
                               jax.devices()[0])  # committed, like the live state (see `__init__`)
        for n in (1, self.num_slots):
            jax.block_until_ready(set_slots(zeros, [SlotRequest(s, SamplingParams(), [], 0) for s in range(n)]))
        return seconds + time.perf_counter() - begin

    def first_run(self, key: ProgramKey) -> None:
        """Run program ``key`` once on throwaway inputs: zeros everywhere (a scratch KV cache and sampler
        state of their own, which the program may donate) but the parameters, which are read, never donated.
        A program's first run on XLA:CPU carries one-time set-up (~0.4 s per program of the default model,
        more for a large prefill chunk) that a request would otherwise wait for. It touches no live buffer,
        so it may run on the warm-up thread while the engine serves."""
        params, cache_shapes = jax.tree_util.tree_structure(self.params), abstract(self.cache)
        with self._scratch_lock:  # one thread's at a time; another first run meanwhile makes its own
            scratch, self._scratch_cache = self._scratch_cache, None

        def stand_in(arg: Any) -> Any:
            if arg is None:
                return None
            if jax.tree_util.tree_structure(arg) == params:
                return self.params
            if scratch is not None and arg == cache_shapes:
                return scratch
            return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), arg)

        outputs = jax.block_until_ready(self.programs[key](*map(stand_in, self._example_args(key))))
        # Before ready, keep a KV cache for the next first run, so that each does not allocate (and fault in)
        # its own: the one a program returned (its donated scratch), else the scratch it read.
        kept = [out for out in (outputs if isinstance(outputs, tuple) else (outputs,))
                if jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(cache_shapes)
                and abstract(out) == cache_shapes]
        if not kept and scratch is not None and not any(a.is_deleted() for a in jax.tree_util.tree_leaves(scratch)):
            kept = [scratch]
        with self._scratch_lock:
            self._scratch_cache = kept[0] if kept and self._keep_scratch else None

    @property
    def compile_seconds(self) -> float:
        return self.programs.compile_seconds

    def serving(self, busy: bool) -> None:
        """The caller runs steps (True) or waits for work (False): a background warm-up loads only the
        programs a step asked for while it runs steps (`ProgramTable.serving`)."""
        self.programs.serving(busy)

    def wait_quiet(self) -> bool:
        """Block until no step has run for a while (`ProgramTable.wait_quiet`): when start-up work that
        competes with steps for the cores may run. False: the engine is stopping."""
        return self.programs.wait_quiet()

    def compiled_for(self, kind: str, positions: list[int] | np.ndarray, width: int | None = None) -> bool:
        """Whether the ``kind`` program (one of OPTIONAL_KINDS; of this chunk width where the kind has several)
        covering these positions is compiled, so a scheduler can leave a speedup out rather than wait for it; if
        not, a background warm-up loads it next."""
        key = (kind, *(() if width is None else (width,)), self.bucket_for(np.asarray(positions)))
        program = self.programs.get(key)
        if program is not None and not program.ready:
            self.programs.want(key)
        return program is not None and program.ready

    # ---- prefill / decode --------------------------------------------------------------------
    def plan_chunks(self, n: int) -> list[int]:
        """Chunk sizes covering n tokens: the largest size that fits, then the smallest that covers the rest."""
        sizes = self.config.chunk_sizes
        plan = []
        while n > 0:
            fitting = [s for s in sizes if s <= n]
            size = fitting[-1] if fitting else next(s for s in sizes if s >= n)
            plan.append(size)
            n -= min(size, n)
        return plan

    def prefill(self, slot: int, tokens: list[int] | np.ndarray, start: int) -> jax.Array:
        """Write tokens at positions start.. into a slot that holds 0..start-1; logits [V] of the last one."""
        tokens = np.asarray(tokens, np.int32)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range")
        if len(tokens) == 0:
            raise ValueError("prefill needs at least one token")
        self._check_positions(start, len(tokens))
        logits = None
        offset = 0
        for size in self.plan_chunks(len(tokens)):
            piece = tokens[offset:offset + size]
            logits = self._prefill_chunk(slot, piece, start + offset, size)
            offset += len(piece)
        return logits

    def prefill_chunk(self, slot: int, tokens: np.ndarray, start: int) -> jax.Array:
        """One compiled chunk (len(tokens) <= the largest chunk size); the scheduler's unit of prefill work."""
        size = next(s for s in self.config.chunk_sizes if s >= len(tokens))
        return self._prefill_chunk(slot, np.asarray(tokens, np.int32), start, size)

    def _prefill_chunk(self, slot: int, tokens: np.ndarray, start: int, size: int,
                       attend: int | None = None) -> jax.Array:
        n = len(tokens)
        ints = self._one_slot(start, n, slot)
        attend = attend or self.bucket_for(np.array([start + n - 1]))
        logits, self.cache = self.programs["prefill", size, attend](self.params, self.cache, _one_row(tokens, size),
                                                                    ints)
        return logits

    @property
    def row_chunk(self) -> int:
        """Tokens per slot in the batched prefill (the smallest chunk size)."""
        return self.config.chunk_sizes[0]

    def prefill_rows(self, pieces: list[tuple[int, np.ndarray, int]]) -> jax.Array:
        """Prefill several slots in one call: pieces = (slot, tokens, start) with distinct slots and at most
        row_chunk tokens each (each slot holds 0..start-1). Returns logits [S, V] (device) at each listed
        slot's last token, so `sample` takes them as it takes a decode step's; other rows are garbage.
        One call costs about S x row_chunk tokens of compute, so it pays when many short prompts (chat
        turns after a prefix-cache hit) arrive together."""
        return self._prefill_rows(pieces)

    def _prefill_rows(self, pieces: list[tuple[int, np.ndarray, int]], attend: int | None = None) -> jax.Array:
        tokens = np.zeros((self.num_slots, self.row_chunk), np.int32)
        ints = np.zeros((3, self.num_slots), np.int32)  # [start, n, adapter] per slot
        ints[2] = NO_ADAPTER  # rows not listed compute nothing: no adapter products for them either
        for slot, piece, start in pieces:
            piece = np.asarray(piece, np.int32)
            if not 1 <= len(piece) <= self.row_chunk or ints[1, slot]:
                raise ValueError(f"slot {slot}: 1..{self.row_chunk} tokens once per call, got {len(piece)}")
            self._check_positions(start, len(piece))
            tokens[slot, :len(piece)] = piece
            ints[0, slot], ints[1, slot], ints[2, slot] = start, len(piece), self.slot_adapters[slot]
        listed = ints[1] > 0
        attend = attend or self.bucket_for(ints[0][listed] + ints[1][listed] - 1)
        logits, self.cache = self.programs["prefill_rows", attend](self.params, self.cache, tokens, ints)
        return logits

    def decode(self, tokens: np.ndarray, positions: np.ndarray, active: np.ndarray) -> jax.Array:
        """One token for every slot: slot s reads tokens[s] at positions[s]; idle slots write nothing.
        Returns logits [S, V] (device)."""
        packed = _decode_inputs(tokens, positions, active, self.slot_adapters)
        logits, self.cache = self.programs["decode", self.bucket_for(packed[1])](self.params, self.cache, packed)
        return logits

    def decode_with_chunk(self, tokens: np.ndarray, positions: np.ndarray, active: np.ndarray, slot: int,
                          chunk: np.ndarray, start: int) -> tuple[jax.Array, jax.Array]:
        """`decode` and `prefill_chunk` of slot ``slot`` (not decoding; at most the largest carry size of tokens
        from start) in one pass, padded to `carry_width` (`chunk_in_decode`; check `compiled_for("decode_chunk",
        ..., carry_width)` first): (logits [S, V], the chunk's last logits [V]), each what its own call gives
        bit for bit."""
        if not self.chunk_in_decode:
            raise ValueError("no carrying program: chunk_in_decode needs W8A8 weights and int8 KV")
        chunk = np.asarray(chunk, np.int32)
        if not 1 <= len(chunk) <= self.carry_sizes[-1] or active[slot]:
            raise ValueError(f"slot {slot}: 1..{self.carry_sizes[-1]} tokens of a slot that is not decoding")
        self._check_positions(start, len(chunk))
        packed = _decode_inputs(tokens, positions, active, self.slot_adapters)
        attend = self.bucket_for(np.append(packed[1], start + len(chunk) - 1))
        width = self.carry_width(len(chunk))
        logits, chunk_logits, self.cache = self.programs["decode_chunk", width, attend](
            self.params, self.cache, packed, _one_row(chunk, width), self._one_slot(start, len(chunk), slot))
        return logits, chunk_logits

    def carry_width(self, n: int) -> int:
        """The carry size a chunk of n tokens is padded to in `decode_with_chunk`: the smallest covering it."""
        return next(width for width in self.carry_sizes if width >= n)

    def fused_ready(self, positions: np.ndarray, needs_full: bool) -> bool:
        """Whether `decode_sample` can run a step at these positions now (its program exists and is compiled)."""
        return self.compiled_for(_fused_kind(needs_full), positions)

    def decode_sample(self, tokens: np.ndarray, positions: np.ndarray, active: np.ndarray, steps: np.ndarray,
                      needs_full: bool = True, dry_limits: np.ndarray | None = None) -> SampleResult:
        """`decode` then `sample` with no mask, as one program (check `fused_ready` first): the same tokens,
        logprobs and sampler state bit for bit as the two calls."""
        return self.dispatch_decode_sample(tokens, positions, active, steps, needs_full, dry_limits).result()

    def dispatch_decode_sample(self, tokens: np.ndarray, positions: np.ndarray, active: np.ndarray,
                               steps: np.ndarray, needs_full: bool = True, dry_limits: np.ndarray | None = None,
                               follows: PendingSample | None = None) -> PendingSample:
        """`decode_sample` without waiting for its tokens: the step is queued on the device and its results
        start their copy to the host. A slot whose tokens[s] is FOLLOWING reads the token that step
        ``follows`` sampled for it, on the device: a decode step dispatched before the previous one's tokens
        reach the host, so host work between steps overlaps the device."""
        tokens = np.asarray(tokens, np.int32)
        if follows is None and bool(np.any(tokens[np.asarray(active, bool)] == FOLLOWING)):
            raise ValueError("a slot reads the previous step's token, but no previous step was given")
        packed = _decode_inputs(tokens, positions, active, self.slot_adapters)
        limits = self._dry_limits(dry_limits)
        program = self.programs[_fused_kind(needs_full), self.bucket_for(packed[1])]
        previous = follows.packed if follows is not None else self._no_previous_step()
        sampled, self.cache, self.sampler = program(self.params, self.cache, packed, previous, self.sampler,
                                                    np.asarray(steps, np.int32), limits)
        return PendingSample(sampled)

    def _no_previous_step(self) -> jax.Array:
        """A device-resident stand-in for a previous step's packed samples (read by no slot)."""
        if self._no_previous is None:
            self._no_previous = jnp.zeros((self.num_slots, PACKED_WIDTH), jnp.int32)
        return self._no_previous

    def verify(self, slot: int, tokens: list[int] | np.ndarray, start: int, step: int = 0) -> list[int]:
        """One speculative step for one slot holding positions 0..start-1: tokens = [its last generated
        token, draft_1, ..., draft_k] (k < verify_tokens) go in at positions start.. . Returns the tokens
        g_0..g_m the slot's request draws there (g_i with the slot's sampling parameters and seed at step
        step + i, `core.sampling.draw_tokens`; step: the tokens it has generated so far), where draft_1..draft_m
        equal g_0..g_{m-1} (so g_m is the first new token past the accepted drafts); the slot then holds
        positions 0..start+m, i.e. the last token and the m accepted drafts. Each row is computed as a decode
        step at its position computes it (the chunk is written into the cache first and attention reads the
        cache alone, over the same attention bucket), so the tokens are those of m+1 plain decode steps, bit
        for bit, provided the whole chunk lies in the bucket of its first position (`verify_room`) and the
        request is one `draw_tokens` serves (no penalties, mask or logprobs)."""
        tokens = np.asarray(tokens, np.int32)
        width = self.config.verify_tokens
        if not 1 <= len(tokens) <= width or width < 2:
            raise ValueError(f"verify takes 1..{width} tokens, got {len(tokens)}")
        self._check_positions(start, len(tokens))
        return self._verify(slot, tokens, start, step)

    def _verify(self, slot: int, tokens: np.ndarray, start: int, step: int) -> list[int]:
        ints = np.append(self._one_slot(start, len(tokens), slot), np.int32(step))
        fn = self.programs["verify", self.bucket_for(np.array([start + len(tokens) - 1]))]
        drawn, accepted, self.cache = fn(self.params, self.cache, _one_row(tokens, self.config.verify_tokens), ints,
                                         self.sampler)
        drawn, accepted = jax.device_get((drawn, accepted))
        return [int(t) for t in drawn[: int(accepted) + 1]]

    def verify_rows(self, pieces: list[tuple[int, list[int] | np.ndarray, int]],
                    steps: Sequence[int] | None = None) -> dict[int, list[int]]:
        """`verify` for several slots in one pass: pieces = (slot, [last token, draft_1, ..., draft_k], start)
        with distinct slots and k < rows_verify_width (k = 0 is a plain decode step for that slot), steps the
        tokens each piece's request has generated so far (None: all 0, as greedy requests may pass). Returns
        each listed slot's tokens g_0..g_m as `verify` does. Only where `rows_verify_exact`, and each chunk must
        lie within `rows_verify_room`."""
        if not self.rows_verify_exact:
            raise ValueError("batched verification needs W8A8 weights and an int8 KV cache (rows_verify_exact)")
        width = self.config.rows_verify_width
        tokens = np.zeros((self.num_slots, width), np.int32)
        starts, counts, at_step = (np.zeros(self.num_slots, np.int32) for _ in range(3))
        for (slot, piece, start), step in zip(pieces, [0] * len(pieces) if steps is None else steps, strict=True):
            piece = np.asarray(piece, np.int32)
            if not 1 <= len(piece) <= width or counts[slot]:
                raise ValueError(f"slot {slot}: 1..{width} tokens once per call, got {len(piece)}")
            self._check_positions(start, len(piece))
            tokens[slot, :len(piece)] = piece
            starts[slot], counts[slot], at_step[slot] = start, len(piece), step
        listed = counts > 0
        attend = self.bucket_for(starts[listed] + counts[listed] - 1)
        drawn, accepted = self._verify_rows(tokens, starts, counts, at_step, attend)
        return {slot: [int(t) for t in drawn[slot, :int(accepted[slot]) + 1]] for slot, _, _ in pieces}

    def _verify_rows(self, tokens: np.ndarray, starts: np.ndarray, counts: np.ndarray, steps: np.ndarray,
                     attend: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [S, rows_verify_width] and starts, counts, steps [S] (count 0: the slot is not verified)."""
        padded = np.zeros((self.num_slots, self.config.rows_verify_width), np.int32)
        padded[:, :tokens.shape[1]] = tokens
        adapters = np.where(counts > 0, self.slot_adapters, NO_ADAPTER)
        ints = np.stack([starts, counts, adapters, steps]).astype(np.int32)
        drawn, accepted, self.cache = self.programs["verify_rows", attend](self.params, self.cache, padded, ints,
                                                                            self.sampler)
        return jax.device_get((drawn, accepted))

    def rows_verify_room(self, starts: list[int]) -> list[int]:
        """Tokens each slot may send to one `verify_rows` call with these starts (the positions each holds) so
        that every chunk lies in the bucket a decode step over all of them uses (rows equal decode steps)."""
        bucket = self.bucket_for(np.asarray(starts))
        return [min(self.config.rows_verify_width, bucket - start) for start in starts]

    def verify_room(self, start: int) -> int:
        """How many tokens a verify step at `start` may take and still attend over the bucket a decode step
        at `start` uses (so its rows equal decode steps bit for bit)."""
        return min(self.config.verify_tokens, self.bucket_for(np.array([start])) - start)

    def _one_slot(self, start: int, n: int, slot: int) -> np.ndarray:
        """The int32 [4] a one-slot step takes: where its chunk starts, how many tokens are real, which slot,
        and that slot's adapter. (Steps over every slot take [k, num_slots] rows of per-slot values instead.)"""
        return np.array([start, n, slot, self.slot_adapters[slot]], np.int32)

    def _check_positions(self, start: int, n: int) -> None:
        """A call writes positions start..start+n-1 of a slot: they must lie within it."""
        if start < 0 or start + n > self.max_len:
            raise ValueError(f"positions {start}..{start + n - 1} exceed the slot length {self.max_len}")

    def bucket_for(self, positions: np.ndarray) -> int:
        """The smallest attention bucket holding every position (idle slots sit at 0 or below the top)."""
        return self._covering_bucket(int(np.max(positions)) + 1)

    def _covering_bucket(self, length: int) -> int:
        return next((size for size in self.buckets if size >= length), self.buckets[-1])

    def _covering_transfer(self, length: int) -> int:
        return next((size for size in self.transfer_lengths if size >= length), self.transfer_lengths[-1])

    # ---- sampling -------------------------------------------------------------------------------
    def begin_request(self, slot: int, params: SamplingParams, prompt_ids: list[int] | np.ndarray, seed: int,
                      dry_breakers: np.ndarray | None = None, logprobs: bool = True) -> None:
        """Install a request's sampling parameters and seed in a slot (once per admission); with DRY on,
        dry_breakers lists its single-token sequence breakers; logprobs False: its samples carry no logprobs
        (`core.sampling.set_slot`)."""
        self.begin_requests([SlotRequest(slot, params, prompt_ids, seed, dry_breakers, logprobs)])

    def begin_requests(self, requests: Sequence[SlotRequest]) -> None:
        """`begin_request` for each of an iteration's admissions, in one program call (different slots)."""
        self.sampler = set_slots(self.sampler, requests)

    def sample(self, logits: jax.Array, active: np.ndarray, steps: np.ndarray, mask: np.ndarray | None = None,
               needs_full: bool = True, dry_limits: np.ndarray | None = None) -> SampleResult:
        """Sample one token per slot from decode logits [S, V]. steps[s]: tokens the slot generated so far
        (keys its seeded draw); mask: packed allowed tokens [S, ceil(V/32)] or None (no row constrained);
        needs_full=False selects the cheaper program valid when no active request uses penalties or
        top-k/top-p/min-p; dry_limits [S]: each DRY row's `core.dry.RepeatLimit.limit` (others ignore it)."""
        program = self.programs["sample", needs_full, mask is not None]
        limits = self._dry_limits(dry_limits)
        packed, self.sampler = program(logits, self.sampler, mask, np.asarray(steps, np.int32),
                                       np.asarray(active, bool), limits)
        return SampleResult.unpack(packed)

    def _dry_limits(self, given: np.ndarray | None) -> np.ndarray:
        """[S] int32 DRY repeat limits as the samplers take them (zeros when none is given: no DRY row)."""
        return np.zeros(self.num_slots, np.int32) if given is None else np.asarray(given, np.int32)

    def sample_slot(self, slot: int, logits: jax.Array, step: int, mask: np.ndarray | None = None,
                    dry_limit: int = 0) -> SampleResult:
        """Sample the token that follows a prefill (logits [V]) with the slot's own parameters."""
        packed, self.sampler = self.programs["sample_row", mask is not None](
            logits, self.sampler, np.int32(slot), np.int32(step), mask, np.int32(dry_limit))
        return SampleResult.unpack(packed)

    # ---- host tier and slot-to-slot copies ---------------------------------------------------
    def save_slot(self, slot: int, start: int, end: int, wait: bool = True) -> SlotSnapshot:
        """Copy positions [start, end) of a slot (every owning layer) to host memory. ``wait=False``: return once
        the copy is queued behind the device's work; the snapshot's arrays are made where it is first read
        (the slot may be overwritten meanwhile: the copy reads the KV the slot holds now)."""
        if not 0 <= start <= end <= self.max_len:
            raise ValueError(f"bad range [{start}, {end})")
        size = self._covering_transfer(end - start)
        at = min(start, self.max_len - size)
        packed = self.programs["read", size](self.cache, np.int32(slot), np.int32(at))
        for array in packed.values():
            array.copy_to_host_async()
        columns = _packed_columns(self.cache).values()
        snapshot = SlotSnapshot(start, end, pending=partial(_host_positions, packed, abstract(self.cache), start - at,
                                                            end - start),
                                position_bytes=sum(dtype.itemsize * width for dtype, width in columns))
        if wait:
            snapshot.layers  # noqa: B018 - made now, on this thread
        return snapshot

    def restore_slot(self, slot: int, snap: SlotSnapshot) -> None:
        """Write a snapshot's positions [start, end) into any slot (which must hold positions 0..snap.start-1)."""
        n = snap.end - snap.start
        size = self._covering_transfer(n)
        at = min(snap.start, self.max_len - size)
        lo = snap.start - at
        packed = {name: np.zeros((size, width), dtype) for name, (dtype, width) in _packed_columns(self.cache).items()}
        # each array's columns of `packed`, written in place
        views = _unpack_positions({name: _bits(a) for name, a in packed.items()}, self.cache)
        for key, entry in snap.layers.items():
            for name, part in entry.items():
                views[key][name][lo:lo + n] = _bits(part)
        bounds = np.array([slot, at, lo, lo + n], np.int32)
        self.cache = self.programs["write", size](self.cache, packed, bounds)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make slot dst hold positions 0..n-1 of slot src, on the device (src must hold at least n positions)."""
        if not 0 <= n <= self.max_len or not (0 <= src < self.num_slots and 0 <= dst < self.num_slots):
            raise ValueError(f"cannot copy {n} positions from slot {src} to slot {dst}")
        size = self._covering_bucket(n)
        self.cache = self.programs["copy", size](self.cache, np.array([src, dst, n], np.int32))


def _prefill_step(params, cache, tokens, ints, *, cfg, view_width: int, attend: int):
    start, n_valid, slot, adapter = ints[0:1], ints[1:2], ints[2:3], ints[3:4]
    logits, cache = prefill_chunk(params, cache, tokens, start, n_valid, slot, cfg=cfg, attend=attend,
                                  view_width=view_width, adapters=adapter)
    return logits[0], cache  # [V]: the one row, sliced inside the program (an eager slice compiles a program)


def _prefill_rows_step(params, cache, tokens, ints, *, cfg, view_width: int, attend: int):
    return prefill_chunk(params, cache, tokens, ints[0], ints[1], None, cfg=cfg, attend=attend,
                         view_width=view_width, adapters=ints[2])


def _decode_step(params, cache, packed, *, cfg, view_width: int, attend: int,
                 slot_batched_lora: tuple[str, int] | None):
    tokens, positions, active, adapters = packed[0], packed[1], packed[2], packed[3]
    return decode_step(params, cache, tokens, positions, active, cfg=cfg, attend=attend, view_width=view_width,
                       adapters=adapters, slot_batched_lora=slot_batched_lora)


def _decode_chunk_step(params, cache, packed, tokens, ints, *, cfg, view_width: int, attend: int,
                       slot_batched_lora: tuple[str, int] | None):
    logits, chunk_logits, cache = decode_with_chunk(
        params, cache, packed[0], packed[1], packed[2], tokens, ints[0:1], ints[1:2], ints[2:3], cfg=cfg,
        attend=attend, view_width=view_width, adapters=packed[3], chunk_adapter=ints[3:4],
        slot_batched_lora=slot_batched_lora)
    return logits, chunk_logits[0], cache


def _one_row(tokens: np.ndarray, width: int) -> np.ndarray:
    """One slot's tokens as the int32 [1, width] row a one-slot program takes, zero-padded."""
    row = np.zeros((1, width), np.int32)
    row[0, :len(tokens)] = tokens
    return row


def _decode_inputs(tokens: np.ndarray, positions: np.ndarray, active: np.ndarray,
                   adapters: np.ndarray) -> np.ndarray:
    """The int32 [4, S] a decode step takes: each slot's token, position, whether it is active and its adapter
    slot (none for an idle slot: a step of unadapted rows computes no adapter products)."""
    return np.stack([np.asarray(tokens, np.int32), np.asarray(positions, np.int32), np.asarray(active, np.int32),
                     np.where(np.asarray(active, bool), adapters, NO_ADAPTER).astype(np.int32)])


def _fused_kind(needs_full: bool) -> str:
    return "decode_sample_full" if needs_full else "decode_sample"


def _decode_sample_step(params, cache, packed, previous, sampler: SamplerState, steps, limits, *, cfg,
                        view_width: int, attend: int, needs_full: bool, slot_batched_lora: tuple[str, int] | None):
    # A slot marked FOLLOWING takes the token the previous step sampled for it (previous [S, PACKED_WIDTH]).
    packed = packed.at[0].set(jnp.where(packed[0] == FOLLOWING, previous[:, 0], packed[0]))
    logits, cache = _decode_step(params, cache, packed, cfg=cfg, view_width=view_width, attend=attend,
                                 slot_batched_lora=slot_batched_lora)
    # The barrier keeps the logits computed as the decode program computes them (nothing of the sampler fused
    # into the model's last ops), so a row samples the same bits whichever path its step took.
    logits = jax.lax.optimization_barrier(logits)
    sampled, sampler = _sample_step(logits, sampler, None, steps, packed[2] != 0, limits, needs_full=needs_full)
    return sampled, cache, sampler


def _accepted_drafts(tokens: jax.Array, drawn: jax.Array, n_valid: jax.Array) -> jax.Array:
    """[B]: how many drafts (tokens[:, 1:]) in a row equal the token drawn before them, up to n_valid-1."""
    width = tokens.shape[1]
    match = (tokens[:, 1:] == drawn[:, :-1]) & (jnp.arange(1, width)[None, :] < n_valid[:, None])
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)


def _verify_step(params, cache, tokens, ints, sampler: SamplerState, *, cfg, view_width: int, attend: int):
    start, n_valid, slot, adapter, step = ints[0:1], ints[1:2], ints[2:3], ints[3:4], ints[4]
    logits, cache = verify_chunk(params, cache, tokens, start, n_valid, slot, cfg=cfg, attend=attend,
                                 view_width=view_width, adapters=adapter)
    # The barrier keeps the logits as a decode step computes them (see `_decode_sample_step`). The W
    # positions are drawn as W rows of the slot's own parameters and seed, at steps step..step+W-1.
    logits = jax.lax.optimization_barrier(logits)[0]  # [W, V]
    width = logits.shape[0]
    rows = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a[ints[2]], (width, *a.shape[1:])), sampler)
    drawn = draw_tokens(logits, rows, step + jnp.arange(width, dtype=jnp.int32))
    return drawn, _accepted_drafts(tokens, drawn[None], n_valid)[0], cache


def _verify_rows_step(params, cache, tokens, ints, sampler: SamplerState, *, cfg, view_width: int, attend: int):
    starts, n_valid, steps = ints[0], ints[1], ints[3]
    logits, cache = verify_chunk(params, cache, tokens, starts, n_valid, None, cfg=cfg, attend=attend,
                                 view_width=view_width, adapters=ints[2])
    # Position i of every slot is drawn as a decode step's [S, V] rows are (same shape, step + i), so each
    # token is the one plain decoding draws there; a position no slot's chunk reaches is not drawn (with
    # top-k/top-p a draw costs a pass over V per row, and most slots send fewer drafts than the width allows).
    logits = jax.lax.optimization_barrier(logits)  # [S, W, V]

    def draw(i: int) -> jax.Array:
        return draw_tokens(logits[:, i], sampler, steps + i)

    unused = jnp.zeros(n_valid.shape, jnp.int32)
    drawn = jnp.stack([draw(0)] + [jax.lax.cond(jnp.any(n_valid > i), partial(draw, i), lambda: unused)
                                   for i in range(1, tokens.shape[1])], axis=1)
    return drawn, _accepted_drafts(tokens, drawn, n_valid), cache


def _sample_row(logits, state: SamplerState, slot, step, mask, dry_limit):
    """The full sampler on one slot's row of the state; the row's counts are written back."""
    row = jax.tree_util.tree_map(lambda a: a[slot][None], state)
    *result, row = sample(logits[None], row, mask, step[None], jnp.ones((1,), bool), dry_limit[None],
                          num_top=MAX_LOGPROBS)
    state = jax.tree_util.tree_map(lambda full, part: full.at[slot].set(part[0]), state, row)
    return _packed_sample(*result), state


def _sample_step(logits, state: SamplerState, mask, steps, active, dry_limits, *, needs_full: bool):
    """`core.sampling.sample` at the full top-logprobs width, its four results packed into one array."""
    *result, state = sample(logits, state, mask, steps, active, dry_limits, num_top=MAX_LOGPROBS,
                            needs_full=needs_full)
    return _packed_sample(*result), state


def _packed_sample(tokens, logprobs, top_ids, top_logprobs) -> jax.Array:
    """[R, 2 + 2 * MAX_LOGPROBS] int32: tokens, logprobs' bits, top ids, top logprobs' bits. A step's results
    leave the device as one copy instead of four (each copy off an accelerator has a fixed cost: ~0.1 ms on a
    TPU v5e host); `SampleResult.unpack` splits it."""
    def bits(x: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.concatenate([tokens[:, None], bits(logprobs)[:, None], top_ids, bits(top_logprobs)], axis=1)


def _pack_positions(tree: dict[str, dict[str, Any]], xp: Any) -> dict[str, Any]:
    """{key: {name: [size, ...]}} as one [size, columns] array per dtype (by name), arrays in sorted (key, name)
    order, with xp numpy or jax.numpy. A slot range crosses between host and device as one copy per dtype
    instead of one per layer array (each copy off an accelerator has a fixed cost: a save of a 270M-shaped
    slot took ~11 ms on a TPU v5e host as 36 copies)."""
    groups: dict[str, list[Any]] = {}
    for key in sorted(tree):
        for name in sorted(tree[key]):
            array = tree[key][name]
            groups.setdefault(np.dtype(array.dtype).name, []).append(array.reshape(array.shape[0], -1))
    return {dtype: xp.concatenate(parts, axis=1) for dtype, parts in groups.items()}


def _packed_columns(cache: dict[str, dict[str, Any]]) -> dict[str, tuple[np.dtype, int]]:
    """Per dtype name, the dtype and column count of `_pack_positions`' array for cache arrays [S, L, ...]."""
    columns: dict[str, tuple[np.dtype, int]] = {}
    for entry in cache.values():
        for array in entry.values():
            dtype = np.dtype(array.dtype)
            columns[dtype.name] = (dtype, columns.get(dtype.name, (dtype, 0))[1] + math.prod(array.shape[2:]))
    return columns


def _bits(array: np.ndarray) -> np.ndarray:
    """The same bytes as unsigned integers where the dtype is a numpy extension type (bfloat16 from
    ml_dtypes): numpy copies those element by element through the type's hooks, a strided copy of a slot's
    columns ~15x slower than the same bytes as uint16 (7.2 vs 0.47 ms on a CPU)."""
    return array if array.dtype.isbuiltin == 1 else array.view(f"u{array.dtype.itemsize}")  # 2: user-defined


def _unpack_positions(packed: dict[str, Any], cache: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`_pack_positions` undone: views [size, ...] of each cache array's columns (`cache` [S, L, ...] gives the
    arrays, their order and their trailing shapes)."""
    offsets = dict.fromkeys(packed, 0)
    out: dict[str, dict[str, Any]] = {}
    for key in sorted(cache):
        out[key] = {}
        for name in sorted(cache[key]):
            array = cache[key][name]
            dtype, width = np.dtype(array.dtype).name, math.prod(array.shape[2:])
            block = packed[dtype][:, offsets[dtype]:offsets[dtype] + width]
            offsets[dtype] += width
            out[key][name] = block.reshape(block.shape[0], *array.shape[2:])
    return out


def _host_positions(packed: dict[str, jax.Array], cache: dict[str, dict[str, Any]], lo: int, n: int) -> Layers:
    """Positions [lo, lo + n) of a read program's packed result, as contiguous host arrays per cache array
    (``cache``: the cache's shapes and dtypes, as `_unpack_positions` reads them)."""
    host = _unpack_positions({name: _bits(np.asarray(a)) for name, a in packed.items()}, cache)
    return {key: {name: np.ascontiguousarray(arr[lo:lo + n]).view(cache[key][name].dtype)
                  for name, arr in entry.items()}
            for key, entry in host.items()}


def _read_range(cache, slot, at, *, size: int):
    """Positions [at, at + size) of one slot, packed by `_pack_positions`: [size, columns] per dtype."""
    def read(arr):
        start = (slot, at) + (0,) * (arr.ndim - 2)
        return jax.lax.dynamic_slice(arr, start, (1, size, *arr.shape[2:]))[0]
    return _pack_positions(jax.tree_util.tree_map(read, cache), jnp)


def _write_range(cache, packed, bounds):
    """Write the values packed by `_pack_positions` ([size, ...] per cache array) into slot bounds[0] at
    positions bounds[1].., keeping only entries [bounds[2], bounds[3]) of them (the rest of the range keeps
    what the slot holds)."""
    slot, at, lo, hi = bounds[0], bounds[1], bounds[2], bounds[3]
    values = _unpack_positions(packed, cache)
    out = {}
    for key, entry in cache.items():
        out[key] = {}
        for name, arr in entry.items():
            new = values[key][name]
            size = new.shape[0]
            start = (slot, at) + (0,) * (arr.ndim - 2)
            old = jax.lax.dynamic_slice(arr, start, (1, size, *arr.shape[2:]))[0]
            idx = jnp.arange(size).reshape((size,) + (1,) * (arr.ndim - 2))
            merged = jnp.where((idx >= lo) & (idx < hi), new, old)
            out[key][name] = jax.lax.dynamic_update_slice(arr, merged[None], start)
    return out


def _copy_prefix(cache, ints, *, size: int):
    """Slot ints[1] takes positions [0, ints[2]) of slot ints[0] (ints[2] <= size), every array."""
    src, dst, n = ints[0], ints[1], ints[2]
    out = {}
    for key, entry in cache.items():
        out[key] = {}
        for name, arr in entry.items():
            shape = (1, size, *arr.shape[2:])
            zeros = (0,) * (arr.ndim - 2)
            source = jax.lax.dynamic_slice(arr, (src, 0, *zeros), shape)
            target = jax.lax.dynamic_slice(arr, (dst, 0, *zeros), shape)
            idx = jnp.arange(size).reshape((1, size) + (1,) * (arr.ndim - 2))
            out[key][name] = jax.lax.dynamic_update_slice(arr, jnp.where(idx < n, source, target), (dst, 0, *zeros))
    return out


def _params_digest(params: Any) -> str:
    """SHA-256 over every parameter's path, dtype, shape and bytes (adapter slots left out: the adapter is
    part of the cache scope)."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        if "lora" in name:
            continue
        array = np.asarray(leaf)
        digest.update(f"{name}:{array.dtype}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()
