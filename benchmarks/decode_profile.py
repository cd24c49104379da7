"""Where a decode step's time goes: wall time of `Engine.decode` against the device time of its ops.

Builds one model (the same flags as benchmarks/engine.py: --config, --layers, --dtype, --precision ...), an
engine with only the decode programs it times, runs `--steps` decode steps with all slots active under
`jax.profiler`, and summarises the trace: per step, wall time, device busy time (the union of op intervals
on the device's streams), op count, and the ops that take most of it. On a GPU the gap between wall and busy
time is launch and host overhead; on CPU the "device" is the XLA host threads.

    python3 benchmarks/decode_profile.py --config configs/models/gemma4-e2b.json --out prof.json

Besides benchmarks/engine.py's flags: --trace-steps N (10), --top N (30 ops listed), --save-trace PATH (the
perfetto trace, gzipped JSON, for ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import engine as bench  # noqa: E402
from benchmarks.common import save_report  # noqa: E402


def device_processes(trace: dict[str, Any]) -> dict[int, str]:
    """pid -> name of the trace's processes that run compiled ops (GPU streams, or XLA's CPU threads)."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid: name for pid, name in names.items() if "GPU" in name or "gpu" in name}
    return gpu or names


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlapping streams count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarise(trace: dict[str, Any], steps: int, top: int) -> dict[str, Any]:
    pids = device_processes(trace)
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e]
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in ops:
        by_name[e["name"]].append(e["dur"])
    total = sum(sum(d) for d in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "processes": sorted(set(pids.values())),
        "ops_per_step": round(len(ops) / steps, 1),
        "op_time_per_step_ms": round(total / steps / 1e3, 3),
        "busy_per_step_ms": round(busy_time([(e["ts"], e["ts"] + e["dur"]) for e in ops]) / steps / 1e3, 3),
        "top_ops": [{"name": name[:160], "calls_per_step": round(len(d) / steps, 2),
                     "ms_per_step": round(sum(d) / steps / 1e3, 4),
                     "share": round(sum(d) / total, 4) if total else None} for name, d in ranked],
    }


def split_extra_flags(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """This script's own flags, taken out of ``argv`` so that the rest goes to benchmarks/engine.py's parser:
    (what is left, {"--top": ..., "--trace-steps": ..., "--save-trace": ...})."""
    argv = list(argv)
    extra: dict[str, Any] = {"--top": 30, "--trace-steps": 10, "--save-trace": None}
    for flag in list(extra):
        if flag in argv:
            i = argv.index(flag)
            extra[flag] = argv[i + 1] if flag == "--save-trace" else int(argv[i + 1])
            del argv[i:i + 2]
    return argv, extra


def build_engine(args: argparse.Namespace, dtype: str, trace_steps: int) -> tuple[Any, int]:
    """An engine with only the decode programs timed here (one chunk size, no verify program), and the
    context the steps start at: low enough that every untimed, timed and traced step fits below max_len."""
    from core.engine import Engine, EngineConfig

    model = bench.with_precision(bench.build_model(args, dtype), args.precision[0])
    context = min(args.contexts[-1], args.max_len - 1 - args.steps - args.warm_steps - trace_steps)
    buckets = args.attention_buckets if args.attention_buckets is not None else ()
    engine = Engine(model["cfg"], model["params"],
                    EngineConfig(num_slots=args.slots, max_len=args.max_len, chunk_sizes=(args.chunk_sizes[0],),
                                 attention_buckets=buckets, verify_width=0, kv_dtype=args.kv_dtype), dtype)
    return engine, context


def decode_stepper(engine: Any, context: int) -> Callable[[], None]:
    """A decode step of every slot per call, waited for, each call one position further than the last."""
    import jax
    import numpy as np

    s = engine.num_slots
    tokens, active = np.zeros(s, np.int32), np.ones(s, bool)
    position = context

    def step() -> None:
        nonlocal position
        jax.block_until_ready(engine.decode(tokens, np.full(s, position, np.int32), active))
        position += 1

    return step


def time_steps(step: Callable[[], None], warm_steps: int, steps: int) -> tuple[float, list[float]]:
    """Seconds of the first step (it compiles the program), then, after ``warm_steps`` untimed steps, the
    wall milliseconds of each of ``steps`` steps."""
    begin = time.perf_counter()
    step()
    compile_s = time.perf_counter() - begin
    for _ in range(warm_steps):
        step()
    walls = []
    for _ in range(steps):
        begin = time.perf_counter()
        step()
        walls.append((time.perf_counter() - begin) * 1e3)
    return compile_s, walls


def profile_steps(step: Callable[[], None], steps: int, save_to: str | None) -> tuple[float, dict[str, Any]]:
    """``steps`` steps under jax.profiler: wall milliseconds per step while tracing, and the perfetto trace
    (also written to ``save_to`` as it came, gzipped, when given)."""
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        begin = time.perf_counter()
        for _ in range(steps):
            step()
        traced_ms = (time.perf_counter() - begin) * 1e3 / steps
        jax.profiler.stop_trace()
        found = sorted(Path(tmp).rglob("perfetto_trace.json.gz"))
        if not found:
            raise SystemExit(f"no perfetto trace under {tmp}")
        raw = found[-1].read_bytes()
        if save_to:
            Path(save_to).write_bytes(raw)
        return traced_ms, json.loads(gzip.decompress(raw))


def print_summary(report: dict[str, Any], traced_ms: float) -> None:
    """The headline figures and the 15 costliest ops, on stderr."""
    t = report["trace"]
    print(f"wall p50 {report['wall_ms_p50']} ms, traced {traced_ms:.3f} ms/step; "
          f"device busy {t['busy_per_step_ms']} ms, op time {t['op_time_per_step_ms']} ms, "
          f"{t['ops_per_step']} ops/step", file=sys.stderr)
    for op in t["top_ops"][:15]:
        print(f"  {op['ms_per_step']:8.3f} ms  x{op['calls_per_step']:<6} {op['name'][:100]}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_extra_flags(sys.argv[1:] if argv is None else argv)
    args = bench.parse_args(argv)
    from core.device import configure_environment

    configure_environment(args.platform)
    import jax
    import numpy as np

    bench.apply_platform_defaults(args, jax.default_backend() == "cpu")

    from core.device import choose_dtype

    dtype, reason = choose_dtype(args.dtype)
    engine, context = build_engine(args, dtype, extra["--trace-steps"])
    step = decode_stepper(engine, context)
    compile_s, walls = time_steps(step, args.warm_steps, args.steps)
    traced_ms, trace = profile_steps(step, extra["--trace-steps"], extra["--save-trace"])
    walls.sort()
    report = {
        "meta": bench.metadata(args, dtype, reason),
        "context": context,
        "bucket": int(engine.bucket_for(np.array([context]))),
        "compile_seconds": round(compile_s, 2),
        "wall_ms_p50": round(walls[len(walls) // 2], 3) if walls else None,
        "wall_ms_min": round(walls[0], 3) if walls else None,
        "traced_wall_ms_per_step": round(traced_ms, 3),
        "trace": summarise(trace, extra["--trace-steps"], extra["--top"]),
    }
    save_report(args.out or bench.RESULTS / "decode-profile.json", report, echo=False)
    print_summary(report, traced_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
