#!/usr/bin/env python3
"""Structured output benchmark: constrained vs unconstrained throughput, grammar compile time, mask fill time,
forced tokens.

Run from the repository root:

    python3 benchmarks/structured.py --model default                        # CPU scale (4-5 min on 2 busy cores)
    python3 benchmarks/structured.py --model default --max-tokens 128 --rounds 5 --outlines-limit 101 \\
        --outlines-budget-s 900 --max-len 4096                               # a bigger run (fast machines)

Phases (the JSON is rewritten after each, so an interrupted run keeps what it measured):

1. compile: every schema vendored under tests/data/json-schema (both suites, each group of the official suite
   is one schema; identical schemas counted once) through `GrammarCompiler(backend="llguidance")`, one
   compile at a time: `CompiledGrammar.compile_s` for accepted schemas, wall time of `compile()` for refused
   ones, refusals counted by feature. outlines-core: its allowlist (`outlines_regex` plus the regex-length
   limit, no tokenizer needed) over all schemas, then the Index build for a seeded random sample of the
   admitted ones, at most --outlines-limit schemas and no new compile after --outlines-budget-s seconds.
2. throughput: the real model, S slots, S concurrent requests (one per schema, prompts naming the schema's
   fields), greedy, prefix caching off. Variants: unconstrained (ignore_eos) and one per grammar backend
   (--variants). The S schemas are the JSONSchemaBench ones with the most required properties that every
   backend in --variants compiles (one per family). Each variant has its own Engine (own KV pool, shared
   parameters) and a fresh Scheduler per round; the schedulers' iterations (`Scheduler.step()`) alternate,
   order reversed every iteration, so load from other processes hits all variants alike. tokens/s = generated
   tokens / the variant's own iteration time. Lengths are matched: a calibration round of the constrained
   variants (max_tokens = --max-tokens) fixes each request's length as the shortest any backend produced; the
   timed rounds use those lengths as max_tokens (constrained requests stop there or at their natural end,
   the same point; unconstrained ones use ignore_eos), so every variant does the same prefill and decode work
   and iteration k of one variant can be paired with iteration k of another.
   Step breakdown: `scheduler.scheduler.fill_masks`, `engine.decode`, `engine.sample` and `Scheduler._decode`
   are wrapped with (non-blocking) timers in this process: dispatch (engine.decode returns once the forward is
   enqueued), mask fill, sample (waits for the forward, then samples and copies tokens to the host), step total.
   If the fill overlaps the forward, the constrained step exceeds the unconstrained one by less than the fill;
   phase 4 also times a decode step with and without a fill between dispatch and sample, round robin.
3. mask fill: the calibration outputs of each constrained variant replayed through fresh matchers of that
   backend, off the engine: `fill_masks` for all live rows (8 when all are live) and for each row alone, at
   every generated position; p50/p99 overall and by position range. Also `forced_tokens()` time (llguidance).
4. forced tokens: in the same replay, before each token: `forced_tokens()` (llguidance fast-forward tokens) and
   the number of allowed tokens (mask popcount). A walk over each output counts tokens inside forced runs that
   the model emitted exactly as forced (these decode steps could be replaced by feeding the run as a prefill
   chunk), runs where it chose another tokenization of the forced bytes, and positions where the mask allowed
   exactly one token. Payoff: decode step (S active and 1 active, + sample) and one prefill chunk of the
   smallest size (and --extra-chunks, e.g. 8, on a second engine with the same pool) timed round robin; a run
   of L forced tokens emits L+1 tokens from one chunk instead of L+1 decode steps, so it pays for a single
   stream when (L+1) * D1 > P and in a full batch of S when L * D_S / S > P (the batch step runs anyway for
   the other slots). The estimate applies that rule (feed only runs that pay) to the measured runs.

Phases 3 and 4's replay, forced-token walk and payoff live in benchmarks/structured_replay.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shlex
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
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
    versions,
)
from benchmarks.structured_replay import (  # noqa: E402
    forced_analysis,
    matchers_midway,
    payoff_estimate,
    replay,
    time_payoff,
)

SCHEMA_DIR = ROOT / "tests" / "data" / "json-schema"
BACKEND_LABELS = {"unconstrained": "U", "llguidance": "C", "outlines-core": "O"}


# ---- schemas ----------------------------------------------------------------------------------------------

@dataclass
class SchemaEntry:
    suite: str
    file: str
    group: int
    schema: Any
    tests: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return self.file if self.suite == "jsonschemabench-sample" else f"{self.file}#{self.group}"

    @property
    def family(self) -> str:
        """Same-source schemas (e.g. Glaiveai2K---generate_invoice_<hash>) share a family."""
        return re.sub(r"_[0-9a-f]{8}$", "", self.file.removesuffix(".json"))


def load_schemas() -> list[SchemaEntry]:
    entries = []
    for path in sorted(SCHEMA_DIR.glob("*/*.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        for i, group in enumerate(doc if isinstance(doc, list) else [doc]):
            entries.append(SchemaEntry(path.parent.name, path.name, i, group["schema"], group.get("tests", [])))
    return entries


def unique_specs(entries: list[SchemaEntry]) -> list[tuple[Any, SchemaEntry]]:
    """(ConstraintSpec, first entry) per distinct schema, in file order."""
    from scheduler.grammar import ConstraintSpec, UnsupportedConstraintError

    seen: dict[Any, SchemaEntry] = {}
    for entry in entries:
        try:
            spec = ConstraintSpec.json_schema(entry.schema)
        except UnsupportedConstraintError:
            continue
        seen.setdefault(spec, entry)
    return list(seen.items())


# ---- phase 1: compile time ----------------------------------------------------------------------------------

def time_llguidance(tokenizer: Any, vocab_size: int, specs: list[tuple[Any, SchemaEntry]]) -> tuple[dict, dict]:
    from scheduler.grammar import GrammarCompiler, UnsupportedConstraintError

    compiler = GrammarCompiler(tokenizer, "llguidance", vocab_size=vocab_size, max_workers=1, cache_size=1 << 16)
    begin = time.perf_counter()
    compiler.warm_up()
    warm = time.perf_counter() - begin
    accepted, refused_wall = [], []
    refused: Counter[str] = Counter()
    by_suite: dict[str, Counter[str]] = {}
    compiled: dict[Any, Any] = {}
    slowest: list[tuple[float, str]] = []
    begin = time.perf_counter()
    for spec, entry in specs:
        start = time.perf_counter()
        counts = by_suite.setdefault(entry.suite, Counter())
        try:
            result = compiler.compile(spec)
        except UnsupportedConstraintError as e:
            refused_wall.append(time.perf_counter() - start)
            refused[e.feature] += 1
            counts["refused"] += 1
            continue
        accepted.append(result.compile_s)
        slowest.append((result.compile_s, entry.name))
        compiled[spec] = result
        counts["accepted"] += 1
    total = time.perf_counter() - begin
    report = {
        "schemas": len(specs),
        "accepted": len(accepted),
        "refused": sum(refused.values()),
        "by_suite": {k: dict(v) for k, v in by_suite.items()},
        "tokenizer_bridge_s": round(warm, 3),
        "total_s": round(total, 3),
        "compile_accepted": dist_ms(accepted),
        "time_to_refuse": dist_ms(refused_wall),
        "slowest": [{"schema": n, "ms": round(s * 1e3, 2)} for s, n in sorted(slowest, reverse=True)[:5]],
        "refused_by_feature": dict(refused.most_common()),
        "note": "compile_s of CompiledGrammar (LLMatcher construction: lexer and parser tables), one at a time",
    }
    return report, {"compiler": compiler, "compiled": compiled}


def outlines_allowlist(specs: list[tuple[Any, SchemaEntry]]) -> tuple[dict, list[tuple[Any, SchemaEntry, int]]]:
    from scheduler.grammar import UnsupportedConstraintError
    from scheduler.grammar_outlines import OUTLINES_MAX_REGEX, outlines_regex

    admitted: list[tuple[Any, SchemaEntry, int]] = []
    refused: Counter[str] = Counter()
    times = []
    for spec, entry in specs:
        start = time.perf_counter()
        try:
            regex = outlines_regex(spec)
            if len(regex) > OUTLINES_MAX_REGEX:
                raise UnsupportedConstraintError("grammar too complex")
        except UnsupportedConstraintError as e:
            refused[e.feature] += 1
            continue
        finally:
            times.append(time.perf_counter() - start)
        admitted.append((spec, entry, len(regex)))
    lengths = [n for _, _, n in admitted]
    return {
        "schemas": len(specs),
        "admitted": len(admitted),
        "refused": sum(refused.values()),
        "admitted_by_suite": dict(Counter(e.suite for _, e, _ in admitted)),
        "regex_chars_admitted": {"p50": percentile(lengths, 0.5), "p90": percentile(lengths, 0.9),
                                 "max": max(lengths, default=None)},
        "allowlist_check": dist_ms(times),
        "refused_by_feature_top": dict(refused.most_common(15)),
    }, admitted


def time_outlines(tokenizer: Any, vocab_size: int, admitted: list[tuple[Any, SchemaEntry, int]],
                  args: argparse.Namespace) -> tuple[dict, dict]:
    from scheduler.grammar import GrammarCompiler, UnsupportedConstraintError

    compiler = GrammarCompiler(tokenizer, "outlines-core", vocab_size=vocab_size, max_workers=1,
                               compile_timeout_s=args.outlines_timeout_s, cache_size=1 << 16)
    begin = time.perf_counter()
    compiler.warm_up()
    warm = time.perf_counter() - begin
    sample = random.Random(args.seed).sample(admitted, min(args.outlines_limit, len(admitted)))
    rows, accepted = [], []
    begin = time.perf_counter()
    for spec, entry, regex_chars in sample:
        if time.perf_counter() - begin > args.outlines_budget_s:
            break
        start = time.perf_counter()
        try:
            result = compiler.compile(spec)
        except UnsupportedConstraintError as e:
            rows.append({"schema": entry.name, "regex_chars": regex_chars, "refused": str(e)[:200],
                         "wall_s": round(time.perf_counter() - start, 3)})
            continue
        accepted.append(result.compile_s)
        rows.append({"schema": entry.name, "regex_chars": regex_chars, "compile_s": round(result.compile_s, 3)})
        log(f"  outlines-core {entry.name}: {result.compile_s:.2f} s ({regex_chars}-char regex)")
    report = {
        "sampled": len(sample),
        "timed": len(rows),
        "compiled": len(accepted),
        "sample": f"random.Random({args.seed}).sample of the admitted schemas, limit {args.outlines_limit}, "
                  f"no new compile after {args.outlines_budget_s} s",
        "vocabulary_bridge_s": round(warm, 3),
        "total_s": round(time.perf_counter() - begin, 3),
        "compile": dist_ms(accepted, 1),
        "per_schema": rows,
    }
    return report, {"compiler": compiler}


# ---- phase 2: throughput -----------------------------------------------------------------------------------

def pick_schemas(entries: list[tuple[Any, SchemaEntry]], count: int, names: list[str] | None) -> list[tuple]:
    """The `count` schemas with the most required properties (then properties), one per family."""
    if names:
        chosen = [(s, e) for s, e in entries if e.name in names]
        missing = set(names) - {e.name for _, e in chosen}
        if missing:
            raise SystemExit(f"--schemas not found or not compiled by every backend: {sorted(missing)}")
        return chosen

    def score(item):
        schema = item[1].schema
        return (-len(schema.get("required", [])), -len(schema.get("properties", {})), len(item[0].value))

    pool = [(s, e) for s, e in entries if e.suite == "jsonschemabench-sample" and isinstance(e.schema, dict)
            and isinstance(e.schema.get("properties"), dict) and e.schema["properties"]]
    chosen, families = [], set()
    for spec, entry in sorted(pool, key=score):
        if entry.family not in families:
            chosen.append((spec, entry))
            families.add(entry.family)
        if len(chosen) == count:
            break
    return chosen


def prompt_ids(tokenizer: Any, entry: SchemaEntry) -> list[int]:
    schema = entry.schema
    title = schema.get("title") or entry.file.removesuffix(".json").split("---")[-1]
    fields = ", ".join(schema.get("properties", {}))
    return tokenizer.encode(f"Write one JSON object for {title} with the fields {fields}.\nJSON:", add_bos=True)


class StepProbe:
    """Non-blocking timers around one scheduler's iterations and the parts of its decode step."""

    def __init__(self) -> None:
        self.iterations: list[float] = []
        self.steps: list[dict[str, float]] = []
        self.prefill_fills: list[float] = []
        self.current: dict[str, float] | None = None


class Instruments:
    """Installs the timers: `scheduler.scheduler.fill_masks` (module global, shared; it reports to the probe of
    the scheduler now stepping), and per scheduler its engine's decode/sample and its `_decode`."""

    def __init__(self) -> None:
        import scheduler.scheduler as sched_mod

        self.module = sched_mod
        self.original_fill = sched_mod.fill_masks
        self.active: StepProbe | None = None
        self.attached: list[Any] = []

        def fill(rows, bitmask):
            start = time.perf_counter()
            self.original_fill(rows, bitmask)
            elapsed = time.perf_counter() - start
            probe = self.active
            if probe is None:
                return
            if probe.current is not None:
                probe.current["fill_s"] += elapsed
                probe.current["rows"] = len(rows)
            else:
                probe.prefill_fills.append(elapsed)

        sched_mod.fill_masks = fill

    def attach(self, sched: Any, probe: StepProbe) -> None:
        engine = sched.engine
        original_decode, original_sample, original_step = engine.decode, engine.sample, sched._decode

        def decode(tokens, positions, active):
            start = time.perf_counter()
            out = original_decode(tokens, positions, active)
            if probe.current is not None:
                probe.current["dispatch_s"] = time.perf_counter() - start
                probe.current["active"] = int(active.sum())
            return out

        def sample(*a, **kw):
            start = time.perf_counter()
            out = original_sample(*a, **kw)
            if probe.current is not None:
                probe.current["sample_s"] = time.perf_counter() - start
            return out

        def step():
            probe.current = {"fill_s": 0.0, "rows": 0}
            start = time.perf_counter()
            try:
                original_step()
            finally:
                current, probe.current = probe.current, None
            if "active" in current:
                current["total_s"] = time.perf_counter() - start
                probe.steps.append(current)

        engine.decode, engine.sample, sched._decode = decode, sample, step
        self.attached.append(sched)

    def detach_all(self) -> None:
        for sched in self.attached:
            sched.engine.__dict__.pop("decode", None)
            sched.engine.__dict__.pop("sample", None)
            sched.__dict__.pop("_decode", None)
        self.attached = []

    def close(self) -> None:
        self.detach_all()
        self.module.fill_masks = self.original_fill


def run_lockstep(engines: dict[str, Any], tokenizer: Any, variants: list[str], work: list[dict[str, Any]],
                 max_tokens: list[int], stop_ids: frozenset[int], instruments: Instruments, validate: bool,
                 ) -> tuple[dict[str, dict[str, Any]], dict[str, list[list[int]]]]:
    """One fresh Scheduler per variant, each on its own engine; their iterations alternate (order reversed
    every iteration) until every request has finished, so load drift hits all variants alike."""
    scheds, handles, probes = {}, {}, {}
    for v in variants:
        scheds[v], handles[v] = submit_all(engines[v], tokenizer, v, work, max_tokens, stop_ids)
        probes[v] = StepProbe()
        instruments.attach(scheds[v], probes[v])
    load_before = os.getloadavg()[0]
    begin = time.perf_counter()
    try:
        alternate(scheds, handles, probes, variants, instruments)
    finally:
        instruments.detach_all()
    wall = time.perf_counter() - begin

    results, outputs = {}, {}
    s = next(iter(engines.values())).num_slots
    for v in variants:
        got = collect(v, work, handles[v], validate)
        probe = probes[v]
        results[v] = {"variant": v, "generated_tokens": got.tokens, **step_stats(probe, scheds[v], s, got.tokens),
                      "finish_reasons": dict(got.reasons), "errors": got.errors,
                      "iteration_ms": [round(t * 1e3, 1) for t in probe.iterations],
                      "step_fill_ms": [round(st["fill_s"] * 1e3, 2) for st in probe.steps]
                      if v != "unconstrained" else None}
        if validate and v != "unconstrained":
            results[v]["completed_outputs"] = got.complete
            results[v]["completed_outputs_valid"] = got.valid
            results[v]["outputs_text"] = got.texts
        outputs[v] = got.outs
    meta = {"wall_s": round(wall, 3), "load_average_before": round(load_before, 2),
            "load_average_after": round(os.getloadavg()[0], 2)}
    return {"meta": meta, **results}, outputs


def submit_all(engine: Any, tokenizer: Any, variant: str, work: list[dict[str, Any]], max_tokens: list[int],
               stop_ids: frozenset[int]) -> tuple[Any, list[Any]]:
    """A fresh Scheduler on ``engine`` (prefix caching off) with every request of ``work`` submitted, greedy:
    constrained by the variant's grammar, or unconstrained with ignore_eos."""
    from core.sampling import SamplingParams
    from scheduler.request import GenerationRequest
    from scheduler.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(engine, tokenizer, SchedulerConfig(prefix_caching=False), stop_ids=stop_ids)
    handles = []
    for i, (item, limit) in enumerate(zip(work, max_tokens, strict=True)):
        constraint = None
        if variant != "unconstrained":
            compiler, compiled = item["compilers"][variant]
            constraint = compiler.matcher(compiled)
        request = GenerationRequest(prompt_ids=tuple(item["prompt"]),
                                    sampling=SamplingParams(temperature=0.0, seed=i),
                                    max_tokens=limit, ignore_eos=constraint is None, constraint=constraint)
        handles.append(sched.submit(request))
    return sched, handles


def alternate(scheds: dict[str, Any], handles: dict[str, list[Any]], probes: dict[str, StepProbe],
              variants: list[str], instruments: Instruments) -> None:
    """Step the schedulers in turn, order reversed every iteration, until every request has finished."""
    iteration = 0
    while True:
        pending = [v for v in variants if not all(h.finished for h in handles[v])]
        if not pending:
            return
        for v in pending if iteration % 2 == 0 else reversed(pending):
            instruments.active = probes[v]
            start = time.perf_counter()
            scheds[v].step()
            probes[v].iterations.append(time.perf_counter() - start)
            instruments.active = None
        iteration += 1
        if iteration > 100_000:
            raise RuntimeError("schedulers did not become idle")


@dataclass
class VariantOutputs:
    """What one variant's requests produced, in request order."""

    outs: list[list[int]] = field(default_factory=list)  # generated ids, -1 where a stop token ended the output
    texts: list[str] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    tokens: int = 0
    complete: int = 0  # validated runs: outputs that finished (STOP) ...
    valid: int = 0  # ... and validate against their schema


def collect(variant: str, work: list[dict[str, Any]], handles: list[Any], validate: bool) -> VariantOutputs:
    """The finished requests' outputs; ``validate``: a constrained output that finished is checked against its
    schema."""
    from scheduler.request import FinishReason

    got = VariantOutputs()
    for item, handle in zip(work, handles, strict=True):
        ids, text, fin = handle.result(timeout=0)
        got.reasons[str(fin.reason)] += 1
        got.tokens += fin.usage.completion_tokens
        if fin.error:
            got.errors.append(f"{item['entry'].name}: {fin.error}")
        generated = list(ids)
        if fin.usage.completion_tokens > len(ids):  # a stop token ends the output without a TokenEvent
            generated.append(-1)
        got.outs.append(generated)
        got.texts.append(text)
        if validate and variant != "unconstrained" and fin.reason is FinishReason.STOP:
            got.complete += 1
            try:
                import jsonschema

                jsonschema.validate(json.loads(text), item["entry"].schema)
                got.valid += 1
            except Exception:  # counted, not raised
                pass
    return got


def step_stats(probe: StepProbe, sched: Any, slots: int, tokens: int) -> dict[str, Any]:
    """One variant's iteration and decode-step timings (full-batch steps: all ``slots`` active)."""
    busy = sum(probe.iterations)
    steps = probe.steps
    full = [st for st in steps if st["active"] == slots]
    decode_s = sum(st["total_s"] for st in steps)
    decode_tokens = sum(st["active"] for st in steps)
    return {
        "busy_s": round(busy, 3),
        "tokens_per_s": round(tokens / busy, 3),
        "iterations": len(probe.iterations),
        "decode_steps": len(steps),
        "decode_steps_full_batch": len(full),
        "decode_s": round(decode_s, 3),
        "decode_tokens_per_s": round(decode_tokens / decode_s, 3) if decode_s else None,
        "prefill_and_rest_s": round(busy - decode_s, 3),
        "prefill_chunks": sched.stats.prefill_chunks,
        "step_full_batch": {
            "total": dist_ms([st["total_s"] for st in full], 1),
            "dispatch": dist_ms([st["dispatch_s"] for st in full], 2),
            "fill": dist_ms([st["fill_s"] for st in full], 2),
            "sample_and_wait": dist_ms([st["sample_s"] for st in full], 1),
        },
        "fill_all_steps": dist_ms([st["fill_s"] for st in steps if st["rows"]], 2),
        "fill_share_of_decode": round(sum(st["fill_s"] for st in steps) / decode_s, 4) if decode_s else None,
        "first_token_fills": dist_ms(probe.prefill_fills, 2),
    }


def summarize_throughput(rounds: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    keys = {
        "tokens_per_s": lambda r: r["tokens_per_s"],
        "decode_tokens_per_s": lambda r: r["decode_tokens_per_s"],
        "busy_s": lambda r: r["busy_s"],
        "step_p50_ms": lambda r: r["step_full_batch"]["total"].get("p50_ms"),
        "dispatch_p50_ms": lambda r: r["step_full_batch"]["dispatch"].get("p50_ms"),
        "fill_p50_ms": lambda r: r["step_full_batch"]["fill"].get("p50_ms"),
        "fill_p99_ms": lambda r: r["step_full_batch"]["fill"].get("p99_ms"),
        "sample_and_wait_p50_ms": lambda r: r["step_full_batch"]["sample_and_wait"].get("p50_ms"),
        "fill_share_of_decode": lambda r: r["fill_share_of_decode"],
    }
    out: dict[str, Any] = {}
    for v in variants:
        mine = [rnd[v] for rnd in rounds]
        out[v] = {k: (statistics.median(vals) if (vals := [x for r in mine if (x := get(r)) is not None]) else None)
                  for k, get in keys.items()}
        out[v]["rounds"] = len(mine)
    for v in variants[1:]:
        per_round, step_ratios, extra = [], [], []
        for rnd in rounds:
            c, u = rnd[v], rnd["unconstrained"]
            per_round.append({"tokens_per_s": round(c["tokens_per_s"] / u["tokens_per_s"], 4),
                              "decode_tokens_per_s": round(c["decode_tokens_per_s"] / u["decode_tokens_per_s"], 4)})
            # iteration k of each variant does the same work (matched lengths): pair them
            pairs = list(zip(c["iteration_ms"], u["iteration_ms"], strict=False))
            step_ratios += [a / b for a, b in pairs if b > 0]
            extra += [a - b for a, b in pairs]
        fill = out[v]["fill_p50_ms"] or 0
        extra_p50 = statistics.median(extra) if extra else None
        out[v]["vs_unconstrained"] = {
            "tokens_per_s_ratio": round(statistics.median(r["tokens_per_s"] for r in per_round), 4),
            "decode_tokens_per_s_ratio": round(statistics.median(r["decode_tokens_per_s"] for r in per_round), 4),
            "per_round": per_round,
            "paired_iteration_ratio": {"p50": round(percentile(step_ratios, 0.5), 4),
                                       "p10": round(percentile(step_ratios, 0.1), 4),
                                       "p90": round(percentile(step_ratios, 0.9), 4), "n": len(step_ratios)},
            "paired_iteration_extra_ms_p50": round(extra_p50, 2) if extra_p50 is not None else None,
            "fill_p50_ms_in_step": fill,
            "note": "paired: iteration k of this variant vs iteration k of the unconstrained one in the same round "
                    "(same prefill/decode work, lengths matched, run back to back)",
        }
    return out


# ---- driver: the phases in order -------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="default", help='a checkpoint ("default": the packaged Gemma 3 270M)')
    p.add_argument("--dtype", default="float32", help="compute dtype (float32 is the right choice on CPU)")
    p.add_argument("--slots", type=int, default=8, help="engine slots = concurrent requests")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--chunk-sizes", default="32,128")
    p.add_argument("--extra-chunks", default="8",
                   help="prefill chunk sizes timed only for the forced-token payoff (a second engine, same pool)")
    p.add_argument("--max-tokens", type=int, default=48, help="generation budget of the calibration runs")
    p.add_argument("--no-match-lengths", dest="match_lengths", action="store_false",
                   help="use --max-tokens in every timed run instead of the calibrated per-request lengths")
    p.add_argument("--variants", default="unconstrained,llguidance,outlines-core",
                   help="unconstrained plus any of llguidance, outlines-core")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (each runs every variant, interleaved)")
    p.add_argument("--schemas", default=None, help="comma-separated schema file names for the throughput runs")
    p.add_argument("--outlines-limit", type=int, default=20, help="outlines-core schemas to time in the compile phase")
    p.add_argument("--outlines-budget-s", type=float, default=90.0,
                   help="no new outlines-core compile after this many seconds")
    p.add_argument("--outlines-timeout-s", type=float, default=120.0, help="compile timeout per outlines schema")
    p.add_argument("--payoff-reps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help="comma-separated phases to skip: compile-outlines, throughput, payoff")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false")
    p.add_argument("--platform", default=None, help="JAX platform (cpu, cuda, ...)")
    p.add_argument("--out", default=None, help="result file (default: benchmarks/results/structured-<backend>.json)")
    args = p.parse_args(argv)
    args.chunk_sizes = tuple(int(x) for x in args.chunk_sizes.split(","))
    args.extra_chunks = tuple(int(x) for x in args.extra_chunks.split(",") if x)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    if args.variants[0] != "unconstrained" or not set(args.variants) <= set(BACKEND_LABELS):
        p.error("--variants must start with unconstrained and name llguidance and/or outlines-core")
    if args.schemas:
        args.schemas = [x.strip() for x in args.schemas.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from core.device import configure_environment

    configure_environment(args.platform)
    import jax

    from core.compile_cache import enable_compile_cache
    from core.runtime import load_model

    if args.compile_cache:
        enable_compile_cache()
    backend = jax.default_backend()
    out = Path(args.out) if args.out else RESULTS / f"structured-{backend}.json"
    report = start_report(args, sys.argv[1:] if argv is None else argv, backend, jax.devices()[0].device_kind)

    def save() -> None:  # after every phase, so an interrupted run keeps what it measured
        save_report(out, report, echo=False)

    log(f"backend {backend}: loading {args.model}")
    model = load_model(args.model, dtype=args.dtype)
    tok = model.tokenizer
    vocab = model.cfg.vocab_size
    report["meta"].update(model=args.model, dtype=model.dtype, load_s=round(model.load_seconds, 2), vocab_size=vocab)
    specs, llg, admitted, oc = compile_phase(args, report, tok, vocab)
    save()
    if "throughput" in args.skip:
        save_report(out, report)
        return 0

    constrained = [v for v in args.variants if v != "unconstrained"]
    work = throughput_work(args, tok, vocab, constrained, specs, llg, admitted, oc)
    report["throughput"] = {
        "schemas": [{"schema": w["entry"].name, "prompt_tokens": len(w["prompt"]),
                     "required": len(w["entry"].schema.get("required", [])), "compile_s": w["compile_s"]}
                    for w in work],
        "sampling": "greedy (temperature 0); unconstrained with ignore_eos; prefix caching off; one engine per "
                    "variant, a fresh Scheduler per variant and round, Scheduler.step() of the variants alternating "
                    "on the main thread (order reversed every iteration)",
    }
    log(f"throughput schemas: {[w['entry'].name for w in work]}")
    engines = build_engines(args, model, report)
    stop_ids = llg["compiler"].stop_ids
    instruments = Instruments()
    cal_outputs, lengths = calibrate(args, report, engines, tok, constrained, work, stop_ids, instruments)
    save()
    rounds = timed_rounds(args, report, engines, tok, work, lengths, stop_ids, instruments, save)
    save()

    forced_runs = replay_phase(report, constrained, work, cal_outputs, stop_ids, vocab)
    save()
    if "payoff" not in args.skip:
        payoff_phase(args, report, model, engines["unconstrained"], constrained, work, cal_outputs, stop_ids,
                     forced_runs)
    report["meta"]["load_average_at_end"] = list(os.getloadavg())
    save_report(out, report)
    log(f"wrote {out}")
    errors = sum(len(rnd[v]["errors"]) for rnd in rounds for v in args.variants)
    return 1 if errors else 0


def start_report(args: argparse.Namespace, argv_used: list[str], backend: str, device_kind: str) -> dict[str, Any]:
    return {
        "meta": {
            "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": "python3 benchmarks/structured.py " + shlex.join(argv_used),
            "argv": argv_used,
            "source": source_info(),
            "versions": versions(("jax", "jaxlib", "llguidance", "outlines_core", "numpy")),
            "python": platform.python_version(),
            "backend": backend,
            "device_kind": device_kind,
            "host_cpus": os.cpu_count(),
            "host": host(),
            "load_average_at_start": list(os.getloadavg()),
        },
        "config": {k: (sorted(v) if isinstance(v, set) else list(v) if isinstance(v, tuple) else v)
                   for k, v in vars(args).items()},
    }


def compile_phase(args: argparse.Namespace, report: dict[str, Any], tok: Any, vocab: int,
                  ) -> tuple[list[tuple[Any, SchemaEntry]], dict[str, Any], list[tuple[Any, SchemaEntry, int]],
                             dict[str, Any] | None]:
    """Phase 1: every vendored schema through llguidance, outlines-core's allowlist and (unless skipped) its
    compile of a sample. Returns the distinct specs, llguidance's compiler and compiled grammars, the specs
    outlines-core admits, and outlines-core's compiler (None when its compile phase is skipped)."""
    entries = load_schemas()
    specs = unique_specs(entries)
    log(f"compile: {len(entries)} schemas ({len(specs)} distinct) through llguidance")
    llg_report, llg = time_llguidance(tok, vocab, specs)
    report["compile"] = {"schema_files": len(entries), "distinct_schemas": len(specs), "llguidance": llg_report}
    log(f"llguidance: {llg_report['accepted']} accepted, {llg_report['refused']} refused, compile p50 "
        f"{llg_report['compile_accepted'].get('p50_ms')} ms p99 {llg_report['compile_accepted'].get('p99_ms')} ms")
    allow, admitted = outlines_allowlist(specs)
    report["compile"]["outlines-core"] = {"allowlist": allow}
    oc: dict[str, Any] | None = None
    if "compile-outlines" not in args.skip:
        log(f"outlines-core: {allow['admitted']} admitted; timing up to {args.outlines_limit}")
        oc_report, oc = time_outlines(tok, vocab, admitted, args)
        report["compile"]["outlines-core"].update(oc_report)
        log(f"outlines-core compile p50 {oc_report['compile'].get('p50_ms')} ms p99 "
            f"{oc_report['compile'].get('p99_ms')} ms over {oc_report['compiled']}")
    return specs, llg, admitted, oc


def throughput_work(args: argparse.Namespace, tok: Any, vocab: int, constrained: list[str],
                    specs: list[tuple[Any, SchemaEntry]], llg: dict[str, Any],
                    admitted: list[tuple[Any, SchemaEntry, int]], oc: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Phase 2's requests: the schemas every constrained backend compiles (pick_schemas), each with its prompt
    and, per backend, its compiler and compiled grammar."""
    from scheduler.grammar import GrammarCompiler, UnsupportedConstraintError

    candidates = [(s, e) for s, e in specs if s in llg["compiled"]] if "llguidance" in constrained else specs
    if "outlines-core" in constrained:
        ok = {s for s, _, _ in admitted}
        candidates = [(s, e) for s, e in candidates if s in ok]
    chosen = pick_schemas(candidates, args.slots, args.schemas)
    if oc is None and "outlines-core" in constrained:
        oc = {"compiler": GrammarCompiler(tok, "outlines-core", vocab_size=vocab, max_workers=1,
                                          compile_timeout_s=args.outlines_timeout_s)}
    compilers = {"llguidance": llg["compiler"], "outlines-core": oc["compiler"] if oc else None}
    work = []
    for spec, entry in chosen:
        item = {"entry": entry, "prompt": prompt_ids(tok, entry), "compilers": {}, "compile_s": {}}
        for v in constrained:
            try:
                compiled = compilers[v].compile(spec)
            except UnsupportedConstraintError as e:
                raise SystemExit(f"{v} refused throughput schema {entry.name}: {e}") from None
            item["compilers"][v] = (compilers[v], compiled)
            item["compile_s"][v] = round(compiled.compile_s, 4)
        work.append(item)
    return work


def build_engines(args: argparse.Namespace, model: Any, report: dict[str, Any]) -> dict[str, Any]:
    """One engine per variant: one KV pool each (parameters shared), so that their iterations can alternate."""
    from core.engine import Engine, EngineConfig

    config = EngineConfig(num_slots=args.slots, max_len=args.max_len, chunk_sizes=args.chunk_sizes)
    engines = {}
    for v in args.variants:
        engines[v] = Engine(model.cfg, model.params, config, model.dtype)
        report["meta"][f"engine_compile_s_{v}"] = round(engines[v].warmup(), 2)
        log(f"engine for {v} compiled in {report['meta'][f'engine_compile_s_{v}']} s")
    return engines


def calibrate(args: argparse.Namespace, report: dict[str, Any], engines: dict[str, Any], tok: Any,
              constrained: list[str], work: list[dict[str, Any]], stop_ids: frozenset[int],
              instruments: Instruments) -> tuple[dict[str, list[list[int]]], list[int]]:
    """The constrained variants at --max-tokens, outputs validated. Returns their outputs (replayed in phases
    3 and 4) and each request's timed length: the shortest any backend produced (or --max-tokens)."""
    cal, cal_outputs = run_lockstep(engines, tok, constrained, work, [args.max_tokens] * len(work), stop_ids,
                                    instruments, validate=True)
    for v in constrained:
        log(f"calibration {v}: lengths {[len(o) for o in cal_outputs[v]]}, reasons {cal[v]['finish_reasons']}, "
            f"valid {cal[v].get('completed_outputs_valid')}/{cal[v].get('completed_outputs')}")
    report["throughput"]["calibration"] = cal
    if args.match_lengths:
        lengths = [min(len(cal_outputs[v][i]) for v in constrained) for i in range(len(work))]
    else:
        lengths = [args.max_tokens] * len(work)
    report["throughput"]["max_tokens_per_request"] = lengths
    return cal_outputs, lengths


def timed_rounds(args: argparse.Namespace, report: dict[str, Any], engines: dict[str, Any], tok: Any,
                 work: list[dict[str, Any]], lengths: list[int], stop_ids: frozenset[int], instruments: Instruments,
                 save: Any) -> list[dict[str, Any]]:
    """--rounds timed rounds of every variant at the calibrated lengths (saved after each); then whether each
    variant's outputs repeat across rounds, and the summary."""
    rounds: list[dict[str, Any]] = []
    reference: dict[str, list[list[int]]] = {}
    identical = {v: True for v in args.variants}
    for rnd in range(args.rounds):
        result, outputs = run_lockstep(engines, tok, args.variants, work, lengths, stop_ids, instruments,
                                       validate=False)
        result["meta"]["round"] = rnd
        rounds.append(result)
        for v in args.variants:
            if v in reference:
                identical[v] &= outputs[v] == reference[v]
            else:
                reference[v] = outputs[v]
        log(f"round {rnd + 1}: " + "; ".join(
            f"{v} {result[v]['generated_tokens']} tok {result[v]['tokens_per_s']} tok/s step p50 "
            f"{result[v]['step_full_batch']['total'].get('p50_ms')} ms fill p50 "
            f"{result[v]['step_full_batch']['fill'].get('p50_ms')} ms errors {len(result[v]['errors'])}"
            for v in args.variants))
        report["throughput"]["rounds"] = rounds
        save()
    instruments.close()
    report["throughput"]["outputs_identical_across_rounds"] = identical
    report["throughput"]["matched_lengths_ok"] = all(
        rnd[v]["generated_tokens"] == sum(lengths) for rnd in rounds for v in args.variants)
    report["throughput"]["summary"] = summarize_throughput(rounds, args.variants)
    return rounds


def replay_phase(report: dict[str, Any], constrained: list[str], work: list[dict[str, Any]],
                 cal_outputs: dict[str, list[list[int]]], stop_ids: frozenset[int], vocab: int,
                 ) -> dict[str, tuple[list[tuple[int, bool]], int]]:
    """Phases 3 and 4 on the calibration outputs: mask fill replayed, forced runs counted. Returns, per
    backend, the forced runs and the positions walked (for the payoff estimate)."""
    words = -(-vocab // 32)
    report["mask_fill"], report["forced"] = {}, {}
    forced_runs: dict[str, tuple[list[tuple[int, bool]], int]] = {}
    for v in constrained:
        paths = cal_outputs[v]
        compiled = [w["compilers"][v] for w in work]
        rep = replay(v, compiled, paths, stop_ids, len(work), words, forced=v == "llguidance")
        at = rep.pop("_at")
        report["mask_fill"][v] = rep
        analyses = {}
        for use_ff in ((True, False) if v == "llguidance" else (False,)):
            a = forced_analysis(paths, at, use_ff)
            runs_list = a.pop("_runs")
            analyses["forced_tokens" if use_ff else "single_allowed"] = a
            if use_ff or v != "llguidance":
                forced_runs[v] = (runs_list, a["positions"])
        report["forced"][v] = analyses
        log(f"mask fill {v}: {len(work)} rows p50 {rep['fill_rows_all_live'].get('p50_ms')} ms p99 "
            f"{rep['fill_rows_all_live'].get('p99_ms')} ms; 1 row p50 {rep['fill_one_row'].get('p50_ms')} ms p99 "
            f"{rep['fill_one_row'].get('p99_ms')} ms; forced {next(iter(analyses.values()))['forced_fraction']}")
    return forced_runs


def payoff_phase(args: argparse.Namespace, report: dict[str, Any], model: Any, engine: Any, constrained: list[str],
                 work: list[dict[str, Any]], cal_outputs: dict[str, list[list[int]]], stop_ids: frozenset[int],
                 forced_runs: dict[str, tuple[list[tuple[int, bool]], int]]) -> None:
    """Phase 4's payoff: decode steps and prefill chunks timed round robin (--extra-chunks on engines of their
    own, sharing the parameters), then what feeding each backend's forced runs as chunks would save."""
    from core.engine import Engine, EngineConfig

    extra = {}
    for size in args.extra_chunks:
        if size not in args.chunk_sizes:
            extra[size] = Engine(model.cfg, model.params,
                                 EngineConfig(num_slots=args.slots, max_len=args.max_len, chunk_sizes=(size,)),
                                 model.dtype)
    fills = {v: matchers_midway(work, v, cal_outputs[v], stop_ids) for v in constrained}
    timings = time_payoff(engine, extra, fills, args.payoff_reps, warm=1)
    report["forced"]["timings"] = timings
    sizes = [args.chunk_sizes[0], *extra]
    for v, (runs_list, positions) in forced_runs.items():
        report["forced"][v]["payoff"] = payoff_estimate(runs_list, positions, timings, args.slots, sizes)
    log(f"payoff timings: { {k: t.get('p50_ms') for k, t in timings.items()} }")


if __name__ == "__main__":
    sys.exit(main())
