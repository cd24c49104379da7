#!/usr/bin/env python3
"""The decode step compiled from its exported module (what the engine runs, `core.programs`) against the same
step lowered directly by jax.jit, in one process, rounds alternating A B A B so drift cancels: step time and
whether the logits agree bit for bit.

    .venv/bin/python benchmarks/exported_programs.py                # the served CPU defaults
    .venv/bin/python benchmarks/exported_programs.py --steps 20 --rounds 4

Default model, the server's precision and KV dtype for this device, 8 slots all active, attention bucket 1024,
each slot at position 512. Writes benchmarks/results/exported-programs-cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import git_commit, host, save_report  # noqa: E402
from core.compile_cache import enable_compile_cache  # noqa: E402
from core.device import choose_kv_dtype, default_cache_dir  # noqa: E402
from core.engine import Engine, EngineConfig  # noqa: E402
from core.runtime import load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "exported-programs-cpu.json")
    args = parser.parse_args()
    enable_compile_cache()
    model = load_model("default", precision=None, weights_cache=default_cache_dir() / "weights")
    kv_dtype, _ = choose_kv_dtype(None, model.precision)
    engine = Engine(model.cfg, model.params, EngineConfig(kv_dtype=kv_dtype), model.dtype)
    key = ("decode", engine.buckets[0])
    program = engine.programs[key]
    abstract_args = engine._example_args(key)
    exported = program  # compiled through its exported module, as the engine serves
    exported.compile(*abstract_args)
    direct = program._fn.lower(*abstract_args).compile()  # the same jitted step, no export
    packed = np.stack([np.full(8, 818), np.full(8, 512), np.ones(8)]).astype(np.int32)

    def run(fn) -> tuple[list[float], np.ndarray]:
        times, logits = [], None
        for _ in range(args.steps):
            begin = time.perf_counter()
            logits, engine.cache = fn(engine.params, engine.cache, packed)
            logits.block_until_ready()
            times.append((time.perf_counter() - begin) * 1e3)
        return times, np.asarray(logits)

    run(exported)
    run(direct)  # first calls of each: not timed
    samples: dict[str, list[float]] = {"exported": [], "direct": []}
    same = True
    for _ in range(args.rounds):
        for name, fn in (("exported", exported), ("direct", direct)):
            times, logits = run(fn)
            samples[name] += times
        # The same inputs give the same logits through both: every step writes the same KV at the same place.
        same &= bool(np.array_equal(run(exported)[1], run(direct)[1]))
    report = {"meta": {"command": "benchmarks/exported_programs.py " + " ".join(sys.argv[1:]), "host": host(),
                       "git_commit": git_commit(mark_dirty=True), "jax": jax.__version__,
                       "config": f"default model, precision {model.precision}, KV {kv_dtype}, 8 slots active, "
                                 f"bucket {key[1]}, position 512"},
              "decode_step_ms_p50": {k: round(statistics.median(v), 2) for k, v in samples.items()},
              "decode_step_ms_mean": {k: round(statistics.fmean(v), 2) for k, v in samples.items()},
              "ratio_exported_over_direct_p50": round(statistics.median(samples["exported"])
                                                      / statistics.median(samples["direct"]), 3),
              "logits_bit_identical": same}
    save_report(args.out, report, indent=1)


if __name__ == "__main__":
    main()
