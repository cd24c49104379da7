#!/usr/bin/env python3
"""One replica vs two behind the router (`slotserve cluster`): aggregate completion tokens/s and TTFT p90.

    .venv/bin/python benchmarks/scale_out.py --router vllm-router [--config my.yaml] [--replicas 1 2]
    .venv/bin/python benchmarks/scale_out.py --tiny        # the tests' tiny random model: checks the script

Workload: S sessions (X-Session-Id), each running T turns one after another (only the new user message is
sent: the server keeps the history), at most C sessions in flight; every turn streams max_tokens tokens with
ignore_eos, so every replica count generates the same number of tokens. For each replica count a fresh
cluster (its own redis-server, N replicas, the router) is started, warmed with one request per replica, then
measured. Not run in CI: on a 2-core CPU machine two replicas share the cores, so expect no gain there; the
figure that matters comes from one accelerator per replica.

Writes benchmarks/results/scale-out-<router>.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from server.cluster import Cluster, free_port  # noqa: E402

TINY_SERVER = REPO / "tests" / "tiny_server.py"


def replica_command(args: argparse.Namespace):
    def command(port: int, redis_url: str) -> list[str]:
        if args.tiny:
            return [sys.executable, str(TINY_SERVER), "--port", str(port), "--redis-url", redis_url]
        extra = ["--config", args.config] if args.config else []
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
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", default="vllm-router", choices=("vllm-router", "haproxy"))
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--config", default=None, help="YAML config for `slotserve serve`")
    parser.add_argument("--tiny", action="store_true", help="replicas on the tests' tiny model (tests/tiny_server.py)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    name = f"scale-out-{args.router}{'-tiny' if args.tiny else ''}.json"
    out = Path(args.out or REPO / "benchmarks" / "results" / name)
    report = {"benchmark": "scale_out", "router": args.router, "tiny": args.tiny,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": platform.machine(), "workload": {k: getattr(args, k) for k in
                                                           ("sessions", "turns", "concurrency", "max_tokens")},
              "runs": [measure(n, args) for n in args.replicas]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
