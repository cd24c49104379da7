#!/usr/bin/env python3
"""What LoRA adapter slots cost the engine (issue #31, docs/lora.md): decode step and prefill on the default
model without adapter slots, with slots but no row using one, with 8 rows each under its own rank-16 adapter
on all seven projections, and with 8 rows sharing one (slots in the compute dtype, and the last two again with
bfloat16 slots, `adapters.dtype`); the form a decode step under 8 adapters takes; the device bytes per adapter
slot; the time to load one
adapter into a slot (the engine call the admin API ends in); and through HTTP (`slotserve serve` with an
adapter directory): vLLM's load route per adapter, and the first request of each new adapter agent (its slot
load included) against its second.

    python3 benchmarks/lora.py                      # the packaged Gemma 3 270M, CPU serving defaults

The configurations are timed in alternating rounds (one round: a few steps of each), so host noise falls on
all of them alike; ratios are against the adapter-free engine of the same run. Random adapters (not trained
ones): their values do not change the work. Prints JSON and writes benchmarks/results/lora-cpu.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    bench_server,
    default_gguf,
    dist_ms,
    free_port,
    git_commit,
    host,
    log,
    save_report,
    wait_healthy,
)

RANK = 16


def random_adapter(cfg: Any, seed: int) -> Any:
    import numpy as np

    from core.lora import LoraAdapter, adapted_projections

    rng = np.random.default_rng(seed)
    pairs = {key: (rng.standard_normal((RANK, i)).astype(np.float32) * 0.01,
                   rng.standard_normal((o, RANK)).astype(np.float32) * 0.01)
             for key, (i, o) in adapted_projections(cfg).items()}
    return LoraAdapter(Path(f"random-{seed}"), RANK, 2.0, pairs)


SLOT_ENGINES = {"slots": None, "slots-bfloat16": "bfloat16"}  # engine name -> EngineConfig.adapter_dtype


def build(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The model, and engines: "plain" (no adapter slots), "slots" (8 slots of rank 16 in the compute dtype)
    and "slots-bfloat16" (the same in bfloat16, `EngineConfig.adapter_dtype`)."""
    from core.device import choose_kv_dtype
    from core.engine import Engine, EngineConfig
    from core.runtime import load_model

    model = load_model(args.model or default_gguf(), precision=None)  # None: the serving default per device
    kv_dtype, _ = choose_kv_dtype(None, model.precision)
    config = dict(num_slots=8, max_len=args.max_len, chunk_sizes=(args.chunk,), kv_dtype=kv_dtype,
                  attention_buckets=(), verify_width=0)
    engines = {"plain": Engine(model.cfg, model.params, EngineConfig(**config), model.dtype),
               **{name: Engine(model.cfg, model.params,
                               EngineConfig(**config, adapter_slots=8, adapter_rank=RANK, adapter_dtype=dtype),
                               model.dtype) for name, dtype in SLOT_ENGINES.items()}}
    for engine in engines.values():
        engine.warmup()
    return model, engines


def write_peft_adapter(directory: Path, cfg: Any, seed: int) -> None:
    """A random rank-RANK adapter in PEFT's file layout (adapter_config.json + adapter_model.safetensors)."""
    import json

    from safetensors.numpy import save_file

    from core.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, TARGETS

    adapter = random_adapter(cfg, seed)
    tensors = {}
    for (layer, target), (a, b) in adapter.pairs.items():
        prefix = f"base_model.model.model.layers.{layer}.{TARGETS[target]}.{target}"
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))
    (directory / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK,
                                                        "target_modules": sorted(TARGETS)}))


def http_phase(cfg: Any, count: int) -> dict[str, Any]:
    """`slotserve serve` with an adapter directory of ``count`` adapters: each loaded through vLLM's route,
    then two greedy one-token requests to each new agent (the first loads its adapter into a slot)."""
    import tempfile

    import httpx

    root = Path(tempfile.mkdtemp())
    for i in range(count):
        write_peft_adapter(root / f"a{i}", cfg, seed=100 + i)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with bench_server(ROOT, port, max_tokens=8, model_settings=f"adapters:\n  dirs: [{root}]\n") as proc:
        wait_healthy(url, proc, None, "/ready", timeout=1800, every_program=True)
        route, first, second = [], [], []
        body = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 1, "temperature": 0}
        for i in range(count):
            begin = time.perf_counter()
            r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": f"a{i}", "lora_path": f"a{i}"},
                           timeout=300)
            route.append(time.perf_counter() - begin)
            r.raise_for_status()
        for i in range(count):
            for times in (first, second):
                begin = time.perf_counter()
                httpx.post(f"{url}/v1/chat/completions", json={**body, "model": f"a{i}"},
                           timeout=300).raise_for_status()
                times.append(time.perf_counter() - begin)
    return {"load_route_ms": dist_ms(route), "first_request_ms": dist_ms(first), "second_request_ms": dist_ms(second),
            "notes": "load route: read and check the adapter, store the agent; the engine slot is written at the "
                     "agent's first request (first minus second request is that load and its first programs)"}


def decode_ms(engine: Any, position: int, steps: int) -> list[float]:
    import jax
    import numpy as np

    tokens, active = np.zeros(8, np.int32), np.ones(8, bool)
    walls = []
    for i in range(steps):
        begin = time.perf_counter()
        jax.block_until_ready(engine.decode(tokens, np.full(8, position + i, np.int32), active))
        walls.append((time.perf_counter() - begin) * 1e3)
    return walls


def prefill_ms(engine: Any, chunk: int) -> float:
    import jax
    import numpy as np

    tokens = np.arange(1000, 1000 + chunk, dtype=np.int32)
    begin = time.perf_counter()
    jax.block_until_ready(engine.prefill(0, tokens, 0))
    return (time.perf_counter() - begin) * 1e3


def read_gb_s(nbytes: int, repeats: int = 10) -> float:
    """How fast one program streams ``nbytes`` of float32 from memory on this host (a sum), GB/s: what a
    decode step that reads every adapter slot's matrices once cannot beat."""
    import jax
    import jax.numpy as jnp

    data = jnp.ones(nbytes // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    total(data).block_until_ready()
    walls = []
    for _ in range(repeats):
        begin = time.perf_counter()
        total(data).block_until_ready()
        walls.append(time.perf_counter() - begin)
    return nbytes / statistics.median(walls) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint (default: the packaged Gemma 3 270M GGUF)")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk size timed")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="decode steps per configuration per round")
    p.add_argument("--http-adapters", type=int, default=8, help="adapters loaded through HTTP (0: no HTTP phase)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from core.engine import NO_ADAPTER

    log("loading the model and compiling both engines")
    model, engines = build(args)
    slots = engines["slots"]
    adapters = [random_adapter(model.cfg, seed) for seed in range(8)]
    load_s = []
    for index, adapter in enumerate(adapters):
        begin = time.perf_counter()
        slots.load_adapter(index, adapter)
        load_s.append(time.perf_counter() - begin)
        engines["slots-bfloat16"].load_adapter(index, adapter)
    cases = {"no adapter slots": ("plain", [NO_ADAPTER] * 8), "slots, no row adapted": ("slots", [NO_ADAPTER] * 8),
             "8 rows, 8 adapters": ("slots", list(range(8))), "8 rows, 1 shared adapter": ("slots", [0] * 8),
             "bfloat16 slots, 8 rows, 8 adapters": ("slots-bfloat16", list(range(8))),
             "bfloat16 slots, 8 rows, 1 shared adapter": ("slots-bfloat16", [0] * 8)}
    decode: dict[str, list[float]] = {name: [] for name in cases}
    prefill: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}")
        for name, (which, rows) in cases.items():
            engine = engines[which]
            for slot, index in enumerate(rows):
                if engine.config.adapter_slots:
                    engine.use_adapter(slot, index)
            decode_ms(engine, 600, 1)  # untimed: the step after a switch
            decode[name] += decode_ms(engine, 600, args.steps)
            prefill[name].append(prefill_ms(engine, args.chunk))
    base_decode = statistics.median(decode["no adapter slots"])
    adapter_bytes = 8 * slots.adapter_bytes_per_slot
    bandwidth = read_gb_s(adapter_bytes)
    base_prefill = statistics.median(prefill["no adapter slots"])
    report = {
        "benchmark": "lora", "commit": git_commit(), "host": host(), "model": str(args.model or "default GGUF"),
        "precision": model.precision, "dtype": model.dtype, "kv_dtype": slots.spec.dtype, "rank": RANK,
        "adapter_slots": 8, "targets": "q,k,v,o,gate,up,down on every layer",
        "adapter_bytes_per_slot": slots.adapter_bytes_per_slot,
        "adapter_bytes_per_slot_bfloat16": engines["slots-bfloat16"].adapter_bytes_per_slot,
        "load_adapter_ms": dist_ms(load_s),
        "decode_step_ms": {name: dist_ms([w / 1e3 for w in walls]) for name, walls in decode.items()},
        "decode_ratio_p50": {name: round(statistics.median(w) / base_decode, 3) for name, w in decode.items()},
        "decode_form_8_adapters": {name: engines[name].slot_batched_lora[0] if engines[name].slot_batched_lora
                                   else "per-slot pairs" for name in SLOT_ENGINES},
        "read_floor": {"adapter_bytes_8_slots": adapter_bytes, "read_gb_s": round(bandwidth, 1),
                       "read_ms": round(adapter_bytes / bandwidth / 1e6, 2),
                       "decode_ratio_bound": round(1 + adapter_bytes / bandwidth / 1e6 / base_decode, 3),
                       "notes": "a step under 8 different adapters reads all 8 slots' matrices: at this host's "
                                "streaming rate that alone bounds its ratio from below"},
        f"prefill_{args.chunk}_ms": {name: dist_ms([w / 1e3 for w in walls]) for name, walls in prefill.items()},
        "prefill_tokens_per_s_p50": {name: round(args.chunk / statistics.median(w) * 1e3, 1)
                                     for name, w in prefill.items()},
        "prefill_ratio_p50": {name: round(statistics.median(w) / base_prefill, 3) for name, w in prefill.items()},
        "notes": "decode: 8 slots active, engine.decode only (no sampler), context ~600; prefill: one chunk into "
                 "slot 0 under slot 0's adapter; rounds alternate the configurations",
    }
    out = args.out or ROOT / "benchmarks" / "results" / "lora-cpu.json"
    save_report(out, report, echo=False)
    if args.http_adapters:
        del engines, slots  # the server is another process: give it the memory
        log("through HTTP: slotserve serve with an adapter directory")
        report["http"] = http_phase(model.cfg, args.http_adapters)
    save_report(out, report)


if __name__ == "__main__":
    main()
