"""What bit-identical prefix reuse rests on, checked on whatever host runs the suite: each primitive of the
model gives a row the same bits however many rows share its call and wherever the row sits among them, the
XLA:CPU flags that make it so are in force in every process that imports core, and the int8 matmuls are
exact whichever kernel YNNPACK picks for this CPU (docs/design-notes.md, "Exact on every host")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.device import EXACT_CPU_FLAGS
from core.model import (
    FLOAT_VALUE_BLOCK,
    apply_rope,
    blocked_prob_value,
    exact_sum,
    linear,
    materialized,
    quantize_int8,
    query_key,
    rms_norm,
    rope_tables,
    softmax,
    times,
    times_in_blocks,
)
from core.rotation import rotate

ROOT = Path(__file__).resolve().parents[1]
ROW_COUNTS = (1, 2, 3, 5, 7, 8, 9, 16, 17, 31, 64, 100)
SHIFTS = (0, 3)  # where the reference rows start inside the call
RNG = np.random.default_rng(0)


def rows_are_invariant(fn, width: int) -> list[tuple[int, int, int]]:
    """Run fn on every (shift, row count) window of one input [rows, width]; the (shift, rows, row) triples
    whose output row differs from the same input row computed in a call of 8 rows starting at 0."""
    x = RNG.standard_normal((max(ROW_COUNTS) + max(SHIFTS), width)).astype(np.float32) * 3
    jitted = jax.jit(fn)
    reference = np.asarray(jitted(jnp.asarray(x[:8])))
    differing = []
    for shift in SHIFTS:
        for count in ROW_COUNTS:
            out = np.asarray(jitted(jnp.asarray(x[shift:shift + count])))
            differing += [(shift, count, r) for r in range(count)
                          if shift + r < 8 and not np.array_equal(out[r], reference[shift + r])]
    return differing


def _w8a8_matrix(out: int, width: int) -> dict:
    return {"qa8": jnp.asarray(RNG.integers(-127, 128, (out, width)), jnp.int8),
            "s": jnp.asarray(RNG.random(out) + 0.5, jnp.float32)}


W8A8_MATRIX = _w8a8_matrix(2048, 640)
FLOAT_MATRIX = jnp.asarray(RNG.standard_normal((1536, 640)), jnp.float32)  # the default model's fused q/k/v
LORA_DOWN = jnp.asarray(RNG.standard_normal((2048, 16)) * 0.1, jnp.float32)  # a rank-16 A^T of down_proj
LORA_UP = jnp.asarray(RNG.standard_normal((16, 2048)) * 0.1, jnp.float32)  # a rank-16 B^T of gate_proj
LORA_QKV_DOWN = jnp.asarray(RNG.standard_normal((640, 48)) * 0.1, jnp.float32)  # q, k and v's A^T side by side


def _rope(x: jax.Array) -> jax.Array:
    """RoPE of the first half of each row by angles taken from its second half (a function of the row alone)."""
    half = x.shape[-1] // 2
    angles = x[:, half:]
    return apply_rope(x[None, :, None, :half], jnp.cos(angles)[None], jnp.sin(angles)[None])[0, :, 0]


PRIMITIVES = {
    # (function of x [rows, width], width): the model's per-row work at the real model's sizes and small ones
    "rms_norm-8": (lambda x: rms_norm(x, None, 1e-6), 8),
    "rms_norm-640": (lambda x: rms_norm(x, jnp.linspace(0.5, 1.5, 640), 1e-6), 640),
    "rms_norm-2048": (lambda x: rms_norm(x, None, 1e-6), 2048),
    "residual+norm-640": (lambda x: x * 1.3 + rms_norm(x[:, ::-1], jnp.linspace(0.5, 1.5, 640), 1e-6), 640),
    "rotate-640": (rotate, 640),
    "rotate-2048": (rotate, 2048),
    "quantize-640": (lambda x: quantize_int8(x)[0].astype(jnp.float32) * quantize_int8(x)[1][:, None], 640),
    "w8a8-linear-640x2048": (lambda x: linear(x, W8A8_MATRIX), 640),
    "float-linear-640x1536": (lambda x: linear(x, FLOAT_MATRIX), 640),
    "lora-down-2048x16": (lambda x: times_in_blocks(x, LORA_DOWN), 2048),  # core.model.slot_terms' products
    "lora-down-640x48": (lambda x: times_in_blocks(x, LORA_QKV_DOWN), 640),  # an input group's (q, k, v)
    "lora-down-bf16-640x48": (lambda x: times_in_blocks(x, LORA_QKV_DOWN.astype(jnp.bfloat16)), 640),
    "lora-up-16x2048": (lambda x: times(x, LORA_UP), 16),
    "lora-down-bf16-2048x16": (lambda x: times_in_blocks(x, LORA_DOWN.astype(jnp.bfloat16)), 2048),  # bfloat16 slots
    "lora-up-bf16-16x2048": (lambda x: times(x, LORA_UP.astype(jnp.bfloat16)), 16),
    "gelu*up-128": (lambda x: jax.nn.gelu(x[:, :64], approximate=True) * x[:, 64:], 128),
    "sum-of-products-8": (lambda x: x[:, :4] * x[:, :4] + x[:, 4:] * x[:, 4:], 8),
    "rope-256": (_rope, 256),
    "softmax-1024": (softmax, 1024),
    "softcap-512": (lambda x: jnp.tanh(x / 30.0) * 30.0, 512),
}


@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_each_primitive_gives_a_row_the_same_bits_whatever_rows_share_its_call(name):
    fn, width = PRIMITIVES[name]
    assert rows_are_invariant(fn, width) == []


def test_softmax_does_not_depend_on_where_its_keys_sit_or_how_many_masked_ones_follow():
    """A sliding view puts the same keys at other indices, a larger attention bucket adds masked positions:
    the probabilities of the real keys keep their bits."""
    scores = RNG.standard_normal(40).astype(np.float32) * 4
    base = np.asarray(jax.jit(softmax)(jnp.asarray(scores)))
    for length in (40, 48, 64, 1024):
        for roll in (0, 5, 17):
            padded = np.full(length, -1e30, np.float32)
            padded[:40] = scores
            padded = np.roll(padded, roll)
            got = np.roll(np.asarray(jax.jit(softmax)(jnp.asarray(padded))), -roll)[:40]
            np.testing.assert_array_equal(got, base)
    np.testing.assert_allclose(base, np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum(), rtol=1e-6)


KEYS, HEAD = 512, 256  # a sliding window of the default model, its head size


def _keys_at(offset: int, length: int, real: np.ndarray) -> np.ndarray:
    """A view of `length` keys [1, length, 1, HEAD] holding `real` at `offset` and other values elsewhere."""
    view = RNG.standard_normal((1, length, 1, HEAD)).astype(np.float32)
    view[:, offset:offset + len(real), 0] = real
    return view


# (queries, view length, offset of the real keys): chunk sizes, sliding views and attention buckets of the default
# model; offsets are whole value blocks, as core.model.sliding_view_positions aligns them.
VIEWS = [(q, length, offset) for q in (128, 32, 8, 1) for length, offset in
         ((576, 0), (576, 64), (704, 128), (1024, 0), (1024, 512), (2048, 1536))]


def test_float_scores_and_value_sums_do_not_depend_on_the_view_around_the_real_keys():
    """The float path's attention: a query's scores against its keys, and its sum of probabilities x values
    (`blocked_prob_value`), keep their bits whatever the query count, the view's length and the
    block-aligned offset of the keys in it (one plain contraction over the view did not, on an AMD EPYC
    Zen 4)."""
    queries = RNG.standard_normal((1, 128, 1, 4, HEAD)).astype(np.float32)  # [B, T, kh, g, d]
    real_keys, real_values = (RNG.standard_normal((KEYS, HEAD)).astype(np.float32) for _ in range(2))
    probs = RNG.random((1, 128, 1, 4, KEYS)).astype(np.float32)  # [B, T, kh, g, S]
    scores_fn = jax.jit(query_key)
    values_fn = jax.jit(blocked_prob_value, static_argnums=2)
    want_scores = want_values = None
    for q, length, offset in VIEWS:
        keys, values = _keys_at(offset, length, real_keys), _keys_at(offset, length, real_values)
        view_probs = np.zeros((1, q, 1, 4, length), np.float32)
        view_probs[..., offset:offset + KEYS] = probs[:, :q]
        scores = np.asarray(scores_fn(jnp.asarray(queries[:, :q]), jnp.asarray(keys)))[..., offset:offset + KEYS]
        summed = np.asarray(values_fn(jnp.asarray(view_probs), jnp.asarray(values), FLOAT_VALUE_BLOCK))
        if want_scores is None:
            want_scores, want_values = scores, summed
        n = min(q, want_scores.shape[1])
        np.testing.assert_array_equal(scores[:, :n], want_scores[:, :n], err_msg=str((q, length, offset)))
        np.testing.assert_array_equal(summed[:, :n], want_values[:, :n], err_msg=str((q, length, offset)))


def test_exact_sum_is_exact_to_its_resolution_and_refuses_axes_it_would_overflow():
    terms = RNG.random((3, 5000)).astype(np.float32)
    got = np.asarray(exact_sum(jnp.asarray(terms)))[:, 0]
    truth = np.floor(terms.astype(np.float64) * 2.0**48).sum(axis=-1) * 2.0**-48
    np.testing.assert_allclose(got, truth, rtol=2e-7)  # one float32 rounding of the exact fixed-point sum
    with pytest.raises(ValueError, match="at most"):
        exact_sum(jnp.zeros((1, 2**15), jnp.float32))


def test_exact_sum_ignores_order_and_zero_padding():
    terms = RNG.random((4, 700)).astype(np.float32) ** 8  # many small terms: every digit carries
    padded = np.concatenate([np.zeros((4, 300), np.float32), terms[:, ::-1], np.zeros((4, 24), np.float32)], 1)
    want = np.asarray(jax.jit(exact_sum)(jnp.asarray(terms)))
    np.testing.assert_array_equal(np.asarray(jax.jit(exact_sum)(jnp.asarray(padded))), want)


@pytest.mark.parametrize("rows", [1, 3, 8, 512])
def test_materialized_keeps_every_bit(rows):
    magnitudes = (0.5 + RNG.random((rows, 128))) * 10.0 ** RNG.integers(-30, 30, (rows, 128))  # never subnormal
    x = (RNG.choice([-1.0, 1.0], (rows, 128)) * magnitudes).astype(np.float32)
    x[:, :3] = [0.0, 1.0, -1.0]
    got = np.asarray(jax.jit(materialized)(jnp.asarray(x)))
    np.testing.assert_array_equal(got.view(np.uint32), x.view(np.uint32))


@pytest.mark.parametrize("base", [10_000.0, 1_000_000.0])  # Gemma 3's sliding and global layers
def test_rope_tables_are_xla_cos_and_sin_of_every_position(base):
    """Every position of an 8K slot: `materialized` would flush a subnormal table entry, so this also checks
    that the tables hold none."""
    positions = jnp.arange(8192, dtype=jnp.int32).reshape(2, 4096)
    inv_freq = (1.0 / base ** (np.arange(0, 256, 2) / 256)).astype(np.float32)
    cos, sin = jax.jit(lambda p: rope_tables(p, inv_freq, jnp.float32))(positions)
    freqs = jax.jit(lambda p: p.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq))(positions)
    for got, fn in ((cos, jnp.cos), (sin, jnp.sin)):
        half = np.asarray(jax.jit(fn)(freqs))
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                      np.concatenate([half, half], axis=-1).view(np.uint32))


@pytest.mark.parametrize("m,k,n", [(1, 640, 2048), (8, 640, 2048), (17, 2048, 640), (100, 256, 1024), (8, 640, 4096)])
def test_int8_matmuls_equal_exact_integer_products(m, k, n):
    """YNNPACK picks an int8 kernel by shape and by this CPU's features (AVX2, AVX-512 VNNI, AMX...), which
    no flag can pin; an int32 accumulation is exact in every one of them, which this checks."""
    a = RNG.integers(-127, 128, (m, k)).astype(np.int8)
    b = RNG.integers(-127, 128, (n, k)).astype(np.int8)
    got = jax.jit(lambda x, y: jax.lax.dot_general(x, y, (((1,), (1,)), ((), ())),
                                                   preferred_element_type=jnp.int32))(a, b)
    np.testing.assert_array_equal(np.asarray(got), a.astype(np.int64) @ b.astype(np.int64).T)


PROBE = """
import json, os, sys
import jax, jax.numpy as jnp
import core  # imported after jax, before the first computation: the flags still take effect
x = jnp.ones((7, 640), jnp.float32)
hlo = jax.jit(lambda v: jnp.sum(v * v, axis=-1)).lower(x).compile().as_text()
print(json.dumps({"flags": os.environ.get("XLA_FLAGS", ""), "ynn_reduce": "__ynn_fusion" in hlo}))
"""


def test_a_fresh_process_that_imports_core_runs_with_the_exactness_flags():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    for name, value in EXACT_CPU_FLAGS.items():
        assert f"--{name}={value}" in probe["flags"].split()
    assert probe["ynn_reduce"] is False  # the reduction runs in XLA's own emitter


def test_flags_the_user_set_are_kept():
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_max_isa=AVX2 --xla_dump_to=/dev/null"}
    out = subprocess.run([sys.executable, "-c", "import core, os; print(os.environ['XLA_FLAGS'])"], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True, timeout=60)
    flags = out.stdout.split()
    assert "--xla_cpu_max_isa=AVX2" in flags and "--xla_cpu_max_isa=AVX" not in flags
    assert "--xla_cpu_enable_platform_dependent_math=false" in flags and "--xla_dump_to=/dev/null" in flags


THREADS_PROBE = """
import sys
import numpy as np
sys.path.insert(0, "tests")
import core  # noqa: F401  (the pins)
from core.engine import Engine, EngineConfig
from core.weights import random_params, to_w8a8
from tiny_models import model_config
cfg = model_config("gemma3")
engine = Engine(cfg, to_w8a8(random_params(cfg, std=0.1, norm_std=0.1, seed=3)),
                EngineConfig(num_slots=2, max_len=96, chunk_sizes=(4, 16), kv_dtype="int8"), "float32")
ids = np.random.default_rng(1).integers(3, cfg.vocab_size, size=37)
engine.prefill(0, ids[:11], 0)
np.save(sys.argv[1], np.stack([np.asarray(engine.prefill(0, ids[11:], 11)), np.asarray(engine.prefill(1, ids, 0))]))
"""


def test_the_cpu_count_does_not_change_a_result(tmp_path):
    """XLA and YNNPACK size their thread pools by the CPUs the process may use; work is split by output rows
    and columns, never inside a sum, so the same prefill on one CPU and on all of them gives the same bits."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    results = []
    for name, prefix in (("all", []), ("one", ["taskset", "-c", "0"])):
        path = tmp_path / f"{name}.npy"
        subprocess.run([*prefix, sys.executable, "-c", THREADS_PROBE, str(path)], cwd=ROOT, env=env, check=True,
                       capture_output=True, timeout=300)
        results.append(np.load(path))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0][0], results[0][1])  # resumed after 11 tokens == cold


@pytest.mark.parametrize("family,kv_dtype,precision", [("gemma3", "int8", "w8a8"), ("gemma4", "float32", "float")])
def test_a_long_chunk_attends_in_query_blocks_with_the_bits_of_short_chunks(family, kv_dtype, precision):
    """A sliding layer splits a chunk of several SLIDING_QUERY_BLOCKs into blocks of queries, each attending
    over the view its own block needs (`core.model.layer_attention`); a chunk of one block attends as one.
    Two prompts prefilled as long chunks after a short one, one row in its named slot and both rows as a
    batch (row b in slot b), give the logits and the cache of block-sized chunks, bit for bit. The window is
    8, so a block whose view ended anywhere but at its own end would read other keys."""
    from core.kv_cache import CacheSpec, init_cache
    from core.model import SLIDING_QUERY_BLOCK, prefill_chunk
    from core.weights import random_params, to_w8a8
    from tiny_models import model_config

    cfg = model_config(family)
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=5)
    params = to_w8a8(params) if precision == "w8a8" else params
    block, head = SLIDING_QUERY_BLOCK, 5
    prompts = RNG.integers(3, cfg.vocab_size, size=(2, head + 3 * block)).astype(np.int32)
    step = jax.jit(prefill_chunk, static_argnames="cfg")

    def prefill(rows: np.ndarray, cuts: list[int], slot: int | None) -> tuple[np.ndarray, dict]:
        """rows [R, L] in chunks ending at `cuts`, into slot `slot` (one row) or row r into slot r."""
        cache = init_cache(cfg, CacheSpec(num_slots=2, max_len=4 * block, dtype=kv_dtype))
        for start, end in zip([0, *cuts], [*cuts, rows.shape[1]], strict=True):
            n = end - start
            tokens = np.zeros((len(rows), -(-n // block) * block if n > block else n), np.int32)
            tokens[:, :n] = rows[:, start:end]
            logits, cache = step(params, cache, jnp.asarray(tokens), jnp.full(len(rows), start, jnp.int32),
                                 jnp.full(len(rows), n, jnp.int32), None if slot is None else jnp.asarray([slot]),
                                 cfg=cfg)
        return np.asarray(logits), jax.tree_util.tree_map(np.asarray, cache)

    long_cuts, short_cuts = [head, head + 3 * block - 7], [head + i * block for i in range(3)]
    want = {slot: prefill(prompts[slot:slot + 1], short_cuts, slot) for slot in (0, 1)}
    # (rows, the slot argument, (row, slot) pairs to compare): one row in a named slot; both rows in theirs
    for rows, slot_arg, pairs in ((prompts[1:2], 1, [(0, 1)]), (prompts, None, [(0, 0), (1, 1)])):
        got_logits, got_cache = prefill(rows, long_cuts, slot_arg)
        for row, slot in pairs:
            want_logits, want_cache = want[slot]
            np.testing.assert_array_equal(got_logits[row], want_logits[0])
            for got, wanted in zip(jax.tree_util.tree_leaves(got_cache), jax.tree_util.tree_leaves(want_cache),
                                   strict=True):
                np.testing.assert_array_equal(got[slot], wanted[slot])
