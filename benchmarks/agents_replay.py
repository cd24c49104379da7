#!/usr/bin/env python3
"""Multi-agent replay through the scheduler: prefix caching ON vs OFF on the same engine, in one process.

Run from the repository root:

    python3 benchmarks/agents_replay.py --model default                       # the full workload (fast machines)
    python3 benchmarks/agents_replay.py --model default --dtype float32 --agents 4 --sessions-per-agent 2 \\
        --turns 3 --system-tokens 600 --user-tokens 24 --max-tokens 16 --slots 4 --max-len 1024 \\
        --order alternate --repeats 2      # 2-core CPU scale: writes benchmarks/results/agents-replay-cpu.json

The CPU scale keeps sessions > slots (8 sessions over 4 slots, as the full workload has 32 over 8), so slots are
recycled and the host tier carries conversations between turns; --max-len 1024 fits the longest turn (750
positions) and keeps the decode step and the snapshots small.

Workload: A agents, each with its own system prompt (synthetic English from a fixed word list, tokenized with
the model's tokenizer, deterministic in --seed); each agent runs P sessions; each session runs T turns one after
another, and every session runs concurrently (a session submits turn t as soon as turn t-1 has finished). The
prompt of turn t is plain token concatenation with chat-like separators (no chat template):

    <bos><start_of_turn>user\\n SYSTEM
    ( <end_of_turn>\\n<start_of_turn>user\\n USER_k <end_of_turn>\\n<start_of_turn>model\\n OUTPUT_k )  k < t
      <end_of_turn>\\n<start_of_turn>user\\n USER_t <end_of_turn>\\n<start_of_turn>model\\n

SYSTEM is padded/truncated so that the whole first line is exactly --system-tokens; USER_k is exactly
--user-tokens. Greedy decoding (temperature 0) with ignore_eos, so every request generates exactly --max-tokens
and both modes do the same work. Requests carry affinity=<agent>/<session>, the agent as group and
cache scope (as agents.service sets them) and boundaries=(len(system),).

Each mode is a fresh Scheduler over the same Engine (compiled once by warmup(), then an untimed warm pass
through a throwaway scheduler): a new scheduler starts with an empty slot table and an empty host tier and
never reads KV it did not write itself, so no mode inherits cache state from another; running the modes in
sequence exposes them only to drift in machine load. --order alternate runs pairs in ABBA order (OFF ON, ON OFF,
OFF ON, ...), so each mode runs equally often first and a drift linear in time cancels over two pairs; the
summary takes the median over each mode's runs.

Latency is measured on the consumer side: one thread per session iterates RequestHandle.events() with the
engine loop on its own thread (Scheduler.start()) and stamps time.perf_counter() on each event. TTFT = first
TokenEvent - submit; inter-token latency = gaps between consecutive TokenEvents of one request. The scheduler
hands events over once per iteration, and the iteration that finishes a prompt's prefill also runs the batched
decode step for it, so the first two tokens of a request arrive together (one ~0 ms gap per request); see
`itl_same_delivery_fraction`. The engine calls are wrapped with timers that block on their results (a few
ms of lost host/device overlap per step) to show where time goes; --no-engine-timers turns that off.

Prints one JSON document and writes it (default benchmarks/results/agents-replay-<backend>.json), rewriting it
after each run so an interrupted benchmark keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import random
import shlex
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402 - after the path set-up that makes it importable
    RESULTS,
    dist_ms,
    host,
    log,
    percentile,
    save_report,
    source_info,
)

USER_OPEN = "<end_of_turn>\n<start_of_turn>user\n"
MODEL_OPEN = "<end_of_turn>\n<start_of_turn>model\n"
SYSTEM_OPEN = "<start_of_turn>user\n"

_WORD_LIST = (
    "the a an and or but if when while because so then also only just very more most less each every some any "
    "agent task tool plan step result report file code test build run check error value input output data user "
    "system model server request response session cache memory slot token prompt query answer search summary "
    "list table record field number name date time hour day week month year team project issue change review "
    "update write read open close start stop send receive create delete move copy find sort filter merge split "
    "quick careful simple clear short long large small new old first last next previous current final main "
    "important useful correct wrong safe ready free busy local remote public private shared single multiple "
    "should must can will may might could would always never often sometimes usually please note remember "
    "ensure avoid prefer keep use return call ask tell explain describe compare list count measure estimate "
    "with without for from into onto over under after before during between across through about against"
)
WORDS = _WORD_LIST.split()


# ---- workload -------------------------------------------------------------------------------------------

def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
    return " ".join(words).capitalize() + rng.choice((".", ".", ".", "?", ":"))


def text_tokens(tokenizer: Any, rng: random.Random, n: int, lead: str = "") -> list[int]:
    """Exactly n tokens of synthetic prose (plain encode: never control tokens)."""
    text = lead
    ids = tokenizer.encode(text) if text else []
    while len(ids) < n:
        text += (" " if text else "") + " ".join(sentence(rng) for _ in range(max(1, (n - len(ids)) // 12)))
        ids = tokenizer.encode(text)
    return ids[:n]


@dataclass
class SessionSpec:
    agent: str
    session: str  # "<agent>/<session>"
    system: list[int]
    users: list[list[int]]  # one per turn


def build_workload(tokenizer: Any, args: argparse.Namespace) -> tuple[list[SessionSpec], dict[str, list[int]]]:
    rng = random.Random(args.seed)
    seps = {name: tokenizer.encode_with_special(text) for name, text in
            (("system_open", SYSTEM_OPEN), ("user_open", USER_OPEN), ("model_open", MODEL_OPEN))}
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    head = bos + seps["system_open"]
    if args.system_tokens <= len(head):
        raise SystemExit(f"--system-tokens must exceed the {len(head)}-token system header")
    specs = []
    for a in range(args.agents):
        agent = f"agent{a}"
        lead = (f"You are {agent}, an assistant that works on {rng.choice(WORDS)} {rng.choice(WORDS)} tasks. "
                "Follow these instructions.")
        system = head + text_tokens(tokenizer, rng, args.system_tokens - len(head), lead)
        for p in range(args.sessions_per_agent):
            users = [text_tokens(tokenizer, rng, args.user_tokens) for _ in range(args.turns)]
            specs.append(SessionSpec(agent=agent, session=f"{agent}/s{p}", system=system, users=users))
    return specs, seps


def longest_prompt(args: argparse.Namespace, seps: dict[str, list[int]]) -> int:
    per_turn = len(seps["user_open"]) + args.user_tokens + len(seps["model_open"])
    return args.system_tokens + args.turns * per_turn + (args.turns - 1) * args.max_tokens


# ---- engine timers --------------------------------------------------------------------------------------

class EngineTimers:
    """Wraps engine methods on the instance (shadowing the class's) with timers that block on the result."""

    METHODS = ("prefill_chunk", "decode", "sample", "sample_slot", "begin_request",
               "save_slot", "restore_slot", "copy_prefix")

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.chunks: dict[int, list[float]] = defaultdict(list)  # compiled chunk size -> [real tokens, seconds]

    def install(self) -> None:
        import jax

        engine = self.engine
        for name in self.METHODS:
            original = getattr(type(engine), name).__get__(engine)

            def timed(*a, _name=name, _fn=original, **kw):
                begin = time.perf_counter()
                out = _fn(*a, **kw)
                jax.block_until_ready(out if out is not None else engine.cache)
                elapsed = time.perf_counter() - begin
                self.seconds[_name] += elapsed
                self.calls[_name] += 1
                if _name == "prefill_chunk":  # (slot, tokens, start): the engine pads to the covering size
                    n = len(a[1])
                    entry = self.chunks[next(c for c in engine.config.chunk_sizes if c >= n)]
                    entry[:] = [entry[0] + n, entry[1] + elapsed, entry[2] + 1] if entry else [n, elapsed, 1]
                return out

            setattr(engine, name, timed)

    def remove(self) -> None:
        for name in self.METHODS:
            self.engine.__dict__.pop(name, None)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.chunks.clear()

    def report(self, wall: float) -> dict[str, Any]:
        s = self.seconds
        groups = {
            "prefill_s": s["prefill_chunk"] + s["sample_slot"],
            "decode_s": s["decode"] + s["sample"],
            "host_tier_and_copies_s": s["save_slot"] + s["restore_slot"] + s["copy_prefix"],
            "begin_request_s": s["begin_request"],
        }
        busy = sum(groups.values())
        return {
            **{k: round(v, 3) for k, v in groups.items()},
            "engine_busy_s": round(busy, 3),
            "engine_busy_fraction_of_wall": round(busy / wall, 3) if wall else None,
            "calls": dict(self.calls),
            "seconds_by_method": {k: round(v, 3) for k, v in s.items()},
            "ms_per_call": {k: round(s[k] / c * 1e3, 2) for k, c in self.calls.items() if c},
            "prefill_padded_tokens": sum(size * calls for size, (_, _, calls) in self.chunks.items()),
            "prefill_chunks_by_size": {
                size: {"calls": calls, "real_tokens": real, "ms_per_call": round(sec / calls * 1e3, 1)}
                for size, (real, sec, calls) in sorted(self.chunks.items())},
        }


# ---- one replay ----------------------------------------------------------------------------------------

@dataclass
class TurnRecord:
    session: str
    agent: str
    turn: int
    prompt_tokens: int
    submitted: float
    token_times: list[float]
    token_iterations: list[int]
    ids: list[int]
    reason: str | None = None
    cached_tokens: int | None = None
    server_timings: dict[str, float] | None = None
    error: str | None = None


def session_worker(sched: Any, spec: SessionSpec, seps: dict[str, list[int]], args: argparse.Namespace,
                   barrier: threading.Barrier, out: list[TurnRecord]) -> None:
    from core.sampling import SamplingParams
    from scheduler.request import FinishEvent, GenerationRequest, TokenEvent

    greedy = SamplingParams(temperature=0.0)
    history = list(spec.system)
    barrier.wait()
    for turn, user in enumerate(spec.users, start=1):
        prompt = history + seps["user_open"] + user + seps["model_open"]
        record = TurnRecord(session=spec.session, agent=spec.agent, turn=turn, prompt_tokens=len(prompt),
                            submitted=0.0, token_times=[], token_iterations=[], ids=[])
        out.append(record)
        try:
            request = GenerationRequest(prompt_ids=tuple(prompt), sampling=greedy, max_tokens=args.max_tokens,
                                        ignore_eos=True, affinity=spec.session, group=spec.agent,
                                        cache_scope=spec.agent,
                                        boundaries=(len(spec.system),))
            record.submitted = time.perf_counter()
            handle = sched.submit(request)
            for event in handle.events(timeout=args.event_timeout):
                now = time.perf_counter()
                if isinstance(event, TokenEvent):
                    record.token_times.append(now)
                    record.token_iterations.append(event.iteration)
                    record.ids.append(event.token_id)
                elif isinstance(event, FinishEvent):
                    record.reason = str(event.reason)
                    record.cached_tokens = event.usage.cached_tokens
                    record.server_timings = dict(event.timings)
                    if event.error:
                        record.error = event.error
        except Exception as exc:  # a benchmark records failures and goes on
            record.error = f"{type(exc).__name__}: {exc}"
        if record.error is None and (record.reason != "length" or len(record.ids) != args.max_tokens):
            record.error = f"finished {record.reason} after {len(record.ids)} of {args.max_tokens} tokens"
        if record.error is not None:
            return  # later turns depend on this one's output
        history = prompt + record.ids


def replay(engine: Any, tokenizer: Any, specs: list[SessionSpec], seps: dict[str, list[int]],
           args: argparse.Namespace, caching: bool, timers: EngineTimers | None) -> tuple[dict[str, Any], dict]:
    """One run: every session through a fresh scheduler with prefix caching ``caching``. Returns the run's
    figures and the generated ids of each (session, turn), by which runs are compared."""
    from scheduler.scheduler import Scheduler, SchedulerConfig

    config = SchedulerConfig(prefill_budget=args.prefill_budget, max_waiting=args.max_waiting,
                             prefix_caching=caching, host_tier_bytes=args.host_tier_bytes,
                             min_snapshot_tokens=args.min_snapshot_tokens)
    sched = Scheduler(engine, tokenizer, config, stop_ids=frozenset(tokenizer.stop_ids))
    records, begin, wall = run_sessions(sched, specs, seps, args, timers)
    stats = sched.counters()
    expected = len(specs) * args.turns
    generated = sum(len(r.ids) for r in records)
    result: dict[str, Any] = {
        "prefix_caching": caching,
        "requests": len(records),
        "requests_expected": expected,
        "errors": run_errors(records, expected),
        "generated_tokens": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 3) if wall else None,
        **consumer_latency(records),
        **server_latency(records),
        **prefill_figures(stats),
        "scheduler_stats": stats,
        "host_tier": sched.host.stats(),
    }
    if timers is not None:
        result["engine_time"] = timers.report(wall)
    result["requests_detail"] = requests_detail(records, begin)
    outputs = {(r.session, r.turn): r.ids for r in records}
    return result, outputs


def run_sessions(sched: Any, specs: list[SessionSpec], seps: dict[str, list[int]], args: argparse.Namespace,
                 timers: EngineTimers | None) -> tuple[list[TurnRecord], float, float]:
    """Every session on its own consumer thread, all released at once after the engine loop has started.
    Returns the turn records, the release time and the wall time up to the last token; the scheduler is
    stopped on return."""
    records: list[TurnRecord] = []
    barrier = threading.Barrier(len(specs) + 1)
    threads = [threading.Thread(target=session_worker, args=(sched, spec, seps, args, barrier, records),
                                name=f"consumer-{spec.session}", daemon=True) for spec in specs]
    for thread in threads:
        thread.start()
    if timers is not None:
        timers.reset()
    sched.start()
    barrier.wait()
    begin = time.perf_counter()
    for thread in threads:
        thread.join()
    end = max((r.token_times[-1] for r in records if r.token_times), default=time.perf_counter())
    sched.stop()
    return records, begin, end - begin


def run_errors(records: list[TurnRecord], expected: int) -> list[str]:
    """One line per failed turn, and one for the turns a failure kept from being submitted."""
    errors = [f"{r.session} turn {r.turn}: {r.error}" for r in records if r.error]
    if len(records) < expected:
        errors.append(f"{expected - len(records)} turns never submitted (an earlier turn of their session failed)")
    return errors


def consumer_latency(records: list[TurnRecord]) -> dict[str, Any]:
    """TTFT and inter-token latency as the consumer threads stamped them (see the module docstring)."""
    ttft = [r.token_times[0] - r.submitted for r in records if r.token_times]
    itl, same_delivery = [], 0
    for r in records:
        itl.extend(b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False))
        same_delivery += sum(a == b for a, b in zip(r.token_iterations, r.token_iterations[1:], strict=False))
    by_turn = defaultdict(list)
    for r in records:
        if r.token_times:
            by_turn[r.turn].append(r.token_times[0] - r.submitted)
    return {
        "ttft": dist_ms(ttft, 1),
        "ttft_p50_ms_by_turn": {t: round(percentile(v, 0.5) * 1e3, 1) for t, v in sorted(by_turn.items())},
        "itl": dist_ms(itl, 1),
        "itl_same_delivery_fraction": round(same_delivery / len(itl), 3) if itl else None,
    }


def server_latency(records: list[TurnRecord]) -> dict[str, Any]:
    """The scheduler's own timings of each request: how much of its TTFT went to waiting for a slot, and how
    long a first token took to reach the consumer after the scheduler timed it."""
    queue_s = [r.server_timings["queue_s"] for r in records if r.server_timings and "queue_s" in r.server_timings]
    admit_to_first = [r.server_timings["ttft_s"] - r.server_timings["queue_s"] for r in records
                      if r.server_timings and "ttft_s" in r.server_timings and "queue_s" in r.server_timings]
    server_ttft = sum(r.server_timings["ttft_s"] for r in records if r.server_timings and "queue_s" in r.server_timings
                      and "ttft_s" in r.server_timings)
    lag = [r.token_times[0] - r.submitted - r.server_timings["ttft_s"] for r in records
           if r.token_times and r.server_timings and "ttft_s" in r.server_timings]
    return {
        "server_queue": dist_ms(queue_s, 1),
        "server_admit_to_first_token": dist_ms(admit_to_first, 1),
        "ttft_share_waiting_for_slot": round(sum(queue_s) / server_ttft, 3) if server_ttft else None,
        "first_token_delivery_lag": dist_ms(lag, 1),
    }


def prefill_figures(stats: dict[str, Any]) -> dict[str, Any]:
    """Prompt tokens asked for vs computed, from the scheduler's counters: what prefix caching saved."""
    return {
        "prompt_tokens_requested": stats["prompt_tokens"],
        "prefill_tokens_computed": stats["prefill_tokens"],
        "prefill_computed_over_requested": round(stats["prefill_tokens"] / max(stats["prompt_tokens"], 1), 4),
        "cached_over_prompt_tokens": round(stats["cached_tokens"] / max(stats["prompt_tokens"], 1), 4),
        "hit_request_fraction": round(stats["cache_hit_requests"] / max(stats["requests_admitted"], 1), 4),
    }


def requests_detail(records: list[TurnRecord], begin: float) -> list[dict[str, Any]]:
    """One row per turn in submission order, times relative to the run's start."""
    detail = []
    for r in sorted(records, key=lambda r: r.submitted):
        t = r.server_timings or {}
        detail.append({"session": r.session, "turn": r.turn, "prompt_tokens": r.prompt_tokens,
                       "cached_tokens": r.cached_tokens, "submitted_s": round(r.submitted - begin, 3),
                       "ttft_ms": round((r.token_times[0] - r.submitted) * 1e3, 1) if r.token_times else None,
                       "queue_ms": round(t["queue_s"] * 1e3, 1) if "queue_s" in t else None,
                       "server_ttft_ms": round(t["ttft_s"] * 1e3, 1) if "ttft_s" in t else None,
                       "done_s": round(r.token_times[-1] - begin, 3) if r.token_times else None})
    return detail


def warm_pass(engine: Any, tokenizer: Any, args: argparse.Namespace) -> float:
    """Untimed: two short sessions of one agent through a caching scheduler (slot reuse, copy/restore paths)."""
    small = argparse.Namespace(**{**vars(args), "agents": 1, "sessions_per_agent": 2, "turns": 2,
                                  "system_tokens": min(args.system_tokens, 80), "user_tokens": min(args.user_tokens, 8),
                                  "max_tokens": min(args.max_tokens, 4), "seed": args.seed + 1_000_003})
    specs, seps = build_workload(tokenizer, small)
    begin = time.perf_counter()
    result, _ = replay(engine, tokenizer, specs, seps, small, caching=True, timers=None)
    if result["errors"]:
        raise RuntimeError(f"warm pass failed: {result['errors']}")
    return time.perf_counter() - begin


# ---- comparison and summary ----------------------------------------------------------------------------

def compare_outputs(reference: dict, other: dict) -> list[dict[str, Any]]:
    diffs = []
    for key in sorted(set(reference) | set(other)):
        a, b = reference.get(key), other.get(key)
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a or [], b or [], strict=False)) if x != y), None)
            diffs.append({"session": key[0], "turn": key[1], "first_difference_at": first,
                          "reference": a, "other": b})
    return diffs


def outputs_digest(outputs: dict) -> str:
    text = json.dumps([[k[0], k[1], v] for k, v in sorted(outputs.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


SUMMARY_KEYS = {
    "tokens_per_s": lambda r: r["tokens_per_s"],
    "wall_s": lambda r: r["wall_s"],
    "ttft_p50_ms": lambda r: r["ttft"].get("p50_ms"),
    "ttft_p99_ms": lambda r: r["ttft"].get("p99_ms"),
    "itl_p50_ms": lambda r: r["itl"].get("p50_ms"),
    "itl_p99_ms": lambda r: r["itl"].get("p99_ms"),
    "server_queue_p50_ms": lambda r: r["server_queue"].get("p50_ms"),
    "prefill_computed_over_requested": lambda r: r["prefill_computed_over_requested"],
    "cached_over_prompt_tokens": lambda r: r["cached_over_prompt_tokens"],
    "hit_request_fraction": lambda r: r["hit_request_fraction"],
    "ttft_share_waiting_for_slot": lambda r: r["ttft_share_waiting_for_slot"],
    "prefill_padded_tokens": lambda r: r.get("engine_time", {}).get("prefill_padded_tokens"),
    "engine_prefill_s": lambda r: r.get("engine_time", {}).get("prefill_s"),
    "engine_decode_s": lambda r: r.get("engine_time", {}).get("decode_s"),
    "decode_ms_per_step": lambda r: r.get("engine_time", {}).get("ms_per_call", {}).get("decode"),
}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: the median over its runs of each headline figure; ON/OFF ratios of those medians."""
    out: dict[str, Any] = {}
    for mode, caching in (("off", False), ("on", True)):
        mine = [r for r in runs if r["prefix_caching"] is caching]
        out[mode] = {key: (statistics.median(vals) if (vals := [v for r in mine if (v := get(r)) is not None])
                           else None) for key, get in SUMMARY_KEYS.items()}
        out[mode]["runs"] = len(mine)
        out[mode]["prefill_tokens_computed"] = mine[0]["prefill_tokens_computed"] if mine else None
        out[mode]["prompt_tokens_requested"] = mine[0]["prompt_tokens_requested"] if mine else None
        out[mode]["errors"] = sum(len(r["errors"]) for r in mine)
    ratios = {}
    for key in ("tokens_per_s", "wall_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                "prefill_computed_over_requested"):
        on, off = out["on"][key], out["off"][key]
        ratios[key] = round(on / off, 3) if on is not None and off else None
    out["ratio_on_over_off"] = ratios
    if len(runs) > 2:
        out["ratio_per_pair"] = [
            {key: round(on[key] / off[key], 3) for key in ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms")
             if on.get(key) and off.get(key)}
            for off, on in _pairs(runs)]
    return out


def _pairs(runs: list[dict[str, Any]]):
    offs = [{k: g(r) for k, g in SUMMARY_KEYS.items()} for r in runs if not r["prefix_caching"]]
    ons = [{k: g(r) for k, g in SUMMARY_KEYS.items()} for r in runs if r["prefix_caching"]]
    return zip(offs, ons, strict=False)


# ---- driver --------------------------------------------------------------------------------------------

def mode_order(args: argparse.Namespace) -> list[bool]:
    if args.order == "off-on":
        return [False] * args.repeats + [True] * args.repeats
    if args.order == "on-off":
        return [True] * args.repeats + [False] * args.repeats
    order: list[bool] = []
    for i in range(args.repeats):  # ABBA: OFF ON, ON OFF, OFF ON, ...
        order += [False, True] if i % 2 == 0 else [True, False]
    return order


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="default", help='a checkpoint ("default": the packaged Gemma 3 270M)')
    p.add_argument("--dtype", default=None, help="compute dtype (default: core.device.choose_dtype)")
    p.add_argument("--kv-dtype", default=None, help='"int8" (default: the compute dtype)')
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--sessions-per-agent", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=1500, help="system block length, header included")
    p.add_argument("--user-tokens", type=int, default=40, help="user message length, separators excluded")
    p.add_argument("--max-tokens", type=int, default=32, help="generated tokens per turn (ignore_eos: exact)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--chunk-sizes", default="32,128,512")
    p.add_argument("--prefill-budget", type=int, default=None,
                   help="prefill tokens per scheduler iteration (default: the largest chunk)")
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument("--host-tier-bytes", type=int, default=2 * 2**30)
    p.add_argument("--min-snapshot-tokens", type=int, default=16)
    p.add_argument("--order", choices=("off-on", "on-off", "alternate"), default="off-on",
                   help="run order of the modes (alternate: pairs in ABBA order, OFF ON ON OFF OFF ON ...)")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--event-timeout", type=float, default=900.0, help="seconds a consumer waits for one event")
    p.add_argument("--no-engine-timers", dest="engine_timers", action="store_false",
                   help="do not wrap engine calls with blocking timers")
    p.add_argument("--no-warm-pass", dest="warm_pass", action="store_false",
                   help="skip the untimed warm pass through a throwaway scheduler")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                   help="do not use the persistent compile cache (compile time is not measured here)")
    p.add_argument("--platform", default=None, help="JAX platform (cpu, cuda, ...)")
    p.add_argument("--out", default=None, help="result file (default: benchmarks/results/agents-replay-<backend>.json)")
    args = p.parse_args(argv)
    args.chunk_sizes = tuple(int(x) for x in args.chunk_sizes.split(","))
    for name in ("agents", "sessions_per_agent", "turns", "user_tokens", "max_tokens", "slots", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def start_jax(args: argparse.Namespace) -> str:
    """Set JAX up for --platform before anything imports it (and the compile cache unless turned off); the
    backend it chose."""
    from core.device import configure_environment

    configure_environment(args.platform)
    import jax

    from core.compile_cache import enable_compile_cache

    if args.compile_cache:
        enable_compile_cache()
    return jax.default_backend()


def build_engine(args: argparse.Namespace, backend: str) -> tuple[Any, Any, list[SessionSpec], dict[str, list[int]]]:
    """The model, the workload on its tokenizer (refused before the engine is built when its last turn
    does not fit --max-len) and the engine every run shares."""
    from core.engine import Engine, EngineConfig
    from core.runtime import load_model

    log(f"backend {backend}: loading {args.model}")
    model = load_model(args.model, dtype=args.dtype)
    specs, seps = build_workload(model.tokenizer, args)
    need = longest_prompt(args, seps) + args.max_tokens
    if need > args.max_len:
        raise SystemExit(f"the last turn needs {need} positions; raise --max-len (now {args.max_len})")
    config = EngineConfig(num_slots=args.slots, max_len=args.max_len, chunk_sizes=args.chunk_sizes,
                          kv_dtype=args.kv_dtype)
    engine = Engine(model.cfg, model.params, config, model.dtype)
    return model, engine, specs, seps


def metadata(args: argparse.Namespace, argv: list[str] | None, backend: str, model: Any) -> dict[str, Any]:
    """Where and how the figures were measured: the report's "meta"."""
    import jax
    import jaxlib

    return {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python3 benchmarks/agents_replay.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "argv": sys.argv[1:] if argv is None else argv,
        "source": source_info(),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None),
        "python": platform.python_version(),
        "backend": backend,
        "device_kind": jax.devices()[0].device_kind,
        "host_cpus": os.cpu_count(),
        "host": host(),
        "load_average_at_start": list(os.getloadavg()),
        "model": args.model,
        "dtype": model.dtype,
        "dtype_reason": model.dtype_reason,
        "kv_dtype": args.kv_dtype or model.dtype,
    }


def report_config(args: argparse.Namespace, specs: list[SessionSpec], seps: dict[str, list[int]]) -> dict[str, Any]:
    """Every option, and the workload and method they make: the report's "config"."""
    return {
        **{k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
        "prefill_budget_effective": args.prefill_budget or max(args.chunk_sizes),
        "sessions": len(specs),
        "requests": len(specs) * args.turns,
        "separators": {name: ids for name, ids in seps.items()},
        "longest_prompt_tokens": longest_prompt(args, seps),
        "sampling": "greedy (temperature 0), ignore_eos, exact max_tokens per turn",
        "run_order": ["on" if c else "off" for c in mode_order(args)],
        "latency_clock": "consumer side: time.perf_counter() per event, one thread per session, "
                         "engine loop on its own thread (Scheduler.start)",
    }


def warm_up(engine: Any, tokenizer: Any, args: argparse.Namespace, meta: dict[str, Any]) -> None:
    """Compile every program, then run the warm pass (unless --no-warm-pass), so that no run pays for
    either; their durations go into ``meta``."""
    meta["compile_seconds"] = round(engine.warmup(), 2)
    log(f"compiled in {meta['compile_seconds']} s")
    if args.warm_pass:
        meta["warm_pass_seconds"] = round(warm_pass(engine, tokenizer, args), 2)
        log(f"warm pass {meta['warm_pass_seconds']} s")


def run_modes(engine: Any, tokenizer: Any, specs: list[SessionSpec], seps: dict[str, list[int]],
              args: argparse.Namespace, runs: list[dict[str, Any]],
              save: Callable[[], None]) -> tuple[dict | None, list[dict[str, Any]]]:
    """Every run in --order, each appended to ``runs`` and saved as soon as it ends (an interrupted benchmark
    keeps what it measured). Returns the first run's outputs and where a later run's differ from them."""
    timers = EngineTimers(engine) if args.engine_timers else None
    if timers is not None:
        timers.install()
    reference = None
    mismatches: list[dict[str, Any]] = []
    for i, caching in enumerate(mode_order(args)):
        label = "ON" if caching else "OFF"
        log(f"run {i + 1}: prefix caching {label}")
        result, outputs = replay(engine, tokenizer, specs, seps, args, caching, timers)
        result["run"] = i + 1
        result["load_average_after"] = list(os.getloadavg())
        result["outputs_sha256_16"] = outputs_digest(outputs)
        runs.append(result)
        if reference is None:
            reference = outputs
        else:
            for diff in compare_outputs(reference, outputs):
                mismatches.append({"run": i + 1, "prefix_caching": caching, **diff})
        log_run(i + 1, label, result)
        save()
    if timers is not None:
        timers.remove()
    return reference, mismatches


def log_run(run: int, label: str, result: dict[str, Any]) -> None:
    """One line of progress per run: its headline figures."""
    log(f"run {run} {label}: {result['tokens_per_s']} tok/s, wall {result['wall_s']} s, "
        f"TTFT p50 {result['ttft'].get('p50_ms')} ms p99 {result['ttft'].get('p99_ms')} ms, "
        f"ITL p50 {result['itl'].get('p50_ms')} ms p99 {result['itl'].get('p99_ms')} ms, "
        f"prefill {result['prefill_tokens_computed']}/{result['prompt_tokens_requested']}, "
        f"errors {len(result['errors'])}")


def conclude(report: dict[str, Any], reference: dict | None, mismatches: list[dict[str, Any]], out: Path) -> int:
    """The output comparison and the summary into ``report``, written and printed; the exit status: 0 when
    every run gave the same outputs without errors."""
    digests = [r["outputs_sha256_16"] for r in report["runs"]]
    report["outputs_identical"] = not mismatches and len(set(digests)) == 1
    report["outputs_compared"] = {"unit": "generated token ids per (session, turn)", "against": "run 1",
                                  "requests_per_run": len(reference or {}), "mismatches": mismatches[:20],
                                  "mismatch_count": len(mismatches)}
    report["summary"] = summarize(report["runs"])
    report["meta"]["load_average_at_end"] = list(os.getloadavg())
    save_report(out, report)
    log(f"outputs identical: {report['outputs_identical']}; wrote {out}")
    return 0 if report["outputs_identical"] and not any(r["errors"] for r in report["runs"]) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = start_jax(args)
    out = Path(args.out) if args.out else RESULTS / f"agents-replay-{backend}.json"
    model, engine, specs, seps = build_engine(args, backend)
    report: dict[str, Any] = {"meta": metadata(args, argv, backend, model), "config": report_config(args, specs, seps),
                              "runs": []}

    def save() -> None:
        save_report(out, report, echo=False)

    log(f"{len(specs)} sessions x {args.turns} turns over {args.slots} slots, prompts up to "
        f"{longest_prompt(args, seps)} tokens; compiling")
    warm_up(engine, model.tokenizer, args, report["meta"])
    reference, mismatches = run_modes(engine, model.tokenizer, specs, seps, args, report["runs"], save)
    return conclude(report, reference, mismatches, out)


if __name__ == "__main__":
    sys.exit(main())
