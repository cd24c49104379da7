"""structured.py's phases 3 and 4, off the engine's serving loop: the calibration outputs replayed through
fresh matchers (mask fill time, forced tokens, allowed-token counts), the walk that counts forced runs, and
what feeding those runs as prefill chunks would save (`time_payoff` times the steps it compares).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from benchmarks.common import dist_ms

# ---- phase 3: mask fill, replayed -------------------------------------------------------------------------------

def replay(variant: str, compiled: list[tuple[Any, Any]], paths: list[list[int]], stop_ids: frozenset[int],
           rows: int, words: int, forced: bool) -> dict[str, Any]:
    """Replay generated token paths through fresh matchers; time fill_masks and (optionally) forced_tokens."""
    matchers = [compiler.matcher(c) for compiler, c in compiled]
    fill_all, fill_one, ff_time, at, rejected = _replay_paths(matchers, paths, stop_ids, rows, words, forced)
    full_rows = [t for _, n, t in fill_all if n == rows]
    return {
        "variant": variant,
        "paths": len(paths),
        "path_lengths": [len(p) for p in paths],
        "fill_rows_all_live": dist_ms(full_rows, 3),
        "fill_rows_all_live_count": rows,
        "fill_any_live": dist_ms([t for _, _, t in fill_all], 3),
        "fill_one_row": dist_ms([t for _, t in fill_one], 3),
        "fill_one_row_by_position": _by_position(fill_one),
        "fill_all_live_by_position": _by_position([(i, t) for i, n, t in fill_all if n == rows]),
        "forced_tokens_call": dist_ms(ff_time, 3) if forced else None,
        "rejected": rejected,
        "_at": at,
    }


def _replay_paths(matchers: list[Any], paths: list[list[int]], stop_ids: frozenset[int], rows: int, words: int,
                  forced: bool) -> tuple[list[tuple[int, int, float]], list[tuple[int, float]], list[float],
                                         list[list[tuple[list[int], int]]], list[dict[str, Any]]]:
    """Position by position over every path still live: one fill of all live rows, then each row's own fill,
    allowed-token count and (``forced``) forced_tokens(), then every live matcher consumes its token.
    Returns (position, live rows, seconds) per fill of all rows, (position, seconds) per one-row fill, the
    forced_tokens() times, per path and position (forced tokens, allowed count), and the rejected tokens."""
    import numpy as np

    from scheduler.grammar import fill_masks

    many = np.full((rows, words), 0xFFFFFFFF, np.uint32)
    one = np.full((1, words), 0xFFFFFFFF, np.uint32)
    fill_all: list[tuple[int, int, float]] = []
    fill_one: list[tuple[int, float]] = []
    ff_time: list[float] = []
    at: list[list[tuple[list[int], int]]] = [[] for _ in paths]
    rejected = []
    for i in range(max(len(p) for p in paths)):
        live = [(m, r) for r, (m, p) in enumerate(zip(matchers, paths, strict=True))
                if i < len(p) and p[i] not in stop_ids and p[i] >= 0 and not m.is_finished() and m.error is None]
        if not live:
            break
        start = time.perf_counter()
        fill_masks(live, many)
        fill_all.append((i, len(live), time.perf_counter() - start))
        for m, r in live:
            start = time.perf_counter()
            fill_masks([(m, 0)], one)
            fill_one.append((i, time.perf_counter() - start))
            allowed = int(np.bitwise_count(one[0]).sum())
            ff: list[int] = []
            if forced:
                start = time.perf_counter()
                ff = list(m.forced_tokens())
                ff_time.append(time.perf_counter() - start)
            at[r].append((ff, allowed))
        for m, r in live:
            if not m.consume(paths[r][i]):
                rejected.append({"row": r, "position": i, "error": m.error})
    return fill_all, fill_one, ff_time, at, rejected


def _by_position(samples: list[tuple[int, float]]) -> dict[str, Any]:
    """Distributions of (position, seconds) samples by position range: the first tokens cost more."""
    out = {}
    for lo, hi in ((0, 4), (4, 16), (16, 10**9)):
        label = f"positions {lo}-{hi - 1}" if hi < 10**9 else f"positions {lo}+"
        out[label] = dist_ms([t for p, t in samples if lo <= p < hi], 3)
    return out


# ---- phase 4: forced tokens and their payoff ---------------------------------------------------------------------

def forced_analysis(paths: list[list[int]], at: list[list[tuple[list[int], int]]], use_ff: bool) -> dict[str, Any]:
    """Walk each output: tokens inside forced runs taken exactly as forced, other tokenizations, single-allowed."""
    runs: list[tuple[int, bool]] = []  # (length, at the first position)
    retokenized = 0
    positions = single = ff_nonempty = 0
    first_token_forced = 0
    for path, marks in zip(paths, at, strict=True):
        n = len(marks)
        positions += n
        single += sum(allowed == 1 for _, allowed in marks)
        ff_nonempty += sum(bool(ff) for ff, _ in marks)
        i = 0
        while i < n:
            ff = marks[i][0] if use_ff else ([path[i]] if marks[i][1] == 1 else [])
            if ff and path[i:i + len(ff)] == ff:
                if use_ff:
                    runs.append((len(ff), i == 0))
                    first_token_forced += i == 0
                    i += len(ff)
                    continue
                # single-allowed: extend the run over consecutive single-allowed positions
                j = i
                while j < n and marks[j][1] == 1:
                    j += 1
                runs.append((j - i, i == 0))
                first_token_forced += i == 0
                i = j
                continue
            retokenized += bool(ff)
            i += 1
    forced_tokens = sum(n for n, _ in runs)
    first = sum(n for n, at_first in runs if at_first)
    return {
        "method": "forced_tokens() fast-forward runs" if use_ff else "runs of positions where one token is allowed",
        "positions": positions,
        "forced_tokens": forced_tokens,
        "forced_fraction": round(forced_tokens / positions, 4) if positions else None,
        "runs": len(runs),
        "run_lengths": dict(sorted(Counter(n for n, _ in runs).items())),
        "runs_at_first_position": first_token_forced,
        "forced_tokens_at_first_position": first,
        "forced_fraction_after_first_position": round((forced_tokens - first) / positions, 4) if positions else None,
        "forced_but_other_tokenization": retokenized,
        "positions_forced_tokens_nonempty": ff_nonempty if use_ff else None,
        "positions_single_allowed": single,
        "single_allowed_fraction": round(single / positions, 4) if positions else None,
        "_runs": runs,
    }


def time_payoff(engine: Any, extra: dict[int, Any], fills: dict[str, list[tuple[Any, int]]], reps: int,
                warm: int) -> dict[str, Any]:
    """Round robin, all blocking: decode step (+ greedy sample) with S and 1 active slots; masked/unmasked sample
    alone; one prefill chunk per size; per backend, the mask fill of S mid-generation rows alone and between
    the decode dispatch and the (masked) sample, as the scheduler does it."""
    import jax

    jobs = _payoff_jobs(engine, extra, fills)
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for rep in range(warm + reps):
        for name, job in jobs.items():
            start = time.perf_counter()
            jax.block_until_ready(job())
            if rep >= warm:
                times[name].append(time.perf_counter() - start)
    return {name: dist_ms(v, 2) for name, v in times.items()}


def _payoff_jobs(engine: Any, extra: dict[int, Any], fills: dict[str, list[tuple[Any, int]]],
                 ) -> dict[str, Callable[[], Any]]:
    """time_payoff's jobs by name, in the order they run each round."""
    import jax
    import numpy as np

    from scheduler.grammar import fill_masks

    s = engine.num_slots
    words = -(-engine.cfg.vocab_size // 32)
    zeros = np.zeros(s, np.int32)
    positions = np.full(s, min(256, engine.max_len - 64), np.int32)
    all_active = np.ones(s, bool)
    one_active = np.zeros(s, bool)
    one_active[0] = True
    ones_mask = np.full((s, words), 0xFFFFFFFF, np.uint32)
    logits = engine.decode(zeros, positions, all_active)
    jax.block_until_ready(logits)

    def step(active):
        out = engine.decode(zeros, positions, active)
        return engine.sample(out, active, zeros, None, needs_full=False)

    def step_with_fill(rows):
        out = engine.decode(zeros, positions, all_active)
        mask = np.full((s, words), 0xFFFFFFFF, np.uint32)
        fill_masks(rows, mask)
        return engine.sample(out, all_active, zeros, mask, needs_full=False)

    def fill_alone(rows):
        mask = np.full((s, words), 0xFFFFFFFF, np.uint32)
        fill_masks(rows, mask)
        return mask

    jobs = {
        f"decode_step_{s}_active": lambda: step(all_active),
        "decode_step_1_active": lambda: step(one_active),
        "sample_alone_unmasked": lambda: engine.sample(logits, all_active, zeros, None, needs_full=False),
        "sample_alone_masked": lambda: engine.sample(logits, all_active, zeros, ones_mask, needs_full=False),
    }
    for backend, rows in fills.items():
        jobs[f"decode_step_{s}_active_with_fill_{backend}"] = partial(step_with_fill, rows)
        jobs[f"fill_alone_{backend}"] = partial(fill_alone, rows)
    tokens = np.arange(1, 9, dtype=np.int32) + 1000
    chunk_engines = {size: engine for size in engine.config.chunk_sizes[:1]} | extra
    for size, eng in sorted(chunk_engines.items()):
        jobs[f"prefill_chunk_{size}"] = partial(eng.prefill_chunk, 1, tokens[:min(size, 8)], 64)
    return jobs


def matchers_midway(work: list[dict[str, Any]], variant: str, paths: list[list[int]], stop_ids: frozenset[int],
                    ) -> list[tuple[Any, int]]:
    """(matcher, row) per request, each advanced through the first half of its generated output."""
    rows = []
    for r, (item, path) in enumerate(zip(work, paths, strict=True)):
        compiler, compiled = item["compilers"][variant]
        matcher = compiler.matcher(compiled)
        text = [t for t in path if t >= 0 and t not in stop_ids]
        matcher.consume_tokens(text[:len(text) // 2])
        rows.append((matcher, r))
    return rows


def payoff_estimate(all_runs: list[tuple[int, bool]], positions: int, timings: dict[str, Any], slots: int,
                    chunk_sizes: list[int]) -> dict[str, Any]:
    """Time saved by feeding each forced run after the first position (L tokens, plus the pending sampled token)
    as one prefill chunk, feeding only runs that pay (per mode), relative to decoding every position. Runs at
    the first position are counted apart: they can ride in the prompt's own prefill."""
    runs = [n for n, at_first in all_runs if not at_first]
    first = sum(n for n, at_first in all_runs if at_first)
    d_s = timings[f"decode_step_{slots}_active"]["p50_ms"]
    d_1 = timings["decode_step_1_active"]["p50_ms"]
    chunks = {c: timings[f"prefill_chunk_{c}"]["p50_ms"] for c in sorted(chunk_sizes)
              if f"prefill_chunk_{c}" in timings}

    def chunk_for(n):
        fitting = [c for c in chunks if c >= n]
        return min(fitting) if fitting else None

    out = {"decode_step_ms": {f"{slots}_active": d_s, "1_active": d_1}, "prefill_chunk_ms": chunks,
           "first_position_tokens": first,
           "first_position_fraction": round(first / positions, 4) if positions else None,
           "mid_generation_runs": len(runs), "mid_generation_tokens": sum(runs)}
    for label, per_token, gain in (
        (f"batch_{slots}", d_s / slots, lambda L, p: L * d_s / slots - p),
        ("single_stream", d_1, lambda L, p: (L + 1) * d_1 - p),
    ):
        saved = fed = fed_tokens = 0.0
        for L in runs:
            c = chunk_for(L + 1)
            if c is None:
                continue
            g = gain(L, chunks[c])
            if g > 0:
                saved += g
                fed += 1
                fed_tokens += L
        base = positions * per_token
        out[label] = {
            "break_even_run_length": {c: round((p * slots / d_s) if label != "single_stream" else (p / d_1 - 1), 2)
                                      for c, p in chunks.items()},
            "runs_fed": int(fed),
            "tokens_fed": int(fed_tokens),
            "time_saved_fraction": round(saved / base, 4) if base else None,
        }
    out["note"] = ("runs after the first position only (first-position runs can extend the prompt's prefill, "
                   "often inside its padding). batch: a fed run adds one prefill chunk to its iteration while the "
                   "batched step runs anyway for the other slots; gain = L * step/S - chunk. single stream: L+1 "
                   "decode steps become one chunk; gain = (L+1) * step - chunk. Only runs with a positive gain "
                   "are fed. time_saved_fraction is relative to decoding every generated position.")
    return out
