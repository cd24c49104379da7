#!/usr/bin/env python3
"""Grammar-mask time per constrained token, the same tokens replayed with and without the host's key tracker.

    python3 benchmarks/mask_replay.py [--rounds 3]

The vendored JSONSchemaBench sample's valid documents (each one that its compiled grammar takes as written,
compactly) are tokenized and replayed 8 at a time, as the scheduler fills masks for 8 slots: per step one
batched grammar fill (llguidance, parallel) and then, in the "tracker" mode, each row's
`KeyTracker.drop_repeats` (no repeated key, no repeated unique item: scheduler/json_keys.py). Both modes see
exactly the same token sequences, alternating by round, so the ratio is the tracker's own cost, free of the
token-mix differences between two live runs. Schemas where something could repeat (open objects, unique
arrays: the tracker checks) and closed ones (it does not) are reported apart; for the closed ones both modes
run the same code, so their ratio shows the noise. A first round that warms the grammars up is not counted.
Reports per-row fill time p50/p90/p99 (ms) per class and mode, the ratios, and the tracker's own part timed
apart within the same steps (its mean over the grammar's: the figure least moved by noise).
Results: benchmarks/results/mask-replay-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import git_commit, host, save_report  # noqa: E402 - after the path set-up that makes it importable

SUITE = ROOT / "tests" / "data" / "json-schema" / "jsonschemabench-sample"
ROWS = 8


def documents(compiler: Any, tokenizer: Any) -> list[tuple[Any, list[int]]]:
    """(compiled grammar, token ids) for every valid sample document its grammar takes as written."""
    from scheduler.grammar_spec import ConstraintSpec, UnsupportedConstraintError

    out = []
    for path in sorted(SUITE.glob("*.json")):
        case = json.loads(path.read_text())
        try:
            compiled = compiler.compile(ConstraintSpec.json_schema(case["schema"]))
        except UnsupportedConstraintError:
            continue
        for test in case.get("tests", []):
            if not test.get("valid"):
                continue
            ids = tokenizer.encode(json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False))
            matcher = compiler.matcher(compiled)
            if matcher.consume_tokens(ids) and matcher.is_accepting():
                out.append((compiled, ids))
    return out


def replay(compiler: Any, batch: list[tuple[Any, list[int]]], tracker: bool,
           words: int) -> tuple[list[float], list[float]]:
    """Per-row seconds of each step's mask fill over one batch of documents replayed in lockstep, and of the
    tracker's part of it (empty without the tracker)."""
    from scheduler.grammar import fill_masks

    matchers = [compiler.matcher(compiled) for compiled, _ in batch]
    mask = np.zeros((ROWS, words), np.uint32)
    times, own = [], []
    for step in range(max(len(ids) for _, ids in batch)):
        live = [(m, row, ids) for row, (m, (_, ids)) in enumerate(zip(matchers, batch, strict=True))
                if step < len(ids)]
        begin = time.perf_counter()
        fill_masks([(m, row) for m, row, _ in live], mask)
        filled = time.perf_counter()
        if tracker:
            for m, row, _ in live:  # as scheduler.executor.constraint_masks does
                if m.keys is not None and m.keys.checks:
                    m.keys.drop_repeats(mask[row])
            own.append((time.perf_counter() - filled) / len(live))
        times.append((time.perf_counter() - begin) / len(live))
        for m, _, ids in live:
            assert m.consume(ids[step])
            if m.keys is not None:
                m.keys.feed_token(ids[step])
    return times, own


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mask-replay-cpu.json"))
    args = p.parse_args(argv)
    from core.loaders.open import default_gguf_path
    from core.tokenizer import Tokenizer
    from scheduler.grammar import GrammarCompiler

    tokenizer = Tokenizer.from_pretrained(default_gguf_path())
    compiler = GrammarCompiler(tokenizer)
    compiler.warm_up()
    docs = documents(compiler, tokenizer)
    words = -(-compiler.vocab_size // 32)
    # Batches of one class each: schemas where a key or unique item could repeat (the tracker checks every
    # step) and closed ones (it only follows the document), so each class's cost is read on its own.
    classes = {"checked": [d for d in docs if d[0].repeats_possible],
               "closed": [d for d in docs if not d[0].repeats_possible]}
    times: dict[str, list[float]] = {f"{kind} {mode}": [] for kind in classes for mode in ("grammar", "tracker")}
    own: dict[str, list[float]] = {kind: [] for kind in classes}
    # Round 0 warms llguidance's lazily built lexer states up and is not counted; the modes then take turns
    # going first, so neither always meets the other's leftovers.
    for round_ in range(args.rounds + 1):
        for kind, members in classes.items():
            for mode in ("grammar", "tracker") if round_ % 2 else ("tracker", "grammar"):
                for i in range(0, len(members), ROWS):
                    spent, tracking = replay(compiler, members[i:i + ROWS], mode == "tracker", words)
                    times[f"{kind} {mode}"] += spent if round_ else []
                    own[kind] += tracking if round_ else []

    def stats(values: list[float]) -> dict[str, float]:
        ms = np.asarray(values) * 1e3
        return {"p50_ms": round(float(np.percentile(ms, 50)), 4), "p90_ms": round(float(np.percentile(ms, 90)), 4),
                "p99_ms": round(float(np.percentile(ms, 99)), 4), "mean_ms": round(statistics.fmean(ms), 4)}

    result = {name: stats(values) for name, values in times.items()}
    report = {
        "what": __doc__.split("\n\n")[0], "host": host(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_commit": git_commit() or "",
        "documents": {kind: len(members) for kind, members in classes.items()},
        "tokens": {kind: sum(len(ids) for _, ids in members) for kind, members in classes.items()},
        "rounds": args.rounds, "per_row_fill": result,
        "tracker_over_grammar": {kind: {k: round(result[f"{kind} tracker"][k] / result[f"{kind} grammar"][k], 3)
                                        for k in result[f"{kind} grammar"]} for kind in classes},
        # The tracker's own part, timed apart within the same steps: free of the noise between the two modes.
        "tracker_part": {kind: stats(values) for kind, values in own.items()},
        "tracker_part_over_grammar_mean": {kind: round(statistics.fmean(own[kind]) * 1e3
                                                       / result[f"{kind} grammar"]["mean_ms"], 3) for kind in classes},
    }
    save_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
