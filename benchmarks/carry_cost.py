#!/usr/bin/env python3
"""What a carried prompt chunk adds to a decode step, by its padded width: the default model's (W8A8 weights,
int8 KV, 8 slots x 8192) decode step of 7 decoding rows at the 2,048 bucket alone, then carrying one slot's
chunk of each width (`core.model.decode_with_chunk`), the programs called in turn so the host's drift hits all
alike. The figures behind `EngineConfig.carry_sizes`.

    python3 benchmarks/carry_cost.py [--widths 16,32,48,64] [--calls 15] [--out PATH]

Prints the JSON and writes benchmarks/results/carry-cost-cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import default_gguf, git_commit, host, medians_in_turn, save_report, versions  # noqa: E402

SLOTS = 8
MAX_LEN = 8192
BUCKET = 2048
CHUNK_START = 1450  # the carried slot's position: the decode rows sit at 1400-1491, all inside the bucket


def step_programs(widths: list[int]) -> tuple[Any, dict[str, tuple[Any, tuple[Any, ...]]]]:
    """(call, name -> (jitted program, its arguments after params and cache)): the decode step alone and
    carrying a chunk of each width (all but the last token real, as a turn's padded tail would be)."""
    from core.device import configure_environment

    configure_environment()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import core.model as m
    from core.kv_cache import CacheSpec, init_cache
    from core.runtime import load_model

    model = load_model(default_gguf(), precision=None)  # None: the serving default (W8A8 on CPU)
    cfg, params = model.cfg, model.params
    state = {"cache": init_cache(cfg, CacheSpec(num_slots=SLOTS, max_len=MAX_LEN, dtype="int8"))}
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, (SLOTS,)), jnp.int32)
    positions = jnp.asarray([1400 + 13 * i for i in range(SLOTS)], jnp.int32)
    active = jnp.asarray([1] * (SLOTS - 1) + [0], jnp.int32)  # the last slot is the carried one

    def decode(p, cache, t, pos):
        return m.decode_step(p, cache, t, pos, active, cfg=cfg, attend=BUCKET)

    def carrying(width: int) -> Any:
        def run(p, cache, t, pos, chunk):
            logits, chunk_logits, cache = m.decode_with_chunk(
                p, cache, t, pos, active, chunk, jnp.asarray([CHUNK_START]), jnp.asarray([width - 1]),
                jnp.asarray([SLOTS - 1]), cfg=cfg, attend=BUCKET)
            return (logits, chunk_logits), cache
        return jax.jit(run, donate_argnums=(1,))

    programs = {"decode": (jax.jit(decode, donate_argnums=(1,)), (tokens, positions))}
    for width in widths:
        chunk = jnp.asarray(rng.integers(2, cfg.vocab_size, (1, width)), jnp.int32)
        programs[f"carry_{width}"] = (carrying(width), (tokens, positions, chunk))

    def call(name: str) -> None:
        program, args = programs[name]
        out, state["cache"] = program(params, state["cache"], *args)
        jax.block_until_ready(out)

    return call, programs


def measure(widths: list[int], calls: int) -> dict[str, Any]:
    call, programs = step_programs(widths)
    for name in programs:  # compiles, and the first call's one-time set-up
        call(name)
    median = medians_in_turn(call, programs, calls)
    return {"median_ms": {name: round(ms, 2) for name, ms in median.items()},
            "added_ms": {name: round(ms - median["decode"], 2) for name, ms in median.items() if name != "decode"},
            "added_ms_per_row": {f"carry_{w}": round((median[f"carry_{w}"] - median["decode"]) / w, 3)
                                 for w in widths}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="16,32,48,64", help="carried chunk widths, comma-separated")
    p.add_argument("--calls", type=int, default=15, help="timed calls of each program")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "carry-cost-cpu.json"))
    args = p.parse_args()
    widths = sorted({int(w) for w in args.widths.split(",") if w.strip()})
    report = {"benchmark": "carry_cost", "commit": git_commit(mark_dirty=True), "host": host(),
              "versions": versions(("jax", "jaxlib")), "argv": sys.argv[1:],
              "workload": f"default model W8A8 + int8 KV, {SLOTS} slots x {MAX_LEN}, {SLOTS - 1} decoding rows at "
                          f"{BUCKET} bucket, one carried chunk at position {CHUNK_START}",
              **measure(widths, args.calls)}
    save_report(args.out, report)


if __name__ == "__main__":
    main()
