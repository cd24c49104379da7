#!/usr/bin/env python3
"""Two source trees' model programs side by side, for a change inside `core.model`: the default model's
(W8A8 weights, int8 KV, 8 slots x 8192) 512-token prefill chunk into a slot holding 0 / 1,024 / 3,072
positions, and a decode step of 8 rows at the 2,048 bucket, each tree timed in its own process, the processes
alternated (base, this tree, this tree, base, ...) so the host's drift hits both alike; every program's logits
are compared bit for bit between the trees.

    python3 benchmarks/model_ab.py --base HEAD~1 [--pairs 2] [--calls 7] [--out PATH]

The base is a git ref checked out into a temporary worktree; the other side is this tree as it is (its
uncommitted changes included). Prints the JSON and writes benchmarks/results/model-ab-cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    default_gguf,
    git_commit,
    host,
    log,
    medians_in_turn,
    save_report,
    versions,
)

CHUNK = 512
CONTEXTS = (0, 1024, 3072)
SLOTS = 8
MAX_LEN = 8192
DECODE_BUCKET = 2048


def bucket(end: int) -> int:
    """The engine's attention bucket (powers of two from 1024) covering positions [0, end)."""
    size = 1024
    while size < end:
        size *= 2
    return min(size, MAX_LEN)


def worker(tree: Path, gguf: str, calls: int, logits_path: Path) -> dict[str, float]:
    """In a process of its own, with ``tree``'s core on the path: program name -> median ms of ``calls`` calls
    after one untimed call; the first call's logits saved to ``logits_path`` (npz)."""
    sys.path.insert(0, str(tree))
    from core.device import configure_environment

    configure_environment()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import core.model as m
    from core.kv_cache import CacheSpec, init_cache
    from core.runtime import load_model

    model = load_model(gguf, precision=None)  # None: the serving default (W8A8 on CPU)
    cfg, params = model.cfg, model.params
    state = {"cache": init_cache(cfg, CacheSpec(num_slots=SLOTS, max_len=MAX_LEN, dtype="int8"))}
    rng = np.random.default_rng(0)
    chunk_tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, (1, CHUNK)), jnp.int32)
    step_tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, (SLOTS,)), jnp.int32)
    positions = jnp.asarray([1500 + 37 * i for i in range(SLOTS)], jnp.int32)  # inside the decode bucket
    active = jnp.ones(SLOTS, jnp.int32)

    def prefill_program(attend: int) -> Any:
        def run(p, cache, tokens, ints):  # ints: [start, n_valid, slot]
            return m.prefill_chunk(p, cache, tokens, ints[0:1], ints[1:2], ints[2:3], cfg=cfg, attend=attend)
        return jax.jit(run, donate_argnums=(1,))

    programs = {f"prefill_ctx{c}": (prefill_program(bucket(c + CHUNK)),
                                    (chunk_tokens, jnp.asarray([c, CHUNK, 0], jnp.int32))) for c in CONTEXTS}
    decode = jax.jit(lambda p, cache, t, pos: m.decode_step(p, cache, t, pos, active, cfg=cfg, attend=DECODE_BUCKET),
                     donate_argnums=(1,))
    programs["decode_8rows"] = (decode, (step_tokens, positions))

    def call(name: str) -> Any:
        program, args = programs[name]
        logits, state["cache"] = program(params, state["cache"], *args)
        return jax.block_until_ready(logits)

    first = {name: np.asarray(call(name)) for name in programs}  # compiles; the same order in every tree
    np.savez(logits_path, **first)
    return {name: round(ms, 2) for name, ms in medians_in_turn(call, programs, calls).items()}


def run_side(tree: Path, gguf: str, calls: int, logits_path: Path) -> dict[str, float]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(tree), "--gguf", gguf,
           "--calls", str(calls), "--logits", str(logits_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def same_logits(a: Path, b: Path) -> dict[str, bool]:
    import numpy as np

    with np.load(a) as left, np.load(b) as right:
        return {name: bool(np.array_equal(left[name], right[name])) for name in left.files}


def compare(base_ref: str, pairs: int, calls: int) -> dict[str, Any]:
    gguf = default_gguf()
    with tempfile.TemporaryDirectory(prefix="model-ab-") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), base_ref], cwd=ROOT, check=True)
        try:
            runs: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
            sides = {"base": base_tree, "this": ROOT}
            for i in range(pairs):
                for side in ("base", "this") if i % 2 == 0 else ("this", "base"):
                    log(f"pair {i + 1}/{pairs}: {side}")
                    runs[side].append(run_side(sides[side], gguf, calls, Path(tmp) / f"{side}.npz"))
            identical = same_logits(Path(tmp) / "base.npz", Path(tmp) / "this.npz")
            base_commit = git_commit(base_tree)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
    summary = {}
    for name in runs["base"][0]:
        base_ms = statistics.mean(run[name] for run in runs["base"])
        this_ms = statistics.mean(run[name] for run in runs["this"])
        summary[name] = {"base_ms": round(base_ms, 1), "this_ms": round(this_ms, 1),
                         "this_over_base": round(this_ms / base_ms, 3), "logits_identical": identical[name]}
    return {"base_commit": base_commit, "runs": runs, "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD~1", help="git ref of the base tree")
    p.add_argument("--pairs", type=int, default=2, help="process pairs, alternated (ABBA ...)")
    p.add_argument("--calls", type=int, default=7, help="timed calls per program per process")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/model-ab-cpu.json"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--gguf", default=None, help=argparse.SUPPRESS)
    p.add_argument("--logits", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(Path(args.worker), args.gguf, args.calls, Path(args.logits))))
        return
    result = compare(args.base, args.pairs, args.calls)
    report = {"benchmark": "model_ab", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": host(),
              "versions": versions(["jax", "jaxlib"]), "this_commit": git_commit(mark_dirty=True),
              "argv": sys.argv[1:], "workload": {"chunk": CHUNK, "contexts": list(CONTEXTS), "slots": SLOTS,
                                                 "max_len": MAX_LEN, "decode_bucket": DECODE_BUCKET},
              "notes": "medians of --calls calls per process, then the mean over a side's processes; "
                       "logits_identical: the first call of every program, base vs this tree", **result}
    save_report(args.out, report)


if __name__ == "__main__":
    main()
