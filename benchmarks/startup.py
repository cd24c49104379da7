#!/usr/bin/env python3
"""Where start-up time goes: `slotserve serve` started on the default model, first with empty caches (a
fresh machine), then `--restarts` times again with them warm (restarts), each until `/ready` answers 200.

    python3 benchmarks/startup.py                        # 8 slots x 8192, the served defaults
    python3 benchmarks/startup.py --slots 4 --max-len 2048

Per start: seconds from process start to /ready, the stage durations the server reports (load the model,
allocate the KV pool, compile the step programs, start the scheduler), what it loaded from its caches, one
short request's latency right after /ready, and seconds until a background warm-up has compiled every
program. The caches (XLA, exported programs, prepared weights, tokenizer) live in a temporary directory, so
the first start is a fresh machine's and the user's own caches are neither used nor touched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402 - after the path set-up that makes it importable
    child_process,
    every_program_compiled,
    free_port,
    git_commit,
    host,
    poll_ready,
    save_report,
    serve_command,
)


def start_once(cache: Path, slots: int, max_len: int, timeout: float, background: bool) -> dict:
    """One start: seconds to /ready and what it reports, one short request's latency right after, and
    seconds until every program is compiled (a background warm-up goes on after /ready)."""
    port = free_port()
    config = cache / f"startup-{port}.yaml"
    config.write_text(f"model:\n  slots: {slots}\n  max_len: {max_len}\n  compile_cache: {cache / 'xla'}\n"
                      f"  background_compile: {str(background).lower()}\n"
                      f"server:\n  port: {port}\n  log_level: warning\n")
    url = f"http://127.0.0.1:{port}"
    env = {"SLOTSERVE_CACHE_DIR": str(cache)}  # weights and tokenizer caches start empty too
    begin = time.monotonic()
    with child_process(serve_command(config), cwd=ROOT, env=env) as proc:
        ready = f"{url}/ready"
        # Both waits end at the same deadline: the timeout counts from the process start.
        body = poll_ready(ready, proc, begin + timeout, until=lambda b: True, interval=0.25)  # any 200: its body
        run = {"ready_s": round(time.monotonic() - begin, 1), "stages_s": body["startup_s"],
               "weights_from_cache": body["weights_from_cache"], "programs_at_ready": body["programs"],
               "slowest_programs_s": body["slowest_programs_s"]}
        sent = time.monotonic()
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=timeout, json={
            "model": "assistant", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
        reply.raise_for_status()
        run["first_request_s"] = round(time.monotonic() - sent, 2)
        done = poll_ready(ready, proc, begin + timeout, until=every_program_compiled, interval=0.25)
        run["all_programs_compiled_s"] = round(time.monotonic() - begin, 1)
        run["programs_at_end"] = done["programs"]
        return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--background", choices=("on", "off"), default="on",
                        help="model.background_compile: ready once a short request's programs are compiled (on)")
    parser.add_argument("--restarts", type=int, default=2, help="warm restarts after the first start (noise)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "startup-cpu.json")
    args = parser.parse_args()
    background = args.background == "on"
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        runs = {"first start (empty caches)": start_once(cache, args.slots, args.max_len, args.timeout, background)}
        for n in range(1, args.restarts + 1):
            runs[f"restart {n} (warm caches)"] = start_once(cache, args.slots, args.max_len, args.timeout, background)
    report = {"meta": {"command": "python3 benchmarks/startup.py " + " ".join(sys.argv[1:]), "host": host(),
                       "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "git_commit": git_commit() or "",
                       "config": f"default model, {args.slots} slots x {args.max_len}, the server's CPU defaults, "
                                 f"background compile {args.background}",
                       "load_average": os.getloadavg()},
              "runs": runs}
    save_report(args.out, report, echo=False, indent=1)
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
