#!/usr/bin/env python3
"""Where a 512-token prefill chunk's time goes, on the serving default (W8A8 weights, int8 KV cache).

    python3 benchmarks/prefill_breakdown.py [--contexts 0,1024,3072] [--rounds 3]

Part 1, knockouts: the engine's prefill program (`core.model.prefill_chunk`: one chunk into one slot that
already holds `context` positions, the global layers reading the attention bucket that covers it) is compiled
whole and again with one part replaced by something of the same shape that costs almost nothing. A part's
cost is the whole program's time minus the knocked-out program's: measured inside the fused program, not
alone. Parts: the layers' int8 products; the rotation + int8 quantization of activations before each of them;
attention (cache view, scores, softmax, value sums); the K/V write; the LM head, which a chunk computes for
its last row only (the program computing it for all 512 rows is timed too, to show what that saves). The
programs run in rounds, one call each per round, so drift in the host's load hits them alike.

Part 2, profile: the whole program's ops under jax.profiler, summed by what they compute (each op found in
the compiled HLO: int8 products against layer weights, against the LM head, between queries, keys and
probabilities and values; float32 products of the Hadamard rotation; every other fusion by XLA's name for it
and its shape). On 2 cores ops overlap, so op time adds up to more than the wall time.

Part 3, library paths: in one process per XLA flag set (YNNPACK, this jaxlib's default; oneDNN; XLA's own
emitter with the libraries off), the whole chunk, and every layer product of a chunk alone, int8 (W8A8) and
float32 (the float precision's). The exactness pins (`core.device.EXACT_CPU_FLAGS`) stay in every set.

Prints the JSON and writes benchmarks/results/prefill-breakdown-cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import default_gguf, git_commit, host, log, save_report, versions  # noqa: E402

CHUNK = 512
MAX_LEN = 8192
LIBRARY_FLAGS = {
    "ynnpack (default)": "",
    "onednn": "--xla_cpu_use_onednn=true",
    "xla emitter (libraries off)": "--xla_cpu_use_xnnpack=false --xla_cpu_experimental_ynn_fusion_type=",
}


def load() -> Any:
    from core.device import configure_environment

    configure_environment()
    from core.runtime import load_model

    model = load_model(default_gguf(), precision=None)  # None: the serving default (W8A8 on CPU)
    assert model.precision == "w8a8", model.precision
    return model


def bucket(end: int) -> int:
    """The engine's attention bucket (powers of two from 1024) covering positions [0, end)."""
    size = 1024
    while size < end:
        size *= 2
    return min(size, MAX_LEN)


# ---- the knockouts --------------------------------------------------------------------------------------------

def knockouts(cfg: Any) -> dict[str, tuple[str, Callable] | None]:
    """Part name -> (the core.model function to replace, its stand-in); None: the whole program."""
    import jax.numpy as jnp

    import core.model as m

    real_linear, real_quantize, real_rotate = m.linear, m.quantize_int8, m.rotate

    def layer_w8a8(w: Any) -> bool:
        return isinstance(w, dict) and "qa8" in w and w["qa8"].shape[0] != cfg.vocab_size

    def no_products(x, w):  # rotation and quantization kept; the int8 dot replaced by a broadcast
        if not layer_w8a8(w):
            return real_linear(x, w)
        x8, s = real_quantize(real_rotate(x.astype(jnp.float32)))
        acc = jnp.sum(x8[..., :8].astype(jnp.int32), -1, keepdims=True)
        acc = jnp.broadcast_to(acc, (*x.shape[:-1], w["qa8"].shape[0]))
        return (acc.astype(jnp.float32) * (s[..., None] * w["s"])).astype(x.dtype)

    def no_quantize(x, w):  # the int8 dot kept, on a plain cast of the activations
        if not layer_w8a8(w):
            return real_linear(x, w)
        acc = jnp.einsum("...i,oi->...o", x.astype(jnp.int8), w["qa8"], preferred_element_type=jnp.int32)
        return (acc.astype(jnp.float32) * w["s"]).astype(x.dtype)

    def no_attention(q, keys, key_pos, positions, held, **_):
        b, t, nh, d = q.shape
        return q.reshape(b, t, nh * d) * 0.5

    def no_head(params, cfg_, h):
        return jnp.broadcast_to(jnp.sum(h, -1, keepdims=True).astype(jnp.float32), (*h.shape[:-1], cfg.vocab_size))

    return {"whole": None, "layer products (int8 dots)": ("linear", no_products),
            "rotate + quantize activations": ("linear", no_quantize), "attention": ("attention", no_attention),
            "K/V write": ("write_chunk", lambda cache, *_: cache), "LM head (last row)": ("lm_head", no_head)}


@contextlib.contextmanager
def patched(patch: tuple[str, Callable] | None) -> Iterator[None]:
    import core.model as m

    if patch is None:
        yield
        return
    name, stand_in = patch
    real = getattr(m, name)
    setattr(m, name, stand_in)
    try:
        yield
    finally:
        setattr(m, name, real)


def compile_chunk(model: Any, attend: int, patch: tuple[str, Callable] | None, args: tuple, every_row: bool = False
                  ) -> Callable:
    """The prefill program of one chunk into slot 0 (ints = [start, n_valid, slot]), compiled under ``patch``;
    every_row: logits for all rows instead of the last."""
    import jax

    import core.model as m

    def step(params, cache, tokens, ints):
        start, n_valid, slot = ints[0:1], ints[1:2], ints[2:3]
        if every_row:
            h, cache = m.hidden_states(params, cache, tokens, start, n_valid, slot, cfg=model.cfg, attend=attend)
            return m.lm_head(params, model.cfg, h), cache
        return m.prefill_chunk(params, cache, tokens, start, n_valid, slot, cfg=model.cfg, attend=attend)

    with patched(patch):
        return jax.jit(step, donate_argnums=(1,)).lower(*args).compile()


class ChunkRunner:
    """Runs compiled chunk programs on one cache (donated and replaced at every call)."""

    def __init__(self, model: Any) -> None:
        import jax.numpy as jnp
        import numpy as np

        from core.kv_cache import CacheSpec, init_cache

        self.model = model
        self.cache = init_cache(model.cfg, CacheSpec(num_slots=1, max_len=MAX_LEN, dtype="int8"))
        rng = np.random.default_rng(0)
        self.tokens = jnp.asarray(rng.integers(2, model.cfg.vocab_size, (1, CHUNK)), jnp.int32)

    def args(self, context: int) -> tuple:
        import jax.numpy as jnp

        return self.model.params, self.cache, self.tokens, jnp.asarray([context, CHUNK, 0], jnp.int32)

    def run(self, program: Callable, context: int) -> float:
        import jax

        begin = time.perf_counter()
        out, self.cache = program(*self.args(context))
        jax.block_until_ready(out)
        return time.perf_counter() - begin


def knockout_part(model: Any, contexts: list[int], rounds: int) -> list[dict[str, Any]]:
    runner = ChunkRunner(model)
    results = []
    for context in contexts:
        attend = bucket(context + CHUNK)
        log(f"context {context}: compiling the whole program and its knockouts (attend {attend})")
        programs = {name: compile_chunk(model, attend, patch, runner.args(context))
                    for name, patch in knockouts(model.cfg).items()}
        every_row = compile_chunk(model, attend, None, runner.args(context), every_row=True)
        times: dict[str, list[float]] = {name: [] for name in programs}
        for program in programs.values():
            runner.run(program, context)  # first run: one-time set-up on XLA:CPU
        for _ in range(rounds):
            for name, program in programs.items():
                times[name].append(runner.run(program, context))
        # Timed after the rounds, not among them: its 512 x 262,144 float32 logits (512 MB) made the program run
        # after it in each round 50-90 ms slower (the whole chunk, which every part is measured against).
        runner.run(every_row, context)
        times["LM head for every row (not shipped)"] = [runner.run(every_row, context) for _ in range(rounds)]
        whole = statistics.median(times["whole"])
        parts = {}
        for name, values in times.items():
            if name == "whole":
                continue
            ms = statistics.median(values)
            if name.startswith("LM head for every row"):
                parts[name] = {"program_ms_p50": round(ms * 1e3, 2), "extra_ms": round((ms - whole) * 1e3, 2)}
            else:
                parts[name] = {"program_ms_p50": round(ms * 1e3, 2), "part_ms": round((whole - ms) * 1e3, 2),
                               "share_of_whole": round((whole - ms) / whole, 3)}
        named = sum(p["part_ms"] for p in parts.values() if "part_ms" in p)
        results.append({"context": context, "attend": attend, "whole_ms_p50": round(whole * 1e3, 2),
                        "tokens_per_s": round(CHUNK / whole, 1), "parts": parts,
                        "sum_of_parts_ms": round(named, 2),
                        "whole_ms_all": [round(t * 1e3, 2) for t in times["whole"]]})
        log(json.dumps(results[-1]))
    return results


# ---- the profile --------------------------------------------------------------------------------------------

def op_kind(name: str, hlo: str, vocab: int) -> str:
    """What a traced op computes, from its instruction in the compiled HLO text."""
    import re

    kind = re.sub(r"\.\d+$", "", name)
    found = re.search(rf"%{re.escape(name)} = (\S+) fusion\(([^)]*)\)", hlo)
    if not found:
        return kind
    shape, operands = found.group(1), [a.strip().lstrip("%") for a in found.group(2).split(",")]
    if kind != "ynn_fusion":
        return f"{kind} {shape.split('{')[0]}"
    weights = any(a.startswith("param") for a in operands)  # an entry parameter: a weight
    if shape.startswith("f32"):
        return "float32 products: Hadamard rotation of activations"
    if weights and shape.endswith(f",{vocab}]{{1,0}}"):
        return "int8 products: LM head (last row)"
    return "int8 products: layer weights" if weights else "int8 products: attention (scores, values)"


def profile_part(model: Any, context: int, calls: int) -> dict[str, Any]:
    from collections import defaultdict

    from benchmarks.decode_profile import device_processes, profile_steps

    runner = ChunkRunner(model)
    program = compile_chunk(model, bucket(context + CHUNK), None, runner.args(context))
    for _ in range(2):
        runner.run(program, context)
    wall_ms, trace = profile_steps(lambda: runner.run(program, context), calls, None)
    hlo = program.as_text()
    pids = device_processes(trace)
    by_kind: dict[str, float] = defaultdict(float)
    for e in trace["traceEvents"]:
        name = e.get("name", "")
        if e.get("ph") != "X" or e.get("pid") not in pids or "dur" not in e or not name[:1].isalpha():
            continue
        if name.startswith(("ThunkExecutor", "SlinkyThreadPool", "PjitFunction")):
            continue
        by_kind[op_kind(name, hlo, model.cfg.vocab_size)] += e["dur"] / 1e3 / calls
    ranked = sorted(by_kind.items(), key=lambda kv: -kv[1])
    return {"context": context, "calls": calls, "wall_ms_per_call": round(wall_ms, 1),
            "op_ms_per_call": round(sum(by_kind.values()), 1),
            "by_kind_ms": {kind: round(ms, 2) for kind, ms in ranked if ms >= 0.5}}


# ---- library paths (one process per flag set) -------------------------------------------------------------

def products_program(model: Any, precision: str) -> tuple[Callable, tuple]:
    """Every layer product of one chunk, independent of each other (int8: the W8A8 path of core.model.linear;
    float32: the same weights dequantized)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import core.model as m

    weights = []
    for lp in model.params["layers"]:
        for w in lp.values():
            if isinstance(w, dict) and "qa8" in w:
                weights.append(w if precision == "int8" else
                               (np.asarray(w["qa8"], np.float32) * np.asarray(w["s"])[:, None]).astype(np.float32))
    rng = np.random.default_rng(1)
    inputs = {w["qa8"].shape[1] if isinstance(w, dict) else w.shape[1] for w in weights}
    xs = {n: jnp.asarray(rng.standard_normal((CHUNK, n)), jnp.float32) for n in sorted(inputs)}

    def run(xs, weights):
        return [m.linear(xs[(w["qa8"] if isinstance(w, dict) else w).shape[1]], w) for w in weights]

    return jax.jit(run), (xs, weights)


def library_worker(rounds: int) -> dict[str, Any]:
    import jax

    model = load()
    runner = ChunkRunner(model)
    context = 1024
    whole = compile_chunk(model, bucket(context + CHUNK), None, runner.args(context))
    products = {p: products_program(model, p) for p in ("int8", "float32")}
    runner.run(whole, context)
    for program, args in products.values():
        jax.block_until_ready(program(*args))
    times: dict[str, list[float]] = {"whole chunk (context 1024)": [], "layer products int8": [],
                                     "layer products float32": []}
    for _ in range(rounds):
        times["whole chunk (context 1024)"].append(runner.run(whole, context))
        for precision, (program, args) in products.items():
            begin = time.perf_counter()
            jax.block_until_ready(program(*args))
            times[f"layer products {precision}"].append(time.perf_counter() - begin)
    return {name: round(statistics.median(v) * 1e3, 2) for name, v in times.items()}


def library_part(rounds: int) -> dict[str, Any]:
    out = {}
    for label, flags in LIBRARY_FLAGS.items():
        log(f"library path {label}: {flags or '(no extra flags)'}")
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
        proc = subprocess.run([sys.executable, __file__, "--library-worker", "--rounds", str(rounds)], env=env,
                              capture_output=True, text=True, timeout=3600, cwd=ROOT)
        if proc.returncode != 0:
            out[label] = {"flags": flags, "error": proc.stderr.strip().splitlines()[-3:]}
            continue
        out[label] = {"flags": flags, "ms_p50": json.loads(proc.stdout.strip().splitlines()[-1])}
        log(json.dumps(out[label]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", default="0,1024,3072", help="positions the slot holds before the chunk")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--skip-libraries", action="store_true")
    p.add_argument("--library-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/prefill-breakdown-cpu.json"))
    args = p.parse_args(argv)
    if args.library_worker:
        print(json.dumps(library_worker(args.rounds)))
        return 0
    contexts = [int(c) for c in args.contexts.split(",")]
    report: dict[str, Any] = {
        "what": "a 512-token prefill chunk of the default model (W8A8 weights, int8 KV, one slot of 8192), by part: "
                "the whole program's time minus the program with that part knocked out; then XLA:CPU's dot "
                "library paths",
        "command": "python3 benchmarks/prefill_breakdown.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": git_commit(mark_dirty=True), "host": host(), "versions": versions(["jax", "jaxlib"]),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "notes": "knockouts do not add up to the whole: XLA:CPU runs independent ops on both cores, so a part "
                 "removed also frees a core for the others (the sum of parts exceeds the whole); the profile's op "
                 "times overlap for the same reason",
    }
    model = load()
    report["knockouts"] = knockout_part(model, contexts, args.rounds)
    save_report(args.out, report, echo=False)
    report["profile"] = profile_part(model, 1024, args.rounds)
    log(json.dumps(report["profile"]))
    save_report(args.out, report, echo=False)
    if not args.skip_libraries:
        del model
        report["library_paths"] = library_part(args.rounds)
    save_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
