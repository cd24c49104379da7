"""The int8 output projection (8 rows x hidden x vocab) in three operand layouts, timed alternately.

    python3 benchmarks/lm_head.py [--rows 8 --hidden 640 --vocab 262144 --repeats 15]

The default model's lm_head is its tied embedding table [V, D]; a decode step multiplies 8 rows by it.
Layouts: x @ W[V, D].T (what the model does), x @ W[D, V] (a transposed copy of the table),
W[V, D] @ x.T (the weight as the left operand), and each of the first and last followed by the float
dequantization to [rows, V] logits (as the model uses them; the last then also transposes).
Prints and saves JSON with the median ms of each and the ratio to the first, plus the int8 GOP/s and
GB/s that the first reaches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import host, save_report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/lm-head-int8-cpu.json"))
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-127, 128, (args.rows, args.hidden)), jnp.int8)
    w_vd = rng.integers(-127, 128, (args.vocab, args.hidden)).astype(np.int8)
    w_dv = jnp.asarray(np.ascontiguousarray(w_vd.T))
    w_vd = jnp.asarray(w_vd)
    tables = {"x @ W[V,D].T": w_vd, "x @ W[D,V]": w_dv, "W[V,D] @ x.T": w_vd,
              "x @ W[V,D].T, dequantized": w_vd, "(W[V,D] @ x.T).T, dequantized": w_vd}
    int32 = jnp.int32
    row_scale = jnp.asarray(rng.random((args.rows, 1)), jnp.float32)
    col_scale = jnp.asarray(rng.random(args.vocab), jnp.float32)
    fns = {
        "x @ W[V,D].T": jax.jit(lambda a, w: lax.dot_general(a, w, (((1,), (1,)), ((), ())),
                                                             preferred_element_type=int32)),
        "x @ W[D,V]": jax.jit(lambda a, w: lax.dot_general(a, w, (((1,), (0,)), ((), ())),
                                                           preferred_element_type=int32)),
        "W[V,D] @ x.T": jax.jit(lambda a, w: lax.dot_general(w, a, (((1,), (1,)), ((), ())),
                                                             preferred_element_type=int32)),
        "x @ W[V,D].T, dequantized": jax.jit(lambda a, w: lax.dot_general(
            a, w, (((1,), (1,)), ((), ())), preferred_element_type=int32).astype(jnp.float32)
            * row_scale * col_scale),
        "(W[V,D] @ x.T).T, dequantized": jax.jit(lambda a, w: lax.dot_general(
            w, a, (((1,), (1,)), ((), ())), preferred_element_type=int32).T.astype(jnp.float32)
            * row_scale * col_scale),
    }
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():  # compile and warm
        jax.block_until_ready(fn(x, tables[name]))
    for _ in range(args.repeats):  # alternated, so drift in the host's load hits every layout alike
        for name, fn in fns.items():
            begin = time.perf_counter()
            jax.block_until_ready(fn(x, tables[name]))
            times[name].append(time.perf_counter() - begin)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    first = next(iter(ms))
    ops = 2 * args.rows * args.hidden * args.vocab
    report = {
        "backend": jax.default_backend(), "jax": jax.__version__, "host": host(), "rows": args.rows,
        "hidden": args.hidden, "vocab": args.vocab, "repeats": args.repeats,
        "ms_median": {k: round(v, 2) for k, v in ms.items()},
        "ratio_vs_first": {k: round(v / ms[first], 3) for k, v in ms.items()},
        "first_int8_gops": round(ops / ms[first] / 1e6, 1),
        "first_table_gbps": round(args.vocab * args.hidden / ms[first] / 1e6, 2),
    }
    save_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
