#!/usr/bin/env python3
"""Engine benchmark: compile time, memory, decode and prefill throughput of the slot engine.

Run from the repository root (the package need not be installed; gguf is needed only for --model):

    python3 benchmarks/engine.py --model default                                   # the real Gemma 3 270M
    python3 benchmarks/engine.py --model default --compare --max-len 4096          # f32/bf16 x plain/int8 KV
    python3 benchmarks/engine.py --config configs/models/gemma4-e2b.json --random-weights --slots 8

Prints one JSON document and writes it under benchmarks/results/ (or to --out), rewriting the file after
every measured phase so that a run cut short still leaves what it measured.

What a decode step is here: `engine.decode` for all S slots (the compiled step is static-shaped; idle
slots are masked, not skipped) followed by `engine.sample(..., needs_full=False)`, whose host copy of the
sampled tokens is the synchronisation point, as in serving. Slots are NOT prefilled before decode is
timed: every decode step attends over each slot's whole cache (global layers over max_len positions,
sliding layers over their ring) and only masks by position, so neither the cache contents nor the
context change the work done; the context only sets the positions passed to decode.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import time
import types
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, git_commit, host, log, save_report  # noqa: E402

CONTEXT_NOTE = (
    "slots were not prefilled before decode timing: a decode step reads every slot's global-layer cache up to "
    "the attention bucket covering the context and a fixed-length view of each sliding layer, and masks "
    "by position, so cache contents do not change its cost; positions were set to the context"
)
ROOFLINE_NOTE = (
    "bytes per decode step = streamed parameter bytes (all parameters except tables only gathered by token: "
    "the per-layer-embedding table, and the input embedding when it is not tied to the output projection) "
    "+ the KV a step at the largest context reads (every slot's global layers over max_len positions, its "
    "sliding layers over their view); naive = all parameter bytes + the whole KV pool"
)


# ---- imports that must wait for configure_environment / may lack gguf ----------------------------------

def _allow_core_weights_without_gguf() -> None:
    """core.weights imports core.loaders, whose package __init__ imports the GGUF reader (the `gguf`
    package). Random-weight runs need only core.loaders.base/check, so where gguf is missing, stand in
    a bare core.loaders package that exposes just those."""
    if "core.loaders" in sys.modules or importlib.util.find_spec("gguf") is not None:
        return
    package = types.ModuleType("core.loaders")
    package.__path__ = [str(ROOT / "core" / "loaders")]
    sys.modules["core.loaders"] = package
    from core.loaders.base import CheckpointSource, is_multimodal
    from core.loaders.check import check_tensors

    package.CheckpointSource = CheckpointSource
    package.is_multimodal = is_multimodal
    package.check_tensors = check_tensors


# ---- model construction --------------------------------------------------------------------------------

def truncate_config(raw: dict[str, Any], layers: int) -> dict[str, Any]:
    """The first `layers` layers of an HF text config, for smoke runs of models too big for the host.
    Gemma 4 KV sharing is scaled in proportion and reduced until every shared layer has an earlier owner
    of its type (the parser raises otherwise)."""
    from core.config import ConfigError, ModelConfig

    text = dict(raw.get("text_config") or raw)
    total = int(text["num_hidden_layers"])
    if not 0 < layers <= total:
        raise ValueError(f"--layers must be in 1..{total}")
    text["num_hidden_layers"] = layers
    if text.get("layer_types"):
        text["layer_types"] = list(text["layer_types"])[:layers]
    shared = int(text.get("num_kv_shared_layers") or 0)
    if shared:
        shared = round(shared * layers / total)
        while True:
            text["num_kv_shared_layers"] = shared
            try:
                ModelConfig.from_hf_dict(text)
                break
            except ConfigError:
                if shared == 0:
                    raise
                shared -= 1
    return text


def _mix32(x: Any) -> Any:
    """A 32-bit integer hash (lowbias32): elementwise, so XLA fuses it into the one loop that writes the weight."""
    import jax.numpy as jnp

    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _hashed_uniform(salt: Any, *, shape: tuple[int, ...], dtype: str, std: float) -> Any:
    """Uniform values of standard deviation `std` from a hash of each element's index: one fused loop with
    no intermediate buffer (jax.random's threefry materialises float32 and bit arrays as large as the
    weight, which the E2B per-layer-embedding table, 2.3e9 values, cannot afford on a host)."""
    import jax
    import jax.numpy as jnp

    h = jnp.broadcast_to(_mix32(jnp.asarray(salt, jnp.uint32)), shape)
    for axis in range(len(shape)):
        h = _mix32(h ^ jax.lax.broadcasted_iota(jnp.uint32, shape, axis))
    unit = (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)  # [0, 1)
    return ((unit * 2.0 - 1.0) * jnp.float32(std * 3.0**0.5)).astype(dtype)


def device_random_params(cfg: Any, dtype: str, seed: int, std: float) -> dict[str, Any]:
    """Random weights made on the device (uniform of standard deviation std; norms and layer scalars 1),
    in the tree `core.weights.random_params` builds. Much faster than host numpy (the E2B tree is 4.6e9
    values: about a minute of numpy on a fast host, milliseconds on a GPU) and never holds a float32 host
    copy. Only speed is measured, so the distribution does not matter."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from core.config import expected_tensor_shapes
    from core.weights import NORM_SUFFIXES, _destination, _is_used

    expected, optional = expected_tensor_shapes(cfg)
    params: dict[str, Any] = {"layers": [{} for _ in cfg.layers], "lm_head": None}
    makers: dict[tuple[tuple[int, ...], bool], Any] = {}
    for i, (name, shape) in enumerate(expected.items()):
        if name in optional or not _is_used(name, cfg):
            continue
        key, target = _destination(name, params)
        ones = name.endswith(NORM_SUFFIXES) or key == "layer_scalar"
        if (shape, ones) not in makers:
            if ones:
                makers[shape, ones] = jax.jit(lambda salt, shape=shape: jnp.ones(shape, dtype))
            else:
                makers[shape, ones] = jax.jit(partial(_hashed_uniform, shape=shape, dtype=dtype, std=std))
        target[key] = jax.block_until_ready(makers[shape, ones](np.uint32((seed * 100_003 + i) % 2**32)))
    return params


def build_model(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """cfg, params, and a description of where they came from."""
    from core.config import ModelConfig

    begin = time.perf_counter()
    if args.model and not args.random_weights:
        from core.runtime import load_model

        loaded = load_model(args.model, dtype=dtype)
        return {"cfg": loaded.cfg, "params": loaded.params, "dtype": loaded.dtype, "source": "checkpoint",
                "raw_config": None, "seconds": time.perf_counter() - begin}
    if args.model:
        from core.loaders import open_checkpoint

        raw = dict(open_checkpoint(args.model).config)
    else:
        with open(args.config, encoding="utf-8") as handle:
            raw = json.load(handle)
    if args.layers:
        raw = truncate_config(raw, args.layers)
    cfg = ModelConfig.from_hf_dict(raw)
    if args.init == "host":
        _allow_core_weights_without_gguf()
        from core.weights import random_params

        params = random_params(cfg, dtype, seed=args.seed, std=args.std)
    else:
        _allow_core_weights_without_gguf()
        params = device_random_params(cfg, dtype, args.seed, args.std)
    from core.weights import fuse_projections

    params = fuse_projections(params)  # as core.runtime.load_model serves a checkpoint
    how = "device, hashed uniform" if args.init == "device" else "host, core.weights.random_params"
    return {"cfg": cfg, "params": params, "dtype": dtype, "source": f"random ({how}, std {args.std})",
            "raw_config": raw, "seconds": time.perf_counter() - begin}


def with_precision(model: dict[str, Any], precision: str, int4_ple: bool = False) -> dict[str, Any]:
    """The model's weights in ``precision``, with Gemma 4's per-layer-embedding table as int4 if asked."""
    if precision not in ("float", "w8a8"):
        raise SystemExit(f"unknown precision {precision!r}")
    from core.weights import to_int4_ple, to_w8a8

    begin = time.perf_counter()
    params, source = model["params"], model["source"]
    if precision == "w8a8":
        params, source = to_w8a8(params), source + ", W8A8"
    if int4_ple and "embed_per_layer" in params:
        params, source = to_int4_ple(params), source + ", int4 per-layer embeddings"
    return {**model, "params": params, "source": source, "seconds": model["seconds"] + time.perf_counter() - begin}


# ---- measurements --------------------------------------------------------------------------------------

def memory_snapshot() -> dict[str, Any]:
    import jax

    out: dict[str, Any] = {"rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            out["rss_bytes"] = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if stats:
        for name in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reserved"):
            if name in stats:
                out[f"device_{name}"] = int(stats[name])
    return out


def summarize(seconds: list[float], per_step: int) -> dict[str, Any]:
    p50 = statistics.median(seconds)
    mean = statistics.fmean(seconds)
    return {
        "steps": len(seconds),
        "ms_p50": round(p50 * 1e3, 3),
        "ms_mean": round(mean * 1e3, 3),
        "ms_min": round(min(seconds) * 1e3, 3),
        "ms_max": round(max(seconds) * 1e3, 3),
        "tokens_per_s": round(per_step / p50, 2),
        "tokens_per_s_mean": round(per_step / mean, 2),
    }


# Every timing below takes a list of engines and interleaves them step by step (round robin), so that in
# --compare mode whatever else the host is doing slows every variant alike; a single run is a list of one.

def time_decode(engines: list[Any], context: int, active_count: int, steps: int, warm: int) -> list[dict[str, Any]]:
    """decode + sample per step, the sampled tokens fed back and positions advanced as in serving."""
    import numpy as np

    s = engines[0].num_slots
    active = np.zeros(s, bool)
    active[:active_count] = True
    start = max(0, min(context, engines[0].max_len - 1 - warm - steps))
    tokens = [np.zeros(s, np.int32) for _ in engines]
    generated = [np.zeros(s, np.int32) for _ in engines]
    times: list[list[float]] = [[] for _ in engines]
    for i in range(warm + steps):
        positions = np.where(active, start + i, 0).astype(np.int32)
        for j, engine in enumerate(engines):
            begin = time.perf_counter()
            result = serving_step(engine, tokens[j], positions, active, generated[j])
            elapsed = time.perf_counter() - begin
            tokens[j] = np.where(active & (result.tokens >= 0), result.tokens, 0).astype(np.int32)
            generated[j] += active
            if i >= warm:
                times[j].append(elapsed)
    return [{"context": context, "first_position": start, "active_slots": active_count,
             **summarize(t, active_count)} for t in times]


def serving_step(engine: Any, tokens: Any, positions: Any, active: Any, generated: Any) -> Any:
    """decode + sample (plain temperature sampling) as the scheduler runs an unconstrained step: in one
    program where the engine has it (`Engine.decode_sample`), else two calls. The host copy syncs."""
    if engine.fused_ready(positions, False):
        return engine.decode_sample(tokens, positions, active, generated, needs_full=False)
    return engine.sample(engine.decode(tokens, positions, active), active, generated, needs_full=False)


def time_fused(engine: Any, context: int, steps: int, warm: int) -> dict[str, Any]:
    """All slots active, alternating step by step: decode then sample as two calls vs the fused program;
    and whether one step from the same state gives the same tokens and logprobs both ways."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    s = engine.num_slots
    active, tokens = np.ones(s, bool), np.full(s, 818, np.int32)
    start = max(0, min(context, engine.max_len - 1 - warm - steps))
    saved = jax.tree_util.tree_map(jnp.copy, (engine.cache, engine.sampler))
    positions, generated = np.full(s, start, np.int32), np.zeros(s, np.int32)
    two = engine.sample(engine.decode(tokens, positions, active), active, generated, needs_full=False)
    engine.cache, engine.sampler = saved
    one = engine.decode_sample(tokens, positions, active, generated, needs_full=False)
    same = all(np.array_equal(getattr(one, k), getattr(two, k)) for k in ("tokens", "logprobs", "top_logprobs"))
    times: dict[str, list[float]] = {"separate": [], "fused": []}
    for i in range(warm + steps):
        positions, generated = np.full(s, start + i, np.int32), np.full(s, i, np.int32)
        for path in times:
            begin = time.perf_counter()
            if path == "fused":
                engine.decode_sample(tokens, positions, active, generated, needs_full=False)
            else:
                engine.sample(engine.decode(tokens, positions, active), active, generated, needs_full=False)
            if i >= warm:
                times[path].append(time.perf_counter() - begin)
    summary = {path: summarize(t, s) for path, t in times.items()}
    queued = queued_step_seconds(engine, start, steps, tokens) * 1e3
    return {"context": context, "active_slots": s, "bit_identical": bool(same),
            **{f"{path}_ms_{k}": summary[path][f"ms_{k}"] for path in times for k in ("p50", "mean", "min")},
            "fused_over_separate_p50": round(summary["fused"]["ms_p50"] / summary["separate"]["ms_p50"], 3),
            "queued_ms_mean": round(queued, 3), "queued_tokens_per_s": round(s / queued * 1e3, 1)}


def queued_step_seconds(engine: Any, start: int, steps: int, tokens: Any) -> float:
    """Mean seconds per fused decode + sample step when each is queued before the previous one's tokens are
    read (`Engine.dispatch_decode_sample(follows=...)`), all slots active."""
    import numpy as np

    from core.engine import FOLLOWING

    s = engine.num_slots
    active, following = np.ones(s, bool), np.full(s, FOLLOWING, np.int32)
    pending = engine.dispatch_decode_sample(tokens, np.full(s, start, np.int32), active, np.zeros(s, np.int32),
                                            needs_full=False)
    pending.result()
    begin = time.perf_counter()
    for i in range(1, steps + 1):
        queued = engine.dispatch_decode_sample(following, np.full(s, start + i, np.int32), active,
                                               np.full(s, i, np.int32), needs_full=False, follows=pending)
        pending.result()
        pending = queued
    pending.result()
    return (time.perf_counter() - begin) / steps


def time_breakdown(engines: list[Any], context: int, steps: int, warm: int) -> list[dict[str, Any]]:
    """All slots active: engine.decode alone (blocking on the logits) and engine.sample alone (on fixed
    logits), to see where a step goes."""
    import jax
    import numpy as np

    s = engines[0].num_slots
    active = np.ones(s, bool)
    tokens = np.zeros(s, np.int32)
    start = max(0, min(context, engines[0].max_len - 1 - warm - steps))
    decode_times: list[list[float]] = [[] for _ in engines]
    sample_times: list[list[float]] = [[] for _ in engines]
    logits: list[Any] = [None] * len(engines)
    for i in range(warm + steps):
        positions = np.full(s, start + i, np.int32)
        for j, engine in enumerate(engines):
            begin = time.perf_counter()
            logits[j] = jax.block_until_ready(engine.decode(tokens, positions, active))
            if i >= warm:
                decode_times[j].append(time.perf_counter() - begin)
    for i in range(warm + steps):
        generated = np.full(s, i, np.int32)
        for j, engine in enumerate(engines):
            begin = time.perf_counter()
            engine.sample(logits[j], active, generated, needs_full=False)
            if i >= warm:
                sample_times[j].append(time.perf_counter() - begin)
    out = []
    for d_times, s_times in zip(decode_times, sample_times, strict=True):
        decode, sample = summarize(d_times, s), summarize(s_times, s)
        out.append({"context": context, "active_slots": s,
                    **{f"decode_only_{k}": decode[k] for k in ("ms_p50", "ms_mean", "ms_min")},
                    **{f"sample_only_{k}": sample[k] for k in ("ms_p50", "ms_mean", "ms_min")}})
    return out


def time_prefill(engines: list[Any], chunks: int, seed: int) -> list[list[dict[str, Any]]]:
    """Consecutive full chunks into slot 0 from position 0 (wrapping before max_len), logits awaited
    after each: the scheduler's unit of prefill work. One untimed chunk first. Returns per engine."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)
    first = engines[0]
    out: list[list[dict[str, Any]]] = [[] for _ in engines]
    for size in first.config.chunk_sizes:
        if size > first.max_len:
            continue
        times: list[list[float]] = [[] for _ in engines]
        start = 0
        for i in range(chunks + 1):
            if start + size > first.max_len:
                start = 0
            piece = rng.integers(3, first.cfg.vocab_size, size, dtype=np.int32)
            for j, engine in enumerate(engines):
                begin = time.perf_counter()
                jax.block_until_ready(engine.prefill_chunk(0, piece, start))
                if i:
                    times[j].append(time.perf_counter() - begin)
            start += size
        for j, t in enumerate(times):
            out[j].append({"chunk": size, **summarize(t, size)})
    return out


def roofline(bytes_per_step: int, naive_bytes: int, decode_ms: float, gbps: float) -> dict[str, Any]:
    floor_ms = bytes_per_step / (gbps * 1e9) * 1e3
    return {
        "hbm_gbps": gbps,
        "bytes_per_step": bytes_per_step,
        "bytes_per_step_naive": naive_bytes,
        "roofline_ms": round(floor_ms, 4),
        "roofline_ms_naive": round(naive_bytes / (gbps * 1e9) * 1e3, 4),
        "measured_ms_p50": decode_ms,
        "measured_over_roofline": round(decode_ms / floor_ms, 2),
        "achieved_gbps": round(bytes_per_step / (decode_ms * 1e-3) / 1e9, 1),
        "note": ROOFLINE_NOTE,
    }


def streamed_param_bytes(params: dict[str, Any]) -> int:
    """Parameter bytes a decode step reads in full (tables only gathered by token id are left out)."""
    from core.weights import param_bytes

    gathered = [params.get("embed_per_layer")]
    if params.get("lm_head") is not None:
        gathered.append(params["embed"])  # untied: the input table is gathered, lm_head is streamed
    return param_bytes(params) - sum(param_bytes({"t": t}) for t in gathered if t is not None)


def decode_kv_read_bytes(engine: Any) -> int:
    """KV bytes a decode step at the largest context reads: global layers all max_len positions of every slot,
    sliding layers their view (core.kv_cache.sliding_view_length)."""
    from core.kv_cache import layer_key, sliding_view_length
    from core.model import value_sum_block

    cfg, total = engine.cfg, 0
    view_width = max(engine.config.verify_tokens, engine.config.rows_verify_width, 1)
    for layer in cfg.cache_owners:
        entry = engine.cache[layer_key(layer.index)]
        per_position = sum(a.size * a.dtype.itemsize for a in entry.values()) // engine.max_len
        block = value_sum_block(quantized_kv=engine.spec.quantized)
        length = sliding_view_length(cfg.sliding_window, engine.max_len, 1, view_width, block) if layer.is_sliding \
            else engine.max_len
        total += per_position * length
    return total


def setup_variant(args: argparse.Namespace, dtype: str, kv_dtype: str | None, model: dict[str, Any],
                  result: dict[str, Any]) -> Any:
    """Build and warm up one engine; sizes, memory and compile time go into `result`."""
    import jax

    from core.engine import Engine, EngineConfig
    from core.sampling import SamplingParams
    from core.weights import param_bytes

    label = f"{dtype}/{kv_dtype or 'plain'} KV"
    cfg, params = model["cfg"], model["params"]
    result.update({"model_source": model["source"], "model_build_seconds": round(model["seconds"], 2),
                   "num_layers": cfg.num_layers, "cache_owners": len(cfg.cache_owners),
                   "param_bytes": param_bytes(params),
                   "param_count": sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))})
    config = EngineConfig(num_slots=args.slots, max_len=args.max_len, chunk_sizes=args.chunk_sizes,
                          kv_dtype=kv_dtype, attention_buckets=args.attention_buckets, verify_width=args.verify_width,
                          fused_sampling=args.fused_sampling)
    engine = Engine(cfg, params, config, dtype)
    kv_total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(engine.cache))
    result.update({"bytes_per_slot": engine.bytes_per_slot, "kv_total_bytes": kv_total,
                   "kv_read_bytes_per_decode_step": decode_kv_read_bytes(engine),
                   "bytes_per_decode_step": streamed_param_bytes(params) + decode_kv_read_bytes(engine),
                   "memory_before_warmup": memory_snapshot()})
    log(f"{label}: parameters {result['param_bytes']} B, KV {kv_total} B, before warm-up "
        f"{json.dumps(result['memory_before_warmup'])}")  # in the log too: a big model may not finish compiling

    def progress(name: str, done: int, total: int) -> None:
        if done < total:
            log(f"{label}: compiling [{done + 1}/{total}] {name}")

    engine.warmup(progress)
    result["compile_seconds"] = round(engine.compile_seconds, 2)
    result["memory_after_warmup"] = memory_snapshot()
    log(f"{label}: compiled in {engine.compile_seconds:.1f} s")
    # Serving's common case: temperature sampling without penalties/top-k/top-p (needs_full=False), no logprobs
    # asked for (the sampler then skips their pass over the vocabulary).
    sampling = SamplingParams(temperature=args.temperature)
    for slot in range(engine.num_slots):
        engine.begin_request(slot, sampling, [], seed=args.seed + slot, logprobs=False)
    return engine


def measure(args: argparse.Namespace, engines: list[Any], results: list[dict[str, Any]], save: Any) -> None:
    import jax

    labels = [f"{r['dtype']}/{r['kv_dtype']} KV/{r.get('precision', 'float')}" for r in results]
    for result in results:
        result["decode"] = []
        result["decode_note"] = CONTEXT_NOTE
    for context in args.contexts:
        for active in sorted({1, args.slots}):
            for label, result, entry in zip(labels, results, time_decode(
                    engines, context, active, args.steps, args.warm_steps), strict=True):
                result["decode"].append(entry)
                log(f"{label}: decode ctx {context} active {active}: p50 {entry['ms_p50']:.2f} ms/step "
                    f"(min {entry['ms_min']:.2f}), {entry['tokens_per_s']:.1f} tok/s")
            save()
    if args.breakdown:
        for label, result, entry in zip(labels, results, time_breakdown(
                engines, args.contexts[-1], args.steps, args.warm_steps), strict=True):
            result["breakdown"] = entry
            log(f"{label}: decode alone {entry['decode_only_ms_p50']:.2f} ms, "
                f"sample alone {entry['sample_only_ms_p50']:.2f} ms")
        save()
        for label, result, engine in zip(labels, results, engines, strict=True):
            if engine.fused_sampling:
                result["fused_sampling"] = entry = time_fused(engine, args.contexts[-1], args.steps, args.warm_steps)
                log(f"{label}: decode + sample {entry['separate_ms_p50']:.2f} ms as two calls, "
                    f"{entry['fused_ms_p50']:.2f} ms fused (bit-identical: {entry['bit_identical']})")
        save()
    if args.prefill_chunks:
        for label, result, entries in zip(labels, results, time_prefill(
                engines, args.prefill_chunks, args.seed), strict=True):
            result["prefill"] = entries
            for e in entries:
                log(f"{label}: prefill chunk {e['chunk']}: {e['ms_p50']:.1f} ms, {e['tokens_per_s']:.0f} tok/s")
        save()
    for result in results:
        full = [d for d in result["decode"] if d["active_slots"] == args.slots]
        if jax.default_backend() != "cpu" or args.force_roofline:
            naive = result["param_bytes"] + result["kv_total_bytes"]
            result["roofline"] = roofline(result["bytes_per_decode_step"], naive, full[-1]["ms_p50"],
                                          args.hbm_gbps)
            if "breakdown" in result:
                result["roofline"]["decode_only_over_roofline"] = round(
                    result["breakdown"]["decode_only_ms_p50"] / result["roofline"]["roofline_ms"], 2)
            if "fused_sampling" in result:  # steps queued back to back: the device's time, not the host's
                result["roofline"]["queued_decode_sample_over_roofline"] = round(
                    result["fused_sampling"]["queued_ms_mean"] / result["roofline"]["roofline_ms"], 2)
        result["memory_end"] = memory_snapshot()
    save()


# ---- driver --------------------------------------------------------------------------------------------

def metadata(args: argparse.Namespace, compute_dtype: str, dtype_reason: str) -> dict[str, Any]:
    import jax
    import jaxlib

    device = jax.devices()[0]
    return {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        # A copy of the tree without .git (the GPU machine's) passes the commit in the environment.
        "git_commit": git_commit(env="SLOTSERVE_GIT_COMMIT"),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None),
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "host_cpus": os.cpu_count(),
        "host": host(),
        "model": args.model or args.config,
        "random_weights": bool(args.random_weights or not args.model),
        "layers_override": args.layers,
        "dtype": compute_dtype,
        "dtype_reason": dtype_reason,
        "slots": args.slots,
        "max_len": args.max_len,
        "chunk_sizes": list(args.chunk_sizes),
        "contexts": args.contexts,
        "attention_buckets": args.attention_buckets,
        "verify_width": args.verify_width,
        "steps": args.steps,
        "warm_steps": args.warm_steps,
        "sampler": f"plain sampling (needs_full=False), temperature {args.temperature}, in the timed step: "
                   "one fused program where the engine has it (serving_step), else engine.decode + engine.sample",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "compile_cache": args.compile_cache,
    }


def default_out(args: argparse.Namespace, backend: str) -> Path:
    name = args.model if args.model and "/" not in args.model else Path(args.model or args.config).stem
    parts = ["engine", backend, name]
    if args.layers:
        parts.append(f"L{args.layers}")
    if args.compare:
        parts.append("compare")
    if args.precision != ["float"]:
        parts.append("-".join(args.precision))
    return RESULTS / ("-".join(parts) + ".json")


def compare_ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each variant's times over the first's (float32, plain KV), measured interleaved in the same process;
    p50 ratios and min ratios (the min is the least disturbed by other load on the host)."""
    base = runs[0]
    rows = []
    for run in runs:
        row: dict[str, Any] = {"variant": f"{run['dtype']}/{run['kv_dtype']}/{run.get('precision', 'float')}"}
        row["bytes_per_slot"] = round(run["bytes_per_slot"] / base["bytes_per_slot"], 3)
        row["param_bytes"] = round(run["param_bytes"] / base["param_bytes"], 3)
        row["compile_seconds"] = round(run["compile_seconds"] / base["compile_seconds"], 2)
        for mine, theirs in zip(run.get("decode", []), base.get("decode", []), strict=True):
            key = f"decode_ctx{mine['context']}_active{mine['active_slots']}"
            row[key + "_p50"] = round(mine["ms_p50"] / theirs["ms_p50"], 2)
            row[key + "_min"] = round(mine["ms_min"] / theirs["ms_min"], 2)
        for mine, theirs in zip(run.get("prefill", []), base.get("prefill", []), strict=True):
            row[f"prefill_chunk{mine['chunk']}_p50"] = round(mine["ms_p50"] / theirs["ms_p50"], 2)
            row[f"prefill_chunk{mine['chunk']}_min"] = round(mine["ms_min"] / theirs["ms_min"], 2)
        if "breakdown" in run and "breakdown" in base:
            for key in ("decode_only_ms_p50", "decode_only_ms_min", "sample_only_ms_p50", "sample_only_ms_min"):
                row[key.replace("_ms", "")] = round(run["breakdown"][key] / base["breakdown"][key], 2)
        rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help='a checkpoint ("default": the packaged Gemma 3 270M GGUF); needs gguf')
    src.add_argument("--config", help="an HF-style text config JSON (implies --random-weights)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights of the model's shapes (always so with --config)")
    p.add_argument("--layers", type=int, default=0, help="keep only the first N layers (smoke runs of big models)")
    p.add_argument("--slots", type=int, default=8, help="KV slots (default 8)")
    p.add_argument("--max-len", type=int, default=8192, help="positions per slot (default 8192)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: core.device.choose_dtype)")
    p.add_argument("--kv-dtype", default=None, help='"int8" or a float dtype (default: the compute dtype)')
    p.add_argument("--precision", default="float",
                   help="weight precision(s), comma-separated: float, w8a8 (several: timed round robin, "
                        "ratios against the first)")
    p.add_argument("--chunk-sizes", default="32,128,512", help="prefill chunk sizes (default 32,128,512)")
    p.add_argument("--contexts", default="512,4096",
                   help="decode positions (default 512,4096); clamped below max_len (the cost does not depend on it)")
    p.add_argument("--attention-buckets", default=None,
                   help="decode attention buckets below max_len, e.g. 1024 (default: the engine's, powers of two "
                        "from 1024); fewer buckets compile fewer programs")
    p.add_argument("--verify-width", type=int, default=None,
                   help="speculative verify width (default: the engine's; 0 compiles no verify program)")
    p.add_argument("--fused-sampling", action="store_true",
                   help="sample inside the decode program (EngineConfig.fused_sampling) and time it against two calls")
    p.add_argument("--int4-ple", action="store_true",
                   help="Gemma 4's per-layer-embedding table as packed int4 (core.weights.to_int4_ple)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (default: 16 on CPU, 100 otherwise)")
    p.add_argument("--warm-steps", type=int, default=2, help="untimed decode steps before each timing")
    p.add_argument("--prefill-chunks", type=int, default=None,
                   help="timed chunks per chunk size (default: 3 on CPU, 10 otherwise; 0 skips prefill)")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="skip timing engine.decode alone and engine.sample alone")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of every slot (0: greedy)")
    p.add_argument("--hbm-gbps", type=float, default=4800.0, help="memory bandwidth for the roofline (H200: 4800)")
    p.add_argument("--force-roofline", action="store_true", help="report the roofline on CPU too")
    p.add_argument("--compare", action="store_true",
                   help="float32 vs bfloat16 x plain vs int8 KV in one process, ratios against float32/plain")
    p.add_argument("--init", choices=("device", "host"), default="device",
                   help="random weights: generated on the device, or core.weights.random_params on the host")
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-cache", action="store_true",
                   help="use the persistent compile cache (compile_seconds then measures cache loads)")
    p.add_argument("--platform", default=None, help="JAX platform (cpu, cuda, ...)")
    p.add_argument("--out", default=None,
                   help="result file (default: benchmarks/results/engine-<backend>-<model>.json)")
    args = p.parse_args(argv)
    args.chunk_sizes = tuple(int(x) for x in args.chunk_sizes.split(","))
    args.contexts = [int(x) for x in args.contexts.split(",")]
    if args.attention_buckets is not None:
        args.attention_buckets = tuple(int(x) for x in args.attention_buckets.split(",") if x.strip())
    args.precision = [x.strip() for x in args.precision.split(",") if x.strip()]
    if args.config:
        args.random_weights = True
    if args.kv_dtype in ("plain", "none", "compute"):
        args.kv_dtype = None
    return args


def apply_platform_defaults(args: argparse.Namespace, on_cpu: bool) -> None:
    """Fill the options whose default depends on the platform (a CPU step is ~50x a GPU's) and clamp the
    contexts below max_len."""
    if args.steps is None:
        args.steps = 16 if on_cpu else 100
    if args.prefill_chunks is None:
        args.prefill_chunks = 3 if on_cpu else 10
    args.contexts = sorted({min(c, args.max_len - 1) for c in args.contexts})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from core.device import configure_environment

    configure_environment(args.platform)
    import jax

    from core.compile_cache import enable_compile_cache
    from core.device import choose_dtype

    if args.compile_cache:
        enable_compile_cache()
    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    apply_platform_defaults(args, on_cpu)

    if args.compare:
        variants = [("float32", None), ("float32", "int8"), ("bfloat16", None), ("bfloat16", "int8")]
        compute, reason = "float32", "--compare baseline"
    else:
        compute, reason = choose_dtype(args.dtype)
        kv = None if args.kv_dtype == compute else args.kv_dtype
        variants = [(compute, kv)]
    variants = [(dtype, kv, precision) for precision in args.precision for dtype, kv in variants]
    out = Path(args.out) if args.out else default_out(args, backend)
    report: dict[str, Any] = {"meta": metadata(args, compute, reason), "runs": []}

    def save() -> None:
        save_report(out, report, echo=False)

    log(f"backend {backend} ({jax.devices()[0].device_kind}), writing {out}")
    models: dict[str, dict[str, Any]] = {}
    engines = []
    for dtype, kv_dtype, precision in variants:
        if dtype not in models:
            log(f"building the model in {dtype}")
            models[dtype] = build_model(args, dtype)
            if models[dtype]["raw_config"] is not None:
                report["meta"]["config"] = models[dtype]["raw_config"]
        if (dtype, precision) not in models:
            models[dtype, precision] = with_precision(models[dtype], precision, args.int4_ple)
            if len(args.precision) == 1 and models[dtype, precision]["params"] is not models[dtype]["params"]:
                models[dtype]["params"] = None  # no other variant needs it; alive, it would count in the memory
        result: dict[str, Any] = {"dtype": dtype, "kv_dtype": kv_dtype or dtype, "precision": precision}
        report["runs"].append(result)
        engines.append(setup_variant(args, dtype, kv_dtype, models[dtype, precision], result))
        save()
    measure(args, engines, report["runs"], save)
    if len(report["runs"]) > 1:
        report["ratios_vs_float32_plain" if args.compare else "ratios_vs_first"] = compare_ratios(report["runs"])
        report["meta"]["note"] = (
            "all variants are alive at once and timed step by step in turn (round robin); ratios are time "
            "(or size) over float32 / plain KV; memory figures are process-wide (cumulative over variants)")
    save_report(out, report)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
