#!/usr/bin/env python3
"""The scheduler's host work per iteration, without HTTP: N greedy streams driven through the scheduler on
this thread, against the engine's own decode + sample step in the same process.

    .venv/bin/python benchmarks/serving_loop.py --model /tmp/ckpt --streams 8 --max-tokens 256

What it reports: the engine baseline (decode + sample for all slots, ms per step); a timed run (wall per
iteration, and its excess over the baseline step: the host work a step does not overlap; --repeats runs, whose
spread on a shared accelerator host is wide, interleaved with as many without queued steps); a run under
cProfile (this thread only) with the functions that take the most time of their own and the cumulative time
of the loop's parts (plan, execute, update, delivery, the engine's program calls and host copies). For a
device whose step is a few milliseconds (a TPU, a GPU) the excess is what keeps HTTP below the engine's rate.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, git_commit, host, log, save_report  # noqa: E402

# The loop's parts whose cumulative time is reported (function name as cProfile records it).
PARTS = ("plan", "execute", "_update", "_deliver", "after_step", "__call__", "__array__", "_decode_inputs",
         "begin_request", "restore_slot", "save_slot", "_accept", "push")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="a checkpoint (default: the packaged GGUF)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024, help="positions per slot (one attention bucket)")
    p.add_argument("--chunk-sizes", default="32,128", help="prefill chunk sizes")
    p.add_argument("--baseline-steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs of each variant, interleaved (the report gives each run and the medians)")
    p.add_argument("--top", type=int, default=25, help="functions listed by their own time")
    p.add_argument("--overlap", choices=("auto", "on"), default="auto",
                   help="queued decode steps (scheduler.overlap_steps): as chosen for the device (on for GPU / TPU), "
                        "or on; where on, the timed run is repeated with them off")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> Any:
    from agents.runtime import RuntimeOptions, build_runtime

    options = RuntimeOptions(model=args.model, num_slots=8, max_len=args.max_len, speculative=False,
                             chunk_sizes=tuple(int(c) for c in args.chunk_sizes.split(",")),
                             background_compile=False, disk_tier_dir="off",
                             overlap_steps=True if args.overlap == "on" else None)
    return build_runtime(options)


def one_run(runtime: Any, args: argparse.Namespace, salt: int) -> dict[str, Any]:
    """Submit the streams, drive the scheduler until idle on this thread; wall time and iterations."""
    from core.sampling import SamplingParams
    from scheduler.request import GenerationRequest

    scheduler = runtime.scheduler
    handles = []
    for i in range(args.streams):
        prompt = runtime.tokenizer.encode(f"Stream {salt}-{i}: write a long story about a lighthouse keeper.",
                                          add_bos=True)
        request = GenerationRequest(tuple(prompt), SamplingParams(temperature=0.0), max_tokens=args.max_tokens,
                                    ignore_eos=True)
        handles.append(scheduler.submit(request))
    iterations0, overlapped0 = scheduler.stats.iterations, scheduler.stats.overlapped_steps
    begin = time.perf_counter()
    scheduler.run_until_idle()
    wall = time.perf_counter() - begin
    return {"wall_s": round(wall, 4), "iterations": scheduler.stats.iterations - iterations0,
            "overlapped_steps": scheduler.stats.overlapped_steps - overlapped0,
            "tokens": args.streams * args.max_tokens, "handles": len(handles)}


def timed_run(runtime: Any, args: argparse.Namespace, baseline: dict[str, Any], salt: int) -> dict[str, Any]:
    """One timed run against the engine baseline: ms per iteration, its excess over the engine's step, and
    the rate as a share of the engine's."""
    timed = one_run(runtime, args, salt)
    per_iteration = timed["wall_s"] * 1e3 / timed["iterations"]
    rate = timed["tokens"] / timed["wall_s"]
    result = {**timed, "ms_per_iteration": round(per_iteration, 3),
              "excess_over_baseline_step_ms": round(per_iteration - baseline["ms_p50"], 3),
              "tokens_per_s": round(rate, 1), "ratio_over_engine": round(rate / baseline["tokens_per_s"], 3)}
    if "queued_tokens_per_s" in baseline:
        result["ratio_over_queued_engine"] = round(rate / baseline["queued_tokens_per_s"], 3)
    log(f"engine {baseline['ms_p50']} ms/step; loop {per_iteration:.3f} ms/iteration "
        f"({result['ratio_over_engine']}x the engine's rate)")
    return result


def profile_split(profile: cProfile.Profile, iterations: int, top: int) -> dict[str, Any]:
    """ms per iteration of the loop's parts (cumulative) and the top functions by their own time."""
    stats = pstats.Stats(profile)
    parts: dict[str, float] = {}
    own = []
    for (filename, _, name), (_, _, tottime, cumtime, _) in stats.stats.items():
        where = f"{Path(filename).parent.name}/{Path(filename).name}:{name}"
        if name in PARTS and (filename.startswith(str(ROOT)) or "/jax/" in filename):
            parts[where] = parts.get(where, 0.0) + cumtime
        own.append((tottime, where))
    own.sort(reverse=True)
    per = 1e3 / max(iterations, 1)
    return {"cumulative_ms_per_iteration": {k: round(v * per, 3) for k, v in sorted(parts.items(),
                                                                                     key=lambda kv: -kv[1])},
            "own_ms_per_iteration": [[where, round(t * per, 3)] for t, where in own[:top]]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from core.device import configure_environment

    configure_environment()
    import jax

    from benchmarks.http_load import engine_baseline

    backend = jax.default_backend()
    out = args.out or RESULTS / f"serving-loop-{backend}.json"
    runtime = build(args)
    report: dict[str, Any] = {"command": "benchmarks/serving_loop.py " + " ".join(sys.argv[1:]),
                              "git_commit": git_commit(mark_dirty=True, env="SLOTSERVE_GIT_COMMIT"),
                              "host": host(), "backend": backend, "device": str(jax.devices()[0]),
                              "runtime": runtime.info()}
    one_run(runtime, args, salt=0)  # every program's first run, not measured
    baseline = engine_baseline(runtime.engine, args.baseline_steps, 2, 64)
    report["engine_baseline"] = baseline
    overlapping = runtime.engine.fused_sampling and runtime.scheduler.config.overlap_steps
    report["overlap_steps"] = overlapping
    variants = {"timed": runtime.scheduler.config}
    if overlapping:  # the same runs with every step's tokens read before the next is dispatched
        variants["timed_without_overlap"] = replace(runtime.scheduler.config, overlap_steps=False)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for repeat in range(args.repeats):  # interleaved, so that a slow phase of the host hits both alike
        for i, (name, config) in enumerate(variants.items()):
            runtime.scheduler.config = config
            runs[name].append(timed_run(runtime, args, baseline, salt=10 + 2 * repeat + i))
    runtime.scheduler.config = variants["timed"]
    for name, results in runs.items():
        report[name] = {f"median_{key}": round(statistics.median(r[key] for r in results), 3)
                        for key in ("ms_per_iteration", "ratio_over_engine")}
        report[name]["runs"] = results
    profile = cProfile.Profile()
    profile.enable()
    profiled = one_run(runtime, args, salt=2)
    profile.disable()
    report["profiled"] = {**profiled, **profile_split(profile, profiled["iterations"], args.top)}
    save_report(out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
