#!/usr/bin/env python3
"""Why 8 different LoRA adapters cost a decode step what they do (issue #31, docs/lora.md): the adapter terms
of one decode step on the default model's projection shapes (18 layers, q/k/v/o and gate/up/down, 8 rows,
8 slots of rank 16), computed in each candidate form, alone, under the engine's pinned XLA flags.

Forms timed (each for 8 rows under 8 different slots and 8 rows sharing one):
- ``per_slot``: each used slot's `linear` pair per projection over the rows (lax.cond);
- ``per_slot_folded``: the same with q/k/v and gate/up folded into one down product per slot (what
  `core.model.lora_delta` does, there in the contracted-first layout, not this [out, in] one);
- ``batched_slots``: one batched product over all slots (slots as the batch dimension), each row's own kept;
- ``all_columns``: one product against every slot's A ([rows, S*R]), masked to the row's slot, then B;
- ``gathered_reduce``: each row's matrices gathered, multiplied and summed (no dot).
Plus the cost of one small dot ([8, 640] x [640, 16]) inside a program, which bounds every exact form:
a form that keeps the model's own products needs at least one pair of dots per projection group and layer.

    python3 benchmarks/lora_forms.py   # prints JSON, writes benchmarks/results/lora-forms-cpu.json
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.device import configure_environment  # noqa: E402

configure_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import git_commit, host, save_report  # noqa: E402

SLOTS, RANK, LAYERS, ROWS = 8, 16, 18, 8
HIDDEN, Q_OUT, KV_OUT, MLP = 640, 1024, 256, 2048  # Gemma 3 270M
PROJECTIONS = [(HIDDEN, Q_OUT), (HIDDEN, KV_OUT), (HIDDEN, KV_OUT), (Q_OUT, HIDDEN), (HIDDEN, MLP), (HIDDEN, MLP),
               (MLP, HIDDEN)]  # (in, out) of q, k, v, o, gate, up, down
GROUPS = [(HIDDEN, [Q_OUT, KV_OUT, KV_OUT]), (Q_OUT, [HIDDEN]), (HIDDEN, [MLP, MLP]), (MLP, [HIDDEN])]
Pair = tuple[jax.Array, jax.Array]  # down [S, R*k, in], up [S, out, R] (one per folded target)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("ni,oi->no", x, w)


def per_slot(x: jax.Array, rows: jax.Array, body: Callable[[int], jax.Array], width: int) -> jax.Array:
    """Each used slot's body over every row (skipped by lax.cond when no row uses it); each row keeps its own."""
    total = zeros = jnp.zeros((x.shape[0], width), x.dtype)
    for slot in range(SLOTS):
        part = jax.lax.cond(jnp.any(rows == slot), lambda k=slot: body(k), lambda: zeros)
        total = jnp.where((rows == slot)[:, None], part, total)
    return total


def form_per_slot(x: jax.Array, rows: jax.Array, weights: list[list[Pair]]) -> jax.Array:
    out = jnp.zeros((), x.dtype)
    for layer in weights:
        for (down, up), (i, o) in zip(layer, PROJECTIONS, strict=True):
            xi = x[:, :i]
            out += per_slot(xi, rows, lambda k, xi=xi, down=down, up=up: linear(linear(xi, down[k]), up[k]), o).sum()
    return out


def form_folded(x: jax.Array, rows: jax.Array, weights: list[list[tuple[jax.Array, list[jax.Array]]]]) -> jax.Array:
    out = jnp.zeros((), x.dtype)
    for layer in weights:
        for (down, ups), (i, outs) in zip(layer, GROUPS, strict=True):
            xi = x[:, :i]

            def body(k: int, xi: jax.Array = xi, down: jax.Array = down, ups: list = ups) -> jax.Array:
                h = linear(xi, down[k])
                return jnp.concatenate([linear(h[:, j * RANK:(j + 1) * RANK], up[k]) for j, up in enumerate(ups)], -1)

            out += per_slot(xi, rows, body, sum(outs)).sum()
    return out


def form_batched(x: jax.Array, rows: jax.Array, weights: list[list[Pair]]) -> jax.Array:
    out = jnp.zeros((), x.dtype)
    for layer in weights:
        for (down, up), (i, _) in zip(layer, PROJECTIONS, strict=True):
            terms = jnp.einsum("snr,sor->sno", jnp.einsum("ni,sri->snr", x[:, :i], down), up)
            out += jnp.take_along_axis(terms, rows[None, :, None], axis=0)[0].sum()
    return out


def form_all_columns(x: jax.Array, rows: jax.Array, weights: list[list[Pair]]) -> jax.Array:
    out = jnp.zeros((), x.dtype)
    owner = jnp.arange(SLOTS * RANK) // RANK
    for layer in weights:
        for (down, up), (i, o) in zip(layer, PROJECTIONS, strict=True):
            h = linear(x[:, :i], down.reshape(SLOTS * RANK, i))
            h = jnp.where(owner[None, :] == rows[:, None], h, 0.0)
            out += linear(h, up.transpose(1, 0, 2).reshape(o, SLOTS * RANK)).sum()
    return out


def form_gathered(x: jax.Array, rows: jax.Array, weights: list[list[Pair]]) -> jax.Array:
    out = jnp.zeros((), x.dtype)
    for layer in weights:
        for (down, up), (i, _) in zip(layer, PROJECTIONS, strict=True):
            h = jnp.sum(x[:, None, :i] * down[rows], axis=-1)
            out += jnp.sum(h[:, None, :] * up[rows], axis=-1).sum()
    return out


def dots_only(x: jax.Array, rows: jax.Array, weights: list[list[Pair]]) -> jax.Array:
    """SLOTS x 126 small dots ([8, in] x [in, 16]) in one program, nothing else: the per-dot cost."""
    return sum(linear(x[:, :i], down[k]).sum() for layer in weights
               for (down, _), (i, _) in zip(layer, PROJECTIONS, strict=True) for k in range(SLOTS))


def timed_ms(fn: Callable, *args: Any, repeats: int = 15) -> float:
    compiled = jax.jit(fn)
    compiled(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        compiled(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 2)


def main() -> None:
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 0.05)

    pairs = [[(rand(SLOTS, RANK, i), rand(SLOTS, o, RANK)) for i, o in PROJECTIONS] for _ in range(LAYERS)]
    folded = [[(rand(SLOTS, RANK * len(outs), i), [rand(SLOTS, o, RANK) for o in outs]) for i, outs in GROUPS]
              for _ in range(LAYERS)]
    x = rand(ROWS, MLP)
    cases = {"distinct": jnp.arange(ROWS, dtype=jnp.int32), "shared": jnp.zeros(ROWS, jnp.int32)}
    forms = {"per_slot": (form_per_slot, pairs), "per_slot_folded": (form_folded, folded),
             "batched_slots": (form_batched, pairs), "all_columns": (form_all_columns, pairs),
             "gathered_reduce": (form_gathered, pairs)}
    results: dict[str, Any] = {name: {case: timed_ms(fn, x, rows, w) for case, rows in cases.items()}
                               for name, (fn, w) in forms.items()}
    dots = SLOTS * LAYERS * len(PROJECTIONS)
    per_dot_us = round(timed_ms(dots_only, x, cases["distinct"], pairs) * 1e3 / dots, 1)
    report = {
        "benchmark": "lora_forms", "commit": git_commit(), "host": host(),
        "shapes": {"layers": LAYERS, "rows": ROWS, "slots": SLOTS, "rank": RANK, "projections": PROJECTIONS},
        "adapter_terms_ms": results, "small_dot_us": per_dot_us, "small_dots_timed": dots,
        "note": "the adapter terms alone, not a whole decode step (benchmarks/lora.py: 41.5-42.7 ms on the "
                "AMX Xeon); 1.15x of that leaves about 6 ms for them",
    }
    save_report(ROOT / "benchmarks" / "results" / "lora-forms-cpu.json", report)


if __name__ == "__main__":
    main()
