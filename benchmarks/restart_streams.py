#!/usr/bin/env python3
"""Eight streams right after a restart: does a restarted `slotserve serve` serve at full speed at once?

    python3 benchmarks/restart_streams.py --llama-server PATH

A real `slotserve serve` (the served defaults, the disk KV tier off so no start reads an earlier one's KV)
is started once to fill its caches (XLA, exported programs, prepared weights, tokenizer; in a temporary
directory unless --cache-dir) and stopped once every program is compiled. Then, --restarts times: started
again, and the moment /ready answers, N streams x T tokens (greedy, ignore_eos, http_load.py's client in its
own process) are sent; once every program is loaded, the same wave again on the same process (the full-speed
reference of that run; its prompts are cached by then), and the same wave under a cache_salt of its own
(prompts not cached, as the first wave's were: the reference that differs from the first wave only in the
programs loaded). Reported per restart: seconds to /ready, the first wave's tokens/s and when it ended
(seconds after /ready), how many programs were loaded when it started and ended, and the first wave over the
loaded one. llama.cpp's server (`-np 8 -t 2`, same GGUF) runs the same wave in the same run, after ours.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402 - after the path set-up that makes it importable
    child_process,
    default_gguf,
    every_program_compiled,
    free_port,
    git_commit,
    host,
    llama_command,
    log,
    poll_ready,
    save_report,
    serve_command,
    wait_healthy,
)
from benchmarks.http_load import summarize_wave, wave_in_subprocess  # noqa: E402


def write_config(cache: Path, port: int) -> Path:
    """The served defaults, on this port, with the caches under ``cache``."""
    config = cache / f"restart-{port}.yaml"
    config.write_text(f"model:\n  compile_cache: {cache / 'xla'}\nserver:\n  port: {port}\n  log_level: warning\n")
    return config


def programs(url: str) -> dict[str, int]:
    return httpx.get(f"{url}/ready", timeout=10).json()["programs"]


def scheduler_counters(url: str) -> dict[str, float]:
    """The scheduler's counters from /metrics (`slotserve_scheduler_*`), by field name."""
    prefix, out = "slotserve_scheduler_", {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(prefix) and "_total " in line:
            name, value = line.split(" ")
            out[name[len(prefix):-len("_total")]] = float(value)
    return out


def wave(url: str, args: argparse.Namespace, counters: bool = True, salt: str | None = None) -> dict[str, Any]:
    """One wave; with ``counters``, what it moved the scheduler's counters by (decode and verify steps,
    drafts accepted: whether the wave ran batched verify steps); ``salt``: the requests' cache_salt."""
    before = scheduler_counters(url) if counters else {}
    raw = wave_in_subprocess(url, args.agent, args.streams, args.max_tokens, args.timeout, salt)
    result = summarize_wave(raw, args.streams, args.max_tokens)
    if counters:
        after = scheduler_counters(url)
        result["scheduler_delta"] = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k)}
    return result


def start(cache: Path, args: argparse.Namespace, measure: bool) -> dict[str, Any]:
    """One start of our server; with ``measure``: a wave at /ready, then one once every program is loaded."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"SLOTSERVE_CACHE_DIR": str(cache), "SLOTSERVE_KV_DISK_DIR": "off"}
    begin = time.monotonic()
    with child_process(serve_command(write_config(cache, port)), cwd=ROOT, env=env,
                       log_path=cache / f"serve-{port}.log") as proc:
        poll_ready(f"{url}/ready", proc, begin + args.start_timeout, until=lambda b: True, interval=0.1)
        ready = time.monotonic()
        run: dict[str, Any] = {"ready_s": round(ready - begin, 1)}
        if measure:
            run["programs_at_first_wave"] = programs(url)
            run["first_wave"] = wave(url, args)
            run["first_wave_ended_after_ready_s"] = round(time.monotonic() - ready, 1)
            run["programs_after_first_wave"] = programs(url)
        poll_ready(f"{url}/ready", proc, begin + args.start_timeout, until=every_program_compiled, interval=0.25)
        run["all_programs_loaded_after_ready_s"] = round(time.monotonic() - ready, 1)
        if measure:
            run["loaded_wave"] = wave(url, args)
            run["first_over_loaded"] = round(run["first_wave"]["tokens_per_s"] / run["loaded_wave"]["tokens_per_s"], 3)
            # The loaded wave above re-sends the first wave's prompts and finds them cached; this one has a
            # cache scope of its own, so it computes what the first wave computed: only the programs differ.
            run["loaded_uncached_wave"] = wave(url, args, salt=f"loaded-{time.monotonic_ns()}")
            run["first_over_loaded_uncached"] = round(
                run["first_wave"]["tokens_per_s"] / run["loaded_uncached_wave"]["tokens_per_s"], 3)
            log(f"restart: ready {run['ready_s']} s; first wave {run['first_wave']['tokens_per_s']} tok/s, ended "
                f"{run['first_wave_ended_after_ready_s']} s after ready; loaded {run['loaded_wave']['tokens_per_s']} "
                f"tok/s: {run['first_over_loaded']}x; loaded, prompts not cached "
                f"{run['loaded_uncached_wave']['tokens_per_s']} tok/s: {run['first_over_loaded_uncached']}x")
        return run


def llama_wave(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    cmd = llama_command(args.llama_server, args.gguf or default_gguf(), port, "-np", "8", "-t", "2")
    log_path = Path(tempfile.gettempdir()) / f"restart-streams-llama-{port}.log"
    with child_process(cmd, log_path=log_path, stop_timeout=30) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log_path, "/health", 300, interval=0.2)
        wave_in_subprocess(url, "gemma", 1, 4, args.timeout)  # its first request's set-up, as ours had
        result = wave(url, args, counters=False)
        result["command"] = cmd
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--agent", default="assistant")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="caches to start from (default: a temporary directory filled by a first start)")
    parser.add_argument("--llama-server", default=None, help="llama.cpp server binary: the same wave on it")
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--start-timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "restart-streams-cpu.json")
    args = parser.parse_args()
    report: dict[str, Any] = {"benchmark": "restart_streams", "commit": git_commit(mark_dirty=True), "host": host(),
                              "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "workload": f"{args.streams} streams x {args.max_tokens} tokens, greedy, ignore_eos, "
                                          "the served defaults, disk KV tier off"}
    with tempfile.TemporaryDirectory(prefix="restart-streams-") as tmp:
        cache = args.cache_dir or Path(tmp)
        if args.cache_dir is None:
            report["first_start"] = start(cache, args, measure=False)
            log(f"caches filled: {report['first_start']}")
        report["restarts"] = [start(cache, args, measure=True) for _ in range(args.restarts)]
        save_report(args.out, report, echo=False)
    if args.llama_server:
        report["llama_cpp"] = llama_wave(args)
        for run in report["restarts"]:
            for name in ("first_wave", "loaded_wave"):
                run[f"{name}_over_llama"] = round(run[name]["tokens_per_s"] / report["llama_cpp"]["tokens_per_s"], 3)
    save_report(args.out, report)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
