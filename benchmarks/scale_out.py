#!/usr/bin/env python3
"""One replica vs two behind the router (`slotserve cluster`): aggregate completion tokens/s and TTFT p50/p90.

    .venv/bin/python benchmarks/scale_out.py --router vllm-router [--replicas 1 2] [--agents 4 --sessions 8 ...]
    .venv/bin/python benchmarks/scale_out.py --tiny        # the tests' tiny random model: checks the script

Workload (default `--workload agents`): the multi-agent workload of benchmarks/agents_http.py (its
`build_workload` / `run_workload`): A agents, each with a long system prompt that the client sends as a
system message; S sessions over the agents, each running T turns one after another and resending the whole
history; temperature 0.7 with a seed per (session, turn); at most C sessions in flight. Every request also
carries `X-Session-Id: <session>`, so the router keeps a session on one replica (the server matches the
resent history against its stored session). The replicas run `slotserve serve` on the config agents_http.py
generates (one agent per workload agent, C slots; --config replaces it, and must then define agent0..).
`--workload sessions`: the older workload, S sessions of T turns sending only the new user message (the
server keeps the history), max_tokens tokens a turn with ignore_eos.

For each replica count a fresh cluster (its own redis-server, N replicas, the router) is started, every
replica's programs compiled, warmed (agents: one turn per replica on other system prompts), then measured:
wall time, completion tokens/s, TTFT p50/p90, errors and, from each replica's /metrics, the scheduler's
counters (prefill tokens computed, prefix-cache hits, ...) over the measured workload. Not run in CI: on a
2-core CPU machine two replicas share the cores, so expect no gain there; the figure that matters comes from
one accelerator per replica.

`--failover`: two replicas sharing a disk-tier directory, one killed with kill -9 before every session's last
turn, which the other answers; against the same with the disk tier off, and with no kill
(`measure_failover`; results in scale-out-failover-<router>.json).

Writes benchmarks/results/scale-out-<router>.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import agents_http  # noqa: E402
from benchmarks.common import (  # noqa: E402
    free_port,
    git_commit,
    host,
    percentile,
    save_report,
    sse_chunks,
    wait_healthy,
)
from server.cluster import Cluster  # noqa: E402

TINY_SERVER = REPO / "tests" / "tiny_server.py"


def replica_command(args: argparse.Namespace, config: str | None = None, disk: str | None = None):
    """``config``: the YAML for `slotserve serve` (--config wins; None: the default config); ``disk``: the
    tiny replicas' disk-tier directory (`serve` replicas take theirs from the config)."""
    def command(port: int, redis_url: str) -> list[str]:
        if args.tiny:
            return [sys.executable, str(TINY_SERVER), "--port", str(port), "--redis-url", redis_url,
                    *(["--kv-disk-dir", disk] if disk and disk != "off" else [])]
        chosen = args.config or config
        extra = ["--config", chosen] if chosen else []
        return [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--redis-url", redis_url, *extra]

    return command


async def one_turn(client: httpx.AsyncClient, url: str, sid: str, turn: int, max_tokens: int) -> dict[str, Any]:
    body = {"model": "assistant", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Turn {turn}: tell me something about the number {turn}."}]}
    begin = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"X-Session-Id": sid, "Idempotency-Key": f"{sid}-{turn}"}) as r:
        r.raise_for_status()
        async for chunk in sse_chunks(r):
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - begin
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - begin, "tokens": tokens}


async def workload(url: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    limit = asyncio.Semaphore(args.concurrency)
    results: list[dict[str, Any]] = []

    async def session(client: httpx.AsyncClient, index: int) -> None:
        async with limit:
            for turn in range(args.turns):
                results.append(await one_turn(client, url, f"{tag}-s{index}", turn, args.max_tokens))

    async with httpx.AsyncClient(timeout=600) as client:
        begin = time.perf_counter()
        await asyncio.gather(*(session(client, i) for i in range(args.sessions)))
        wall = time.perf_counter() - begin
    ttfts = sorted(r["ttft_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "completion_tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2), "ttft_p50_s": round(statistics.median(ttfts), 4),
            "ttft_p90_s": round(ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], 4)}


def measure(replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    if args.workload == "agents":
        return measure_agents(replicas, args)
    workdir = Path(tempfile.mkdtemp(prefix=f"scale-out-{replicas}-"))
    cluster = Cluster(replicas, replica_command(args), workdir, router=args.router, port=free_port()).start()
    try:
        asyncio.run(workload(cluster.url, argparse.Namespace(**{**vars(args), "sessions": replicas, "turns": 1}),
                             f"warm{replicas}"))
        result = asyncio.run(workload(cluster.url, args, f"run{replicas}"))
    finally:
        cluster.stop()
    print(f"{replicas} replica(s): {result}", file=sys.stderr, flush=True)
    return {"replicas": replicas, **result}


def counters(urls: list[str]) -> list[dict[str, float]]:
    return [agents_http.scheduler_counters(url) for url in urls]


def measure_agents(replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    """The agents_http workload through the router, sticky by X-Session-Id."""
    workdir = Path(tempfile.mkdtemp(prefix=f"scale-out-{replicas}-"))
    work = agents_http.build_workload(args)
    config = None if args.tiny else str(agents_http.ours(args, work, workdir)["command"][-1])
    cluster = Cluster(replicas, replica_command(args, config), workdir, router=args.router, port=free_port())
    cluster.start()
    server = {"chat_url": lambda agent: f"{cluster.url}/v1/chat/completions",
              "model": (lambda agent: "assistant") if args.tiny else (lambda agent: agent)}
    try:
        for replica in cluster.members:  # background compiles would share the cores with the workload
            wait_healthy(replica.url, replica.process.proc, replica.process.log_path, "/ready", args.timeout,
                         every_program=True)
        warm_args = argparse.Namespace(**{**vars(args), "sessions": replicas, "turns": 1, "seed": args.seed + 1})
        warm = asyncio.run(agents_http.run_workload(server, agents_http.build_workload(warm_args), warm_args,
                                                    headers=lambda spec: {"X-Session-Id": f"warm-{spec['session']}"}))
        urls = [replica.url for replica in cluster.members]
        before = counters(urls)
        run = asyncio.run(agents_http.run_workload(server, work, args,
                                                   headers=lambda spec: {"X-Session-Id": f"run-{spec['session']}"}))
        after = counters(urls)
    finally:
        cluster.stop()
    per_replica = [{k: int(a[k] - b.get(k, 0)) for k in a if a[k] != b.get(k, 0)}
                   for a, b in zip(after, before, strict=True)]
    total: dict[str, int] = {}
    for delta in per_replica:
        for k, v in delta.items():
            total[k] = total.get(k, 0) + v
    records = run["records"]
    ok = [r for r in records if not r["error"]]
    ttfts = sorted(r["ttft_s"] for r in ok if r["ttft_s"] is not None)
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok if r["usage"])
    completion = sum(r["usage"]["completion_tokens"] for r in ok if r["usage"])
    cached = sum(((r["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for r in ok)
    result = {
        "replicas": replicas, "requests": len(records), "errors": len(records) - len(ok),
        "error_samples": [r["error"] for r in records if r["error"]][:3],
        "warm_up_errors": sum(1 for r in warm["records"] if r["error"]),
        "wall_s": round(run["wall_s"], 3), "prompt_tokens": prompt, "cached_tokens_reported": cached,
        "hit_ratio": round(cached / prompt, 4) if prompt else None,
        "completion_tokens": completion, "tokens_per_s": round(completion / run["wall_s"], 2),
        **{f"ttft_p{q}_s": round(percentile(ttfts, q / 100), 4) if ttfts else None for q in (50, 90)},
        "scheduler_counters": total, "scheduler_counters_per_replica": per_replica,
    }
    print(f"{replicas} replica(s): { {k: v for k, v in result.items() if 'per_replica' not in k} }",
          file=sys.stderr, flush=True)
    return result


FAILOVER_VARIANTS = ("no_failover", "failover_shared_disk", "failover_no_disk")


def measure_failover(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Two replicas behind the router sharing a disk-tier directory (``failover_no_disk``: none). Every
    session's turns but the last go through the router (sticky); then replica 0 is killed with kill -9, once
    its disk tier has written everything, and every session's last turn goes to replica 1, as the router sends
    a dead replica's sessions on (``no_failover``: the last turn through the router, both alive). Measured:
    the last turn's prefill tokens computed, cached tokens and TTFT."""
    workdir = Path(tempfile.mkdtemp(prefix=f"scale-out-{variant}-"))
    work = agents_http.build_workload(args)
    disk = "off" if variant == "failover_no_disk" else str(workdir / "kv")
    config = None
    if not args.tiny:
        config = str(agents_http.ours(args, work, workdir)["command"][-1])
        with open(config, "a") as f:
            f.write(f"scheduler:\n  disk_tier_dir: {disk}\n")
    cluster = Cluster(2, replica_command(args, config, disk), workdir, router=args.router, port=free_port())
    cluster.start()

    def server(url: str) -> dict[str, Any]:
        return {"chat_url": lambda agent: f"{url}/v1/chat/completions",
                "model": (lambda agent: "assistant") if args.tiny else (lambda agent: agent)}

    def sticky(spec: dict[str, Any]) -> dict[str, str]:
        return {"X-Session-Id": f"run-{spec['session']}"}

    histories: dict[str, list] = {}
    try:
        for replica in cluster.members:
            wait_healthy(replica.url, replica.process.proc, replica.process.log_path, "/ready", args.timeout,
                         every_program=True)
        asyncio.run(agents_http.run_workload(server(cluster.url), work, args, headers=sticky,
                                             turns=range(args.turns - 1), histories=histories))
        live, target = cluster.members, server(cluster.url)
        if variant != "no_failover":
            victim, live = cluster.members[0], cluster.members[1:]
            while disk != "off" and metric(victim.url, "slotserve_disk_tier_pending"):
                time.sleep(0.05)
            victim.process.kill()
            target = server(live[0].url)
        urls = [replica.url for replica in live]
        before = counters(urls)
        last = asyncio.run(agents_http.run_workload(target, work, args, headers=sticky,
                                                    turns=range(args.turns - 1, args.turns), histories=histories))
        after = counters(urls)
    finally:
        cluster.stop()
    records = last["records"]
    ok = [r for r in records if not r["error"]]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    result = {
        "variant": variant, "requests": len(records), "errors": len(records) - len(ok),
        "error_samples": [r["error"] for r in records if r["error"]][:3],
        "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in ok if r["usage"]),
        "cached_tokens": sum(((r["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                             for r in ok),
        "prefill_tokens_computed": int(sum(a["prefill_tokens"] - b.get("prefill_tokens", 0)
                                           for a, b in zip(after, before, strict=True))),
        "disk_restores": int(sum(a.get("disk_restores", 0) - b.get("disk_restores", 0)
                                 for a, b in zip(after, before, strict=True))),
        **{f"ttft_p{q}_s": round(percentile(ttfts, q / 100), 4) if ttfts else None for q in (50, 90)},
    }
    print(f"{variant}: {result}", file=sys.stderr, flush=True)
    return result


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name} ")), 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", default="vllm-router", choices=("vllm-router", "haproxy"))
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--config", default=None, help="YAML config for `slotserve serve` (default: agents: the "
                                                       "config agents_http.py generates; sessions: the default)")
    parser.add_argument("--tiny", action="store_true", help="replicas on the tests' tiny model (tests/tiny_server.py)")
    parser.add_argument("--workload", default="agents", choices=("agents", "sessions"),
                        help="agents: agents_http.py's (full history resent); sessions: server-side history")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8, help="sessions in flight (and slots per replica)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-words", type=int, default=None, help="default 1150 (--tiny: 60)")
    parser.add_argument("--user-words", type=int, default=None, help="default 25 (--tiny: 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--failover", action="store_true",
                        help="two replicas, one killed before the last turn: with a shared disk tier, without, "
                             "and no kill (agents workload)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.system_words is None:
        args.system_words = 60 if args.tiny else 1150
    if args.user_words is None:
        args.user_words = 8 if args.tiny else 25
    name = f"scale-out-{'failover-' if args.failover else ''}{args.router}{'-tiny' if args.tiny else ''}.json"
    out = Path(args.out or REPO / "benchmarks" / "results" / name)
    keys = ("sessions", "turns", "concurrency", "max_tokens")
    if args.workload == "agents":
        keys = ("agents", *keys, "system_words", "user_words", "seed")
    report = {"benchmark": "scale_out", "router": args.router, "tiny": args.tiny,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "commit": git_commit(mark_dirty=True), "host": host(), "argv": sys.argv[1:],
              "machine": platform.machine(),
              "workload": {"kind": args.workload, **{k: getattr(args, k) for k in keys}},
              "runs": [measure_failover(v, args) for v in FAILOVER_VARIANTS] if args.failover
              else [measure(n, args) for n in args.replicas]}
    save_report(out, report)

if __name__ == "__main__":
    main()
