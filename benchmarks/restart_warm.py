#!/usr/bin/env python3
"""Warm sessions after a restart (issue #33, the disk tier): the mission workload's first turns on one
`slotserve serve` process, then its last turn on the same process or on a new one started on the same
caches, and what that last turn computes.

    .venv/bin/python benchmarks/restart_warm.py

The workload is agents_http.py's (client-sent ~1,330-token system prompts, full history resent, 8 sessions in
flight, temperature 0.7 with per-turn seeds, so every mode sees the same replies). Modes, each on a fresh disk
directory:
- ``no_restart``: every turn on one process;
- ``sigterm``: turns 1..T-1, SIGTERM (the server writes what its slots and host tier hold), a new process,
  turn T;
- ``kill9``: turns 1..T-1, kill -9 once the disk tier has no file left to write, a new process, turn T;
- ``restart_no_disk``: as ``sigterm`` with the disk tier off (everything recomputed).
The new process is measured once every program is loaded (what a restart costs in compiling is
startup.py's and http_load.py's business). Per mode, of the last turn: prefill tokens computed (the
/metrics counter), cached tokens, TTFT p50/p90; ratios against ``no_restart``. Writes
benchmarks/results/restart-warm-cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.agents_http import (  # noqa: E402
    add_workload_args,
    build_workload,
    run_workload,
    scheduler_counters,
    warm_up,
)
from benchmarks.common import (  # noqa: E402
    child_process,
    free_port,
    git_commit,
    host,
    log,
    percentile,
    save_report,
    wait_healthy,
)

MODES = ("no_restart", "sigterm", "kill9", "restart_no_disk")


def write_config(tmp: Path, work: dict[str, Any], args: argparse.Namespace, disk: str) -> tuple[Path, int]:
    agents_dir = tmp / "agents"
    agents_dir.mkdir(exist_ok=True)
    for agent in work["systems"]:
        (agents_dir / f"{agent}.yaml").write_text(f"name: {agent}\ndescription: benchmark agent\n")
    port = free_port()
    config = tmp / f"server-{port}.yaml"
    config.write_text(f"model:\n  slots: {args.concurrency}\n  max_len: 8192\nserver:\n  port: {port}\n"
                      f"  log_level: warning\nagents_dir: {agents_dir}\nlimits:\n  max_body_bytes: 4194304\n"
                      f"scheduler:\n  disk_tier_dir: {disk}\n")
    return config, port


def server_for(port: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}"
    return {"url": url, "chat_url": lambda agent: f"{url}/agents/{agent}/v1/chat/completions",
            "model": lambda agent: agent}


def metric(url: str, name: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name} ")), 0.0)


def start(config: Path, log_path: Path, args: argparse.Namespace):
    cmd = [sys.executable, "-m", "server.cli", "serve", "--config", str(config)]
    return child_process(cmd, log_path=log_path, cwd=ROOT, stop_timeout=120)


def ready(port: int, proc: Any, log_path: Path, args: argparse.Namespace) -> float:
    return wait_healthy(f"http://127.0.0.1:{port}", proc, log_path, "/ready", args.start_timeout, every_program=True)


def last_turn(server: dict[str, Any], work: dict[str, Any], args: argparse.Namespace,
              histories: dict[str, list]) -> dict[str, Any]:
    before = scheduler_counters(server["url"])
    run = asyncio.run(run_workload(server, work, args, turns=range(args.turns - 1, args.turns), histories=histories))
    after = scheduler_counters(server["url"])
    records = run["records"]
    errors = [r["error"] for r in records if r["error"]]
    ttfts = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    if not ttfts:
        raise RuntimeError(f"no request of the last turn answered: {errors[:3]}")
    usage = [r["usage"] or {} for r in records]
    return {"requests": len(records), "errors": errors[:3], "wall_s": round(run["wall_s"], 3),
            "prompt_tokens": sum(u.get("prompt_tokens", 0) for u in usage),
            "cached_tokens": sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usage),
            "prefill_tokens_computed": int(after["prefill_tokens"] - before.get("prefill_tokens", 0)),
            "disk_restores": int(after.get("disk_restores", 0) - before.get("disk_restores", 0)),
            "ttft_s_p50": round(percentile(ttfts, 0.5), 4), "ttft_s_p90": round(percentile(ttfts, 0.9), 4)}


def run_mode(mode: str, work: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"restart-warm-{mode}-") as name:
        tmp = Path(name)
        disk = "off" if mode == "restart_no_disk" else str(tmp / "kv")
        histories: dict[str, list] = {}
        config, port = write_config(tmp, work, args, disk)
        first_log = tmp / "first.log"
        with start(config, first_log, args) as proc:
            ready(port, proc, first_log, args)
            server = server_for(port)
            asyncio.run(warm_up(server, args))
            asyncio.run(run_workload(server, work, args, turns=range(args.turns - 1), histories=histories))
            if mode == "no_restart":
                return last_turn(server, work, args, histories)
            stopped = time.monotonic()
            if mode == "kill9":
                while metric(server["url"], "slotserve_disk_tier_pending"):
                    time.sleep(0.05)
                proc.kill()
            else:
                proc.terminate()
            proc.wait(120)
            stop_s = time.monotonic() - stopped
        files = list((tmp / "kv").glob("*.kv")) if disk != "off" else []
        config, port = write_config(tmp, work, args, disk)
        second_log = tmp / "second.log"
        with start(config, second_log, args) as proc:
            ready_s = ready(port, proc, second_log, args)
            asyncio.run(warm_up(server_for(port), args))  # as the first process had
            result = last_turn(server_for(port), work, args, histories)
        return {**result, "stop_s": round(stop_s, 2), "ready_s": round(ready_s, 1), "disk_files": len(files),
                "disk_bytes": sum(f.stat().st_size for f in files)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/restart-warm-cpu.json"))
    args = p.parse_args(argv)
    work = build_workload(args)
    report: dict[str, Any] = {
        "benchmark": "restart_warm", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(mark_dirty=True), "host": host(), "argv": sys.argv[1:],
        "workload": {k: getattr(args, k) for k in ("agents", "sessions", "turns", "concurrency", "system_words",
                                                   "user_words", "max_tokens", "seed")},
        "notes": "the last turn of each session, measured; the restarted process once every program is loaded",
        "modes": {},
    }
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        log(f"mode {mode}")
        report["modes"][mode] = run_mode(mode, work, args)
        log(f"{mode}: {report['modes'][mode]}")
        save_report(args.out, report, echo=False)
    base = report["modes"].get("no_restart")
    if base:
        report["over_no_restart"] = {
            mode: {key: round(r[key] / max(base[key], 1e-9), 3)
                   for key in ("prefill_tokens_computed", "ttft_s_p50", "ttft_s_p90")}
            for mode, r in report["modes"].items() if mode != "no_restart"}
    save_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
