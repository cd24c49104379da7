#!/usr/bin/env python3
"""The mission's workload over HTTP, slotserve and llama.cpp's server side by side in one run.

    .venv/bin/python benchmarks/agents_http.py --llama-server "$(benchmarks/build_llama_server.sh)"

Workload (nothing the HTTP API does not carry: no scheduler hints): A agents, each with its own long system
prompt that the *client* sends as a system message (synthetic prose from a fixed word list, deterministic in
--seed; --system-words words, about 1,330 tokens by default); S sessions spread over the agents; every
session runs T turns one after another, resending the whole history (system message, every user message
and every reply the server gave); at most --concurrency sessions are in flight at once. Every request
streams with the same sampling (`SAMPLING`: temperature 0.7 and llama.cpp's default truncation, stated to
both) and a seed fixed per (session, turn), so the histories are sampled model output (the base model still
repeats many of its earlier replies word for word), and stops where the transcript layout's turn ends
(llama.cpp renders the same layout: `LLAMA_CHAT_TEMPLATE`).
The two servers see their own replies, so their prompts differ slightly after the first turn.

Each server runs as its own process, started the way a user starts it: `slotserve serve` on a generated
config (one agent per workload agent, no agent system prompt) and `llama-server -np <concurrency>` on the
same GGUF with a context of concurrency x 8192 positions. Measured per server: wall time of the workload,
prompt tokens, prefill tokens computed (slotserve: its /metrics counter; llama.cpp: the `timings.prompt_n` it
reports per request), unique prompt tokens (the number of distinct token prefixes over every prompt, rendered
with slotserve's chat template: what a perfect prefix cache would compute), the hit ratio, TTFT p50/p90/p99
and completion tokens per second. After the workload, one new ~2,000-token request is sent twice to each
server: cold and warm TTFT.

Writes benchmarks/results/agents-http-cpu.json (or --out), rewritten after every phase.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agents.transcript_template import STOP_STRINGS  # noqa: E402
from benchmarks.common import (  # noqa: E402 - after the path set-up that makes it importable
    child_process,
    default_gguf,
    free_port,
    git_commit,
    host,
    llama_command,
    log,
    percentile,
    save_report,
    sse_chunks,
    wait_healthy,
)

_WORD_TEXT = (
    "the a and or but if when because so then also only agent task tool plan step result report file code test "
    "build run check error value input output data user system model server request response session cache "
    "memory token prompt query answer search summary list table record field number name date time team project "
    "issue change review update write read open close start stop send create delete move copy find sort filter "
    "merge split quick careful simple clear short long new old first last next current final main important "
    "useful correct safe ready local remote shared single multiple should must can will may always never often "
    "please note remember ensure avoid prefer keep use return call ask tell explain describe compare count"
)
WORDS = _WORD_TEXT.split()
# Both servers sample alike and end a turn alike: llama.cpp's default truncation, said explicitly to ours, and
# the stop strings of the transcript layout both render (ours would stop there without being told).
SAMPLING = {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "stop": list(STOP_STRINGS)}


def prose(rng: random.Random, words: int) -> str:
    out, n = [], 0
    while n < words:
        k = rng.randint(6, 16)
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
        n += k
    return " ".join(out)


def build_workload(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    agents = [f"agent{a}" for a in range(args.agents)]
    systems = {a: f"You are {a}, an assistant for {rng.choice(WORDS)} work. " + prose(rng, args.system_words)
               for a in agents}
    sessions = []
    for s in range(args.sessions):
        agent = agents[s % len(agents)]
        users = [f"Task {t + 1} of session {s}: " + prose(rng, args.user_words) for t in range(args.turns)]
        sessions.append({"agent": agent, "session": f"s{s}", "users": users})
    return {"systems": systems, "sessions": sessions}


# ---- the client ---------------------------------------------------------------------------------------------

async def stream_chat(client: Any, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"text": "", "ttft_s": None, "usage": None, "timings": None, "error": None,
                           "finish_reason": None}
    begin = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                out["error"] = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return out
            async for chunk in sse_chunks(response):
                if "error" in chunk:
                    out["error"] = str(chunk["error"])[:300]
                    break
                out["usage"] = chunk.get("usage") or out["usage"]
                out["timings"] = chunk.get("timings") or out["timings"]
                for choice in chunk.get("choices") or []:
                    out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if out["ttft_s"] is None:
                            out["ttft_s"] = time.perf_counter() - begin
                        out["text"] += piece
    except Exception as e:  # noqa: BLE001 - recorded as this request's error
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    out["latency_s"] = time.perf_counter() - begin
    return out


async def run_workload(server: dict[str, Any], work: dict[str, Any], args: argparse.Namespace,
                       headers: Callable[[dict[str, Any]], dict[str, str]] | None = None,
                       turns: range | None = None, histories: dict[str, list] | None = None) -> dict[str, Any]:
    """``headers``: extra request headers per session spec (scale_out.py: X-Session-Id, for sticky routing).
    ``turns``: only these turns of each session (default: all), continuing the session's history from
    ``histories`` (session -> messages so far, updated in place) when given (restart_warm.py)."""
    histories = {} if histories is None else histories
    import httpx

    gate = asyncio.Semaphore(args.concurrency)
    records: list[dict[str, Any]] = []
    prompts: list[list[dict[str, str]]] = []

    async def session(client: Any, spec: dict[str, Any], index: int) -> None:
        async with gate:
            history = histories.setdefault(spec["session"],
                                           [{"role": "system", "content": work["systems"][spec["agent"]]}])
            for turn in turns if turns is not None else range(len(spec["users"])):
                history.append({"role": "user", "content": spec["users"][turn]})
                body = {"model": server["model"](spec["agent"]), "messages": list(history),
                        "max_tokens": args.max_tokens, "seed": 1000 * index + turn, **SAMPLING,
                        "stream": True, "stream_options": {"include_usage": True}}
                prompts.append(list(history))
                got = await stream_chat(client, server["chat_url"](spec["agent"]), body,
                                        headers(spec) if headers else {})
                records.append({"session": spec["session"], "agent": spec["agent"], "turn": turn,
                                **{k: got[k] for k in ("ttft_s", "latency_s", "usage", "timings", "error",
                                                       "finish_reason", "text")}})
                history.append({"role": "assistant", "content": got["text"]})

    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.timeout)) as client:
        begin = time.perf_counter()
        await asyncio.gather(*(session(client, spec, i) for i, spec in enumerate(work["sessions"])))
        wall = time.perf_counter() - begin
    return {"wall_s": wall, "records": records, "prompts": prompts}


async def twice(server: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One new long request, sent twice (the second is a full prefix-cache hit)."""
    import httpx

    rng = random.Random(args.seed + 7)
    messages = [{"role": "system", "content": "You review reports. " + prose(rng, args.twice_words)},
                {"role": "user", "content": "Summarize the report above in one sentence."}]
    body = {"model": server["model"]("agent0"), "messages": messages, "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        cold = await stream_chat(client, server["chat_url"]("agent0"), body, {})
        warm = await stream_chat(client, server["chat_url"]("agent0"), body, {})
    return {"cold": {k: cold[k] for k in ("ttft_s", "usage", "timings", "error")},
            "warm": {k: warm[k] for k in ("ttft_s", "usage", "timings", "error")},
            "warm_over_cold_ttft": round(warm["ttft_s"] / cold["ttft_s"], 4)
            if cold["ttft_s"] and warm["ttft_s"] else None}


# ---- accounting -----------------------------------------------------------------------------------------------

def unique_prefix_tokens(prompts: list[list[int]]) -> int:
    """Distinct token prefixes over all prompts: the tokens a perfect prefix cache computes."""
    root: dict[int, dict] = {}
    count = 0
    for ids in prompts:
        node = root
        for token in ids:
            nxt = node.get(token)
            if nxt is None:
                nxt = node[token] = {}
                count += 1
            node = nxt
    return count


def summarize(run: dict[str, Any], template: Any, computed: int | None) -> dict[str, Any]:
    records = run["records"]
    ok = [r for r in records if not r["error"]]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in ok if r["usage"])
    completion = sum(r["usage"]["completion_tokens"] for r in ok if r["usage"])
    cached = sum(((r["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for r in ok)
    if computed is None:  # llama.cpp reports what it evaluated per request
        computed = sum((r["timings"] or {}).get("prompt_n", 0) for r in ok)
        cached = sum((r["timings"] or {}).get("cache_n", 0) for r in ok)
    rendered = [template.render("", messages).ids for messages in run["prompts"]]
    unique = unique_prefix_tokens(rendered)
    first = [r["ttft_s"] for r in ok if r["turn"] == 0 and r["ttft_s"] is not None]
    return {
        "requests": len(records), "errors": len(records) - len(ok), "error_samples": [r["error"] for r in records
                                                                                    if r["error"]][:3],
        "wall_s": round(run["wall_s"], 2),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": computed,
        "unique_prompt_tokens": unique,
        "computed_over_unique": round(computed / unique, 3) if unique else None,
        "cached_tokens_reported": cached,
        "hit_ratio": round(cached / prompt_tokens, 4) if prompt_tokens else None,
        "completion_tokens": completion,
        "completion_tokens_per_s": round(completion / run["wall_s"], 2),
        # a server that stops at end of turn decodes fewer tokens than one that runs to max_tokens
        "finish_reasons": dict(Counter(r["finish_reason"] for r in ok)),
        **{f"ttft_s_p{q}": round(percentile(ttfts, q / 100), 3) if ttfts else None for q in (50, 90, 99)},
        "ttft_s_max": round(max(ttfts), 3) if ttfts else None,
        "first_turn_ttft_s_p50": round(percentile(first, 0.5), 3) if first else None,
        "per_request": records,
    }


def first_turn_prompts_alike(ours: list[dict[str, Any]], llama: list[dict[str, Any]]) -> dict[str, int]:
    """How many first-turn prompts (the same messages to both servers) the two counted as the same number of
    tokens: with the two templates alike, all of them (a tokenization difference at a line start may shift
    a few by one)."""
    def counts(records: list[dict[str, Any]]) -> dict[str, int]:
        return {r["session"]: r["usage"]["prompt_tokens"] for r in records if r["turn"] == 0 and r["usage"]}

    a, b = counts(ours), counts(llama)
    both = a.keys() & b.keys()
    return {"compared": len(both), "equal": sum(a[s] == b[s] for s in both),
            "max_difference": max((abs(a[s] - b[s]) for s in both), default=0)}


# ---- servers ---------------------------------------------------------------------------------------------------

def scheduler_counters(url: str) -> dict[str, float]:
    """slotserve's scheduler counters from /metrics (prefill tokens computed, chunks, copies, restores, ...)."""
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("slotserve_scheduler_") and name.endswith("_total"):
            out[name[len("slotserve_scheduler_"):-len("_total")]] = float(value)
    return out


def ours(args: argparse.Namespace, work: dict[str, Any], tmp: Path) -> dict[str, Any]:
    agents_dir = tmp / "agents"
    agents_dir.mkdir()
    for agent in work["systems"]:
        (agents_dir / f"{agent}.yaml").write_text(f"name: {agent}\ndescription: benchmark agent\n")
    port = free_port()
    config = tmp / "server.yaml"
    config.write_text(f"model:\n  slots: {args.concurrency}\n  max_len: 8192\nserver:\n  port: {port}\n"
                      f"  log_level: warning\nagents_dir: {agents_dir}\nlimits:\n  max_body_bytes: 4194304\n"
                      f"scheduler:\n  speculative: {str(args.speculative == 'on').lower()}\n")
    cmd = [str(ROOT / ".venv/bin/slotserve"), "serve", "--config", str(config)]
    url = f"http://127.0.0.1:{port}"
    return {"name": "slotserve", "url": url, "command": cmd, "log": tmp / "slotserve.log", "ready_path": "/ready",
            "chat_url": lambda agent: f"{url}/agents/{agent}/v1/chat/completions", "model": lambda agent: agent}


def llama(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    port = free_port()
    cmd = llama_command(args.llama_server, args.gguf or default_gguf(), port, "-np", str(args.concurrency), "-t",
                        str(args.llama_threads), "-c", str(args.concurrency * 8192))
    url = f"http://127.0.0.1:{port}"
    return {"name": "llama.cpp", "url": url, "command": cmd, "log": tmp / "llama-server.log", "ready_path": "/health",
            "chat_url": lambda agent: f"{url}/v1/chat/completions", "model": lambda agent: "gemma"}


def run_server(kind: str, args: argparse.Namespace, work: dict[str, Any], template: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"agents-http-{kind}-") as name:
        tmp = Path(name)
        server = ours(args, work, tmp) if kind == "ours" else llama(args, tmp)
        log(f"{server['name']}: {' '.join(server['command'])}")
        with child_process(server["command"], log_path=server["log"], cwd=ROOT) as proc:
            return measure(kind, server, proc, args, work, template)


def measure(kind: str, server: dict[str, Any], proc: subprocess.Popen, args: argparse.Namespace,
            work: dict[str, Any], template: Any) -> dict[str, Any]:
    ready_s = wait_healthy(server["url"], proc, server["log"], server["ready_path"], args.start_timeout)
    log(f"{server['name']} ready after {ready_s:.1f} s")
    if kind == "ours":
        ready_s = wait_healthy(server["url"], proc, server["log"], server["ready_path"], args.start_timeout,
                               every_program=True)
        log(f"{server['name']}: every program compiled after {ready_s:.1f} s")
    asyncio.run(warm_up(server, args))
    before = scheduler_counters(server["url"]) if kind == "ours" else {}
    run = asyncio.run(run_workload(server, work, args))
    delta = {}
    if kind == "ours":
        after = scheduler_counters(server["url"])
        delta = {k: int(after[k] - before.get(k, 0)) for k in after if after[k] != before.get(k, 0)}
    result = summarize(run, template, delta.get("prefill_tokens"))
    if delta:
        result["scheduler_counters"] = delta
    result["twice"] = asyncio.run(twice(server, args))
    result.update({"command": server["command"], "ready_s": round(ready_s, 1)})
    log(f"{server['name']}: wall {result['wall_s']} s, computed {result['prefill_tokens_computed']} / unique "
        f"{result['unique_prompt_tokens']}, hit ratio {result['hit_ratio']}, TTFT p50/p90 "
        f"{result['ttft_s_p50']}/{result['ttft_s_p90']} s, twice {result['twice']['warm_over_cold_ttft']}")
    return result


async def warm_up(server: dict[str, Any], args: argparse.Namespace) -> None:
    """One tiny request, so that neither server's first measured request pays for lazy set-up."""
    import httpx

    body = {"model": server["model"]("agent0"), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "stream": True}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        await stream_chat(client, server["chat_url"]("agent0"), body, {})


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload's shape (`build_workload`, `run_workload`), shared with restart_warm.py."""
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8, help="sessions in flight (and slots / llama -np)")
    p.add_argument("--system-words", type=int, default=1150)
    p.add_argument("--user-words", type=int, default=25)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--start-timeout", type=float, default=900)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", default=None, help="llama.cpp server binary (benchmarks/build_llama_server.sh)")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the packaged Gemma 3 270M Q4_K_M)")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 2)
    add_workload_args(p)
    p.add_argument("--twice-words", type=int, default=1800)
    p.add_argument("--order", default="llama,ours", help="servers in the order they run")
    p.add_argument("--speculative", choices=("on", "off"), default="on",
                   help="slotserve's prompt-lookup speculation (scheduler.speculative; on: the shipped default)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/agents-http-cpu.json"))
    args = p.parse_args(argv)

    from agents.chat_template import ChatTemplate
    from core.tokenizer import Tokenizer

    template = ChatTemplate(Tokenizer.from_pretrained(default_gguf()))
    work = build_workload(args)
    report: dict[str, Any] = {
        "benchmark": "agents_http", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(mark_dirty=True), "host": host(), "argv": sys.argv[1:], "workload": {
            k: getattr(args, k) for k in ("agents", "sessions", "turns", "concurrency", "system_words", "user_words",
                                          "max_tokens", "seed")},
        "notes": "client-sent system prompts, full history resent, streaming, the same sampling and stop strings "
                 "sent to both servers with per-turn seeds, llama.cpp rendering slotserve's transcript layout; "
                 "no scheduler hints; unique tokens count distinct prefixes of the prompts as slotserve renders "
                 "them (each server's own history)",
        "sampling": SAMPLING,
        "servers": {},
    }
    for kind in [k.strip() for k in args.order.split(",") if k.strip()]:
        if kind == "llama" and not args.llama_server:
            continue
        report["servers"][kind] = run_server(kind, args, work, template)
        save_report(args.out, report, echo=False)
    if "ours" in report["servers"] and "llama" in report["servers"]:
        a, b = report["servers"]["ours"], report["servers"]["llama"]
        report["ours_over_llama"] = {
            "wall_s": round(a["wall_s"] / b["wall_s"], 3),
            "prefill_tokens_computed": round(a["prefill_tokens_computed"] / max(b["prefill_tokens_computed"], 1), 3),
            "ttft_s_p90": round(a["ttft_s_p90"] / b["ttft_s_p90"], 3),
        }
        report["first_turn_prompts_alike"] = first_turn_prompts_alike(a["per_request"], b["per_request"])
    save_report(args.out, {**report, "servers": {k: {kk: vv for kk, vv in v.items() if kk != "per_request"}
                                                 for k, v in report["servers"].items()}}, echo=True)
    save_report(args.out, report, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
