#!/usr/bin/env python3
"""The decode step compiled from its exported module (what the engine runs, `core.programs`) against the same
step lowered directly by jax.jit, in one process, rounds alternating so drift cancels: step time and whether
the logits agree bit for bit. With --restart, first the program store's life on this backend: an engine warms
up in the background (the first programs now, the rest on its thread) into an empty program store and XLA
cache, then a second engine (a restart) reads every program back from both; the step then compares three
ways: exported fresh, read back from the store, lowered directly.

    .venv/bin/python benchmarks/exported_programs.py                # the served CPU defaults
    .venv/bin/python benchmarks/exported_programs.py --steps 20 --rounds 4
    python3 benchmarks/exported_programs.py --config configs/models/gemma3-270m.json --restart \\
        --out benchmarks/results/exported-programs-gpu-gemma3-270m.json    # random weights, e.g. on a GPU

Default: the default model, the server's precision and KV dtype for this device; --config: random weights of
that config in the device's compute dtype. 8 slots all active, attention bucket 1024, each slot at
position 512. Writes benchmarks/results/exported-programs-cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.device import configure_environment  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "exported-programs-cpu.json"
POSITION = 512  # every slot's position in the timed steps


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", type=Path, help="an HF-style text config: random weights of its shapes")
    parser.add_argument("--layers", type=int, default=0, help="with --config: keep only the first N layers")
    parser.add_argument("--max-len", type=int, default=8192, help="positions per slot (default 8192)")
    parser.add_argument("--buckets", default=None, help="attention buckets, e.g. 1024,8192 (default: the engine's)")
    parser.add_argument("--restart", action="store_true",
                        help="background warm-up into an empty program store, then a second engine reading it back")
    parser.add_argument("--platform", default=None, help="JAX platform (cpu, cuda, ...)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser.parse_args()


def build_model(args: argparse.Namespace) -> dict[str, Any]:
    """cfg, params, dtype, KV dtype and a description: the default model as served, or random weights."""
    from core.device import choose_dtype, choose_kv_dtype, default_cache_dir

    if args.config is None:
        from core.runtime import load_model  # imports the GGUF reader, which a GPU machine may lack

        model = load_model("default", precision=None, weights_cache=default_cache_dir() / "weights")
        kv_dtype, _ = choose_kv_dtype(None, model.precision)
        return {"cfg": model.cfg, "params": model.params, "dtype": model.dtype, "kv_dtype": kv_dtype,
                "label": f"default model, precision {model.precision}, KV {kv_dtype or model.dtype}"}
    from benchmarks.engine import build_model as random_model

    dtype, _ = choose_dtype(None)
    spec = argparse.Namespace(model=None, config=str(args.config), random_weights=True, layers=args.layers,
                              init="device", seed=0, std=0.02)
    built = random_model(spec, dtype)
    return {"cfg": built["cfg"], "params": built["params"], "dtype": dtype, "kv_dtype": None,
            "label": f"{args.config.name}, random weights, {dtype}, KV {dtype}"}


def make_engine(args: argparse.Namespace, model: dict[str, Any], store: Any = None) -> Any:
    from core.engine import Engine, EngineConfig

    buckets = tuple(int(b) for b in args.buckets.split(",")) if args.buckets else None
    config = EngineConfig(max_len=args.max_len, kv_dtype=model["kv_dtype"], attention_buckets=buckets)
    return Engine(model["cfg"], model["params"], config, model["dtype"], program_store=store)


def restart_check(args: argparse.Namespace, model: dict[str, Any], store_dir: Path) -> tuple[dict[str, Any], Any]:
    """A first start warming up in the background into an empty store, then a restart reading it back;
    returns what each saw and the restarted engine."""
    from core.program_store import ProgramStore

    first = make_engine(args, model, ProgramStore(store_dir))
    begin = time.perf_counter()
    ready_s = first.warmup(background=True)
    first.programs.background.join()
    first_start = {"ready_s": round(ready_s, 2), "all_compiled_s": round(time.perf_counter() - begin, 2),
                   **first.programs.counts()}
    again = make_engine(args, model, ProgramStore(store_dir))
    restart_s = again.warmup()
    restart = {"all_compiled_s": round(restart_s, 2), **again.programs.counts()}
    return {"first_start": first_start, "restart": restart}, again


def time_steps(fn: Callable[..., Any], engine: Any, packed: Any, steps: int) -> tuple[list[float], Any]:
    """ms per decode call over `steps` calls, and the last logits (host array)."""
    import numpy as np

    times, logits = [], None
    for _ in range(steps):
        begin = time.perf_counter()
        logits, engine.cache = fn(engine.params, engine.cache, packed)
        logits.block_until_ready()
        times.append((time.perf_counter() - begin) * 1e3)
    return times, np.asarray(logits)


def compare(variants: dict[str, Callable[..., Any]], engine: Any, steps: int, rounds: int) -> dict[str, Any]:
    """Each variant's decode step timed in alternating rounds; whether all give the same logits for the
    same inputs (every step writes the same KV at the same place, so repeated calls are comparable)."""
    import numpy as np

    from core.engine import _decode_inputs

    slots = engine.num_slots
    packed = _decode_inputs(np.full(slots, 818), np.full(slots, POSITION), np.ones(slots), engine.slot_adapters)
    for fn in variants.values():
        time_steps(fn, engine, packed, 1)  # first calls: not timed
    samples: dict[str, list[float]] = {name: [] for name in variants}
    same = True
    for _ in range(rounds):
        last = {}
        for name, fn in variants.items():
            times, last[name] = time_steps(fn, engine, packed, steps)
            samples[name] += times
        first, *rest = last.values()
        same &= all(np.array_equal(first, other) for other in rest)
    p50 = {k: round(statistics.median(v), 3) for k, v in samples.items()}
    return {"decode_step_ms_p50": p50, "decode_step_ms_mean": {k: round(statistics.fmean(v), 3)
                                                                for k, v in samples.items()},
            "ratio_exported_over_direct_p50": round(p50["exported"] / p50["direct"], 3),
            "logits_bit_identical": bool(same)}


def main() -> None:
    args = parse_args()
    configure_environment(args.platform)
    import jax

    from benchmarks.common import git_commit, host, save_report
    from core.compile_cache import enable_compile_cache

    model = build_model(args)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        if args.restart:  # a cold store and XLA cache, then warm ones: what a first start and a restart see
            enable_compile_cache(Path(scratch) / "xla")
            report["program_store"], engine = restart_check(args, model, Path(scratch) / "programs")
        else:
            enable_compile_cache()
            engine = make_engine(args, model)
        key = ("decode", engine.buckets[0])
        program = engine.programs[key]  # compiled through its exported module, as the engine serves
        abstract_args = engine._example_args(key)
        program.compile(*abstract_args)
        variants = {"exported": program, "direct": program._fn.lower(*abstract_args).compile()}
        report.update(compare(variants, engine, args.steps, args.rounds))
    report["meta"] = {"command": "benchmarks/exported_programs.py " + " ".join(sys.argv[1:]), "host": host(),
                      "git_commit": git_commit(mark_dirty=True, env="SLOTSERVE_GIT_COMMIT"), "jax": jax.__version__,
                      "backend": jax.default_backend(), "device": str(jax.devices()[0]),
                      "config": f"{model['label']}, {engine.num_slots} slots active, bucket {key[1]}, "
                                f"position {POSITION}"}
    save_report(args.out, report, indent=1)


if __name__ == "__main__":
    main()
