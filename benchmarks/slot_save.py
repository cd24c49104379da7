#!/usr/bin/env python3
"""Where a slot save's time goes (`Engine.save_slot`: the KV of a slot's positions copied to host memory).

    python3 benchmarks/slot_save.py --config configs/models/gemma3-270m.json --out RESULT.json

Random weights of the config's shapes in the device's compute dtype, 8 slots x --max-len, transfer sizes
128 and 512 (as on accelerators). Each figure is --repeats times in ms, first call included (fresh host
memory faults in on its first touch): a whole save of 300 and of 100 positions; its parts for the
512-position transfer (the read program run to completion, the copy of its ready result to the host, the
split into per-layer arrays); a fresh host buffer of the transfer's size written once against a reused one
(first-touch page faults); a save issued while a queued decode + sample step runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, git_commit, host, save_report  # noqa: E402


def timings(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        out.append(round((time.perf_counter() - begin) * 1e3, 2))
    return out


def measure(engine: Any, repeats: int) -> dict[str, Any]:
    import jax
    import numpy as np

    from core.engine import _bits, _unpack_positions

    engine.save_slot(0, 0, 300)  # compiles and runs both transfer programs once
    engine.save_slot(0, 0, 100)
    out: dict[str, Any] = {"save_300_positions_ms": timings(lambda: engine.save_slot(1, 0, 300), repeats),
                           "save_100_positions_ms": timings(lambda: engine.save_slot(1, 0, 100), repeats)}
    read = engine.programs["read", 512]
    out["read_program_to_completion_ms"] = timings(
        lambda: jax.block_until_ready(read(engine.cache, np.int32(1), np.int32(0))), repeats)
    ready = iter(jax.block_until_ready([read(engine.cache, np.int32(1), np.int32(0)) for _ in range(repeats)]))
    out["copy_ready_result_to_host_ms"] = timings(lambda: jax.device_get(next(ready)), repeats)
    packed = jax.device_get(read(engine.cache, np.int32(1), np.int32(0)))

    def split() -> None:
        views = _unpack_positions({n: _bits(np.asarray(a)) for n, a in packed.items()}, engine.cache)
        for entry in views.values():
            for a in entry.values():
                np.ascontiguousarray(a[:300])

    out["split_into_layers_ms"] = timings(split, repeats)
    nbytes = sum(a.nbytes for a in packed.values())
    out["transfer_bytes"] = nbytes
    out["fresh_buffer_written_ms"] = timings(lambda: np.ones(nbytes // 2, np.uint16), repeats)
    reused = np.ones(nbytes // 2, np.uint16)
    out["reused_buffer_written_ms"] = timings(lambda: reused.fill(3), repeats)
    rows = engine.num_slots
    tokens, positions = np.ones(rows, np.int32), np.full(rows, 10, np.int32)
    active, steps = np.ones(rows, bool), np.zeros(rows, np.int32)

    def behind_queued_step() -> float:
        pending = engine.dispatch_decode_sample(tokens, positions, active, steps, False)
        begin = time.perf_counter()
        engine.save_slot(1, 0, 300)
        seconds = time.perf_counter() - begin
        pending.result()
        return seconds

    out["save_300_behind_queued_step_ms"] = [round(behind_queued_step() * 1e3, 2) for _ in range(repeats)]
    out["decode_sample_to_tokens_ms"] = timings(
        lambda: engine.dispatch_decode_sample(tokens, positions, active, steps, False).result(), repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/models/gemma3-270m.json", help="an HF-style text config JSON")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from core.device import choose_dtype, configure_environment

    configure_environment()
    import jax

    from benchmarks.engine import device_random_params
    from core.config import ModelConfig
    from core.engine import Engine, EngineConfig
    from core.sampling import SamplingParams

    raw = json.loads(Path(args.config).read_text())
    cfg = ModelConfig.from_hf_dict(raw.get("text_config") or raw)
    dtype, _ = choose_dtype()
    engine = Engine(cfg, device_random_params(cfg, dtype, 0, 0.02),
                    EngineConfig(num_slots=8, max_len=args.max_len, chunk_sizes=(32,), attention_buckets=(),
                                 verify_width=0, fused_sampling=True, transfer_sizes=(128, 512)), dtype)
    for slot in range(engine.num_slots):
        engine.begin_request(slot, SamplingParams(temperature=0.0), [1], 0)
    report = {"command": "benchmarks/slot_save.py " + " ".join(sys.argv[1:]),
              "git_commit": git_commit(mark_dirty=True, env="SLOTSERVE_GIT_COMMIT"), "host": host(),
              "backend": jax.default_backend(), "device": str(jax.devices()[0]), "dtype": dtype,
              "config": args.config, "max_len": args.max_len, "results": measure(engine, args.repeats)}
    save_report(args.out or RESULTS / f"slot-save-{jax.default_backend()}.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
