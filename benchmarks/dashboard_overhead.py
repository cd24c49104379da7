#!/usr/bin/env python3
"""What the live dashboard costs the engine: decode step time with the slot snapshot off, on (published by the
engine thread at most every 0.25 s), and on with a dashboard stream open (an SSE client reading
/admin/slots/stream every --stream-interval seconds, its documents built on the server's event loop, which
shares the GIL with the engine thread).

    .venv/bin/python benchmarks/dashboard_overhead.py [--model default] [--rounds 3] [--max-tokens 96]

Workload per measurement: --streams sampled requests (temperature 1, so no speculative steps) of a 32-token
prompt and --max-tokens generated tokens, submitted to the scheduler directly (no HTTP client cost), all at
once; the step time is the wall time of each scheduler iteration once every prompt is prefilled (one batched
decode step each, the snapshot publish included when it falls there). Modes run interleaved over --rounds
rounds, so the host's drift hits all alike. Also measured: one snapshot publish on the engine thread, and one
dashboard document (built + JSON) on the event loop.

Writes benchmarks/results/dashboard-overhead-cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import LiveServer, git_commit, host, log, save_report  # noqa: E402

MODES = ("off", "on", "on+stream")


def step_timer(sched) -> list[tuple[float, bool]]:
    """Wrap the scheduler's iteration: (seconds, every running sequence was decoding) per step."""
    from scheduler.sequence import SeqState

    record: list[tuple[float, bool]] = []
    step = sched.step

    def timed() -> None:
        begin = time.perf_counter()
        step()
        decoding = bool(sched.running) and sched.waiting == 0 and all(
            s.sequence.state is SeqState.DECODING for s in sched.slots if s.sequence is not None)
        record.append((time.perf_counter() - begin, decoding))

    sched.step = timed
    return record


def publish_timer(publisher) -> list[float]:
    seconds: list[float] = []
    publish = publisher.publish

    def timed(sched, plan) -> None:
        begin = time.perf_counter()
        publish(sched, plan)
        seconds.append(time.perf_counter() - begin)

    publisher.publish = timed
    return seconds


def stream_reader(url: str, interval: float, stop: threading.Event, counts: dict[str, int]) -> None:
    import httpx

    with httpx.stream("GET", f"{url}/admin/slots/stream", params={"interval": interval}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])
                counts["events"] += 1
            if stop.is_set():
                return


def run_wave(runtime, args: argparse.Namespace, seed: int) -> None:
    import numpy as np

    from core.sampling import SamplingParams
    from scheduler.request import GenerationRequest

    rng = np.random.default_rng(seed)
    handles = [runtime.scheduler.submit(GenerationRequest(
        prompt_ids=tuple(int(x) for x in rng.integers(1000, 100_000, size=32)),
        sampling=SamplingParams(temperature=1.0, seed=seed * 100 + i), max_tokens=args.max_tokens,
        ignore_eos=True, group=f"bench-{i % 3}")) for i in range(args.streams)]
    for handle in handles:
        handle.result(timeout=600)


def summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in seconds)
    return {"steps": len(ms), "ms_mean": round(statistics.fmean(ms), 3), "ms_p50": round(ms[len(ms) // 2], 3),
            "ms_p90": round(ms[int(len(ms) * 0.9)], 3)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model.name override (default: configs/default.yaml's)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stream-interval", type=float, default=0.25, help="the SSE client's interval (page: 0.5)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dashboard-overhead-cpu.json"))
    return p.parse_args(argv)


def start_server(args: argparse.Namespace) -> tuple[Any, Any, LiveServer]:
    """The runtime (configs/default.yaml, no max_tokens limit), started, and its app served in this process,
    so that the dashboard stream's documents are built on an event loop that shares the GIL with the engine."""
    from agents.runtime import build_runtime
    from server.app import configure_logging, create_app
    from server.config import load_config

    overrides: dict[str, Any] = {"limits.max_tokens": None, "server.log_level": "warning"}
    if args.model:
        overrides["model.name"] = args.model
    config = load_config(None, overrides)
    configure_logging("warning", True)
    begin = time.perf_counter()
    stages: list[str] = []

    def progress(stage: str, done: int = 0, total: int = 0, detail: str = "") -> None:
        if not stages or stages[-1] != stage:
            stages.append(stage)
            log(f"{stage} {detail}")

    runtime = build_runtime(config.runtime_options(), progress=progress)
    runtime.start()
    app = create_app(config, runtime=runtime)
    server = LiveServer(app).start()
    log(f"ready in {time.perf_counter() - begin:.0f} s: {runtime.info()}")
    return runtime, app, server


def report_header(args: argparse.Namespace, runtime: Any) -> dict[str, Any]:
    """Where and on what the figures were measured, and the workload."""
    return {
        "benchmark": "dashboard_overhead", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(mark_dirty=True), "host": host(), "runtime": runtime.info(),
        "workload": {"streams": args.streams, "prompt_tokens": 32, "max_tokens": args.max_tokens,
                     "rounds": args.rounds, "snapshot_interval_s": runtime.scheduler.snapshots.interval_s,
                     "stream_interval_s": args.stream_interval},
    }


def measure_mode(runtime: Any, args: argparse.Namespace, url: str, mode: str, round_index: int, interval: float,
                 steps: list[tuple[float, bool]], events: dict[str, int]) -> list[float]:
    """One wave in ``mode``: the seconds of its decoding steps. With "on+stream" a dashboard client reads
    the stream during the wave (started half a second before it)."""
    runtime.scheduler.snapshots.interval_s = None if mode == "off" else interval
    stop = threading.Event()
    reader = None
    if mode == "on+stream":
        reader = threading.Thread(target=stream_reader, args=(url, args.stream_interval, stop, events), daemon=True)
        reader.start()
        time.sleep(0.5)
    steps.clear()
    run_wave(runtime, args, seed=1 + round_index)
    stop.set()
    if reader is not None:
        reader.join(10)
    decoding = [s for s, d in steps if d]
    log(f"round {round_index + 1} {mode}: {summary(decoding)}")
    return decoding


def measure_modes(runtime: Any, args: argparse.Namespace, url: str, interval: float,
                  steps: list[tuple[float, bool]], events: dict[str, int]) -> dict[str, list[float]]:
    """Decoding step seconds per mode, the modes interleaved round by round after an unmeasured warm-up wave."""
    per_mode: dict[str, list[float]] = {m: [] for m in MODES}
    run_wave(runtime, args, seed=0)  # warm-up: every program this workload uses, not measured
    for r in range(args.rounds):
        for mode in MODES:
            per_mode[mode] += measure_mode(runtime, args, url, mode, r, interval, steps, events)
    return per_mode


def time_documents(app: Any, count: int = 200) -> list[float]:
    """Seconds to build one dashboard document and encode it as JSON, ``count`` times."""
    from server.dashboard import slots_document

    state = app.state.slotserve
    docs = []
    for _ in range(count):
        t0 = time.perf_counter()
        json.dumps(slots_document(state))
        docs.append(time.perf_counter() - t0)
    return docs


def add_results(record: dict[str, Any], per_mode: dict[str, list[float]], publishes: list[float],
                docs: list[float], stream_events: int) -> None:
    """The measured figures, into ``record`` after its header."""
    results = {mode: summary(values) for mode, values in per_mode.items()}
    off = results["off"]["ms_p50"]
    record["decode_step"] = results
    record["ratio_p50_vs_off"] = {m: round(results[m]["ms_p50"] / off, 4) for m in MODES}
    record["snapshot_publish_us"] = {"count": len(publishes), "mean": round(statistics.fmean(publishes) * 1e6, 1),
                                     "max": round(max(publishes) * 1e6, 1)} if publishes else None
    record["document_build_us"] = {"mean": round(statistics.fmean(docs) * 1e6, 1),
                                   "p90": round(sorted(docs)[int(len(docs) * 0.9)] * 1e6, 1)}
    record["stream_events"] = stream_events


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime, app, server = start_server(args)
    sched = runtime.scheduler
    steps = step_timer(sched)
    publishes = publish_timer(sched.snapshots)
    record = report_header(args, runtime)
    interval = sched.snapshots.interval_s
    events = {"events": 0}
    try:
        per_mode = measure_modes(runtime, args, server.url, interval, steps, events)
        docs = time_documents(app)
    finally:
        sched.snapshots.interval_s = interval  # the modes changed it
        server.stop()
        runtime.stop()
    add_results(record, per_mode, publishes, docs, events["events"])
    save_report(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
