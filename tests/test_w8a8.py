"""W8A8: int8 weights (per output row) times int8 activations (per token), accumulated in int32.

The checks are exactness against the same quantization math done elsewhere (numpy with integer
accumulation; a float model whose weights and activations are fake-quantized the same way), plus a
loose check against float32 itself; the quality on the real model is measured in benchmarks/quality.py.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_weight_storage import ArraySource

import core.model as model
from core.engine import Engine, EngineConfig
from core.kv_cache import CacheSpec, init_cache
from core.rotation import block_size, hadamard, rotate
from core.weights import WeightPolicy, load_params, quantize_rows_int8, quantize_w8a8, random_params, to_w8a8
from tiny_models import model_config


def numpy_w8a8(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Both rotated by R, per-token symmetric int8 x, per-row int8 w, integer dot products, then both scales."""
    x = rotate(x.astype(np.float32), xp=np)
    x_scale = np.abs(x).max(axis=-1) / np.float32(127.0)
    x8 = np.clip(np.round(x / np.where(x_scale == 0, 1.0, x_scale)[..., None]), -127, 127).astype(np.int32)
    q = quantize_rows_int8(w @ rotation_matrix(w.shape[1]))
    acc = x8 @ q["q"].astype(np.int32).T  # exact in int32
    return acc.astype(np.float32) * (x_scale[..., None] * q["s"][None, :])


def rotation_matrix(n: int) -> np.ndarray:
    b = block_size(n)
    return np.kron(np.eye(n // b), hadamard(b))


def w8a8_weight(w: np.ndarray) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v) for k, v in quantize_w8a8(w).items()}


@pytest.mark.parametrize("shape", [(5, 48), (2, 3, 48), (8, 1, 48), (1, 48), (1, 1, 48), (9, 48)])
def test_w8a8_linear_equals_integer_reference(shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, ...] = 0.0  # an all-zero token: scale 0, output 0, no NaN
    w = (rng.standard_normal((40, 48)) * 0.1).astype(np.float32)
    w[3] = 0.0  # an all-zero output row
    got = np.asarray(jax.jit(model.linear)(jnp.asarray(x), w8a8_weight(w)))
    want = numpy_w8a8(x, w)
    assert got.shape == (*shape[:-1], 40)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert np.all(got[0] == 0)


@pytest.mark.parametrize("n", [7, 48, 640, 1024, 1536, 2048, 12288])
def test_rotation_is_orthogonal_block_hadamard_and_its_own_inverse(n):
    r = rotation_matrix(n)
    b = block_size(n)
    blocks = [r[i:i + b, i:i + b] for i in range(0, n, b)]  # block diagonal: each block orthogonal, zeros outside
    assert sum(np.count_nonzero(blk) for blk in blocks) == np.count_nonzero(r)
    for blk in blocks:
        np.testing.assert_allclose(blk @ blk.T, np.eye(b), atol=1e-5)
    x = np.random.default_rng(n).standard_normal((2, 3, n)).astype(np.float32)
    np.testing.assert_allclose(rotate(x, xp=np), x @ r, atol=1e-4)
    np.testing.assert_allclose(np.asarray(rotate(jnp.asarray(x))), x @ r, atol=1e-4)
    np.testing.assert_allclose(rotate(rotate(x, xp=np), xp=np), x, atol=1e-5)
    assert block_size(n) == min(n & -n, 128)


def test_rotation_spreads_an_outlier_channel():
    """Why it exists: one huge channel sets a per-token scale that leaves the others a few grid steps."""
    x = np.random.default_rng(0).standard_normal((64, 640)).astype(np.float32)
    x[:, 17] = 300.0
    w = np.random.default_rng(1).standard_normal((32, 640)).astype(np.float32) * 0.05
    exact = x @ w.T
    plain = np.asarray(model.linear(jnp.asarray(x), {"q": jnp.asarray(quantize_rows_int8(w)["q"]),
                                                      "s": jnp.asarray(quantize_rows_int8(w)["s"])}))
    rotated = np.asarray(model.linear(jnp.asarray(x), w8a8_weight(w)))
    x8, scale = model.quantize_int8(jnp.asarray(x))  # the unrotated per-token grid, for the comparison
    unrotated = (np.asarray(x8, np.float32) * np.asarray(scale)[:, None]) @ w.T
    assert np.abs(rotated - exact).mean() < 0.25 * np.abs(unrotated - exact).mean()
    assert np.abs(plain - exact).mean() < np.abs(unrotated - exact).mean()


def test_w8a8_embedding_rows_unrotate_to_the_table():
    table = np.random.default_rng(2).standard_normal((50, 640)).astype(np.float32)
    ids = jnp.asarray([[3, 49, 0]])
    rows = np.asarray(model.embedding_rows(w8a8_weight(table), ids, jnp.float32))
    np.testing.assert_allclose(rows, table[np.asarray(ids)], atol=0.02 * np.abs(table).max())


def test_float_path_is_unchanged():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 48)).astype(np.float32)
    w = rng.standard_normal((40, 48)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(model.linear(jnp.asarray(x), jnp.asarray(w))), x @ w.T, rtol=1e-5,
                               atol=1e-5)


def fake_quant_linear(x: jax.Array, w) -> jax.Array:
    """The float model of W8A8: activations and weights rounded to their int8 grids, multiplied in float32.

    dequant(x) . dequant(w) = (x8 . q) * x_scale * s; the integer grid values are multiplied and summed in
    float32, which is exact while in_features * 127^2 < 2^24 (every tiny-model matrix: in <= 1040). Written
    with the scales inside the sum instead, float32 rounding (~1e-7) moves some next-layer activation across
    a rounding boundary now and then, and a random tiny model amplifies that one-step change to ~1e-2."""
    if isinstance(w, dict) and "qa8" in w:
        assert x.shape[-1] * 127**2 < 2**24
        x8, x_scale = model.quantize_int8(rotate(x.astype(jnp.float32)))
        grid = jnp.einsum("...i,oi->...o", x8.astype(jnp.float32), w["qa8"].astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
        return (grid * (x_scale[..., None] * w["s"])).astype(x.dtype)
    return jnp.einsum("...i,oi->...o", x, w, precision=jax.lax.Precision.HIGHEST)


def logits_for(cfg, params, ids, linear=None, monkeypatch=None):
    if linear is not None:
        monkeypatch.setattr(model, "linear", linear)
    fn = jax.jit(partial(model.sequence_logits, cfg=cfg))
    cache = init_cache(cfg, CacheSpec(1, ids.shape[1]))
    out, _ = fn(params, cache, jnp.asarray(ids, jnp.int32), jnp.zeros(1, jnp.int32),
                jnp.full(1, ids.shape[1], jnp.int32), jnp.zeros(1, jnp.int32))
    if linear is not None:
        monkeypatch.undo()
    return np.asarray(out[0])


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_load_params_w8a8_stores_int8_targets_and_matches_to_w8a8(family):
    cfg = model_config(family)
    source = ArraySource(cfg)
    params = load_params(source, cfg, WeightPolicy(precision="w8a8"))
    layer = params["layers"][0]
    for key in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert layer[key]["qa8"].dtype == jnp.int8 and layer[key]["s"].dtype == jnp.float32
    assert params["embed"]["qa8"].dtype == jnp.int8
    assert params["final_norm"].dtype == jnp.float32
    if family == "gemma4":
        assert layer["per_layer_input_gate"]["qa8"].dtype == jnp.int8
        assert params["per_layer_model_projection"]["qa8"].dtype == jnp.int8
        assert not isinstance(params["embed_per_layer"], dict)  # a gathered table: int4_ple is its option
    converted = to_w8a8(load_params(source, cfg))
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(converted), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError):
        WeightPolicy(precision="w4a4")


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_w8a8_logits_equal_the_fake_quantized_float_model(family, monkeypatch):
    """Every quantized matrix of the whole model (which ones, which axis, which scales) goes through the
    int8 x int8 -> int32 contraction exactly as the float model of the same quantization computes it.

    Both run op by op (jit disabled): compiled, the two programs fuse the rotation differently, and a
    last-bit difference now and then moves an activation across an int8 rounding boundary."""
    cfg = model_config(family)
    params = to_w8a8(random_params(cfg, std=0.1, norm_std=0.1, seed=5))
    ids = np.random.default_rng(6).integers(3, cfg.vocab_size, size=(1, 24))
    with jax.disable_jit():
        got = logits_for(cfg, params, ids)
        want = logits_for(cfg, params, ids, fake_quant_linear, monkeypatch)
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()), rtol=0)


def test_w8a8_logits_track_float32_on_tiny_gemma3():
    """Against float32 itself: per-token int8 activations (step max|x|/254) and per-row int8 weights cost
    about 1% relative error per matrix; random tiny models amplify it, so this bound is loose."""
    cfg = model_config("gemma3")
    f32 = random_params(cfg, std=0.02, norm_std=0.1, seed=7)
    ids = np.random.default_rng(8).integers(3, cfg.vocab_size, size=(1, 24))
    want = logits_for(cfg, f32, ids)
    got = logits_for(cfg, to_w8a8(f32), ids)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 0.1, rel
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8


def test_w8a8_engine_compiles_nothing_after_warmup():
    cfg = model_config("gemma3")
    params = to_w8a8(random_params(cfg, std=0.1, norm_std=0.1, seed=3))
    engine = Engine(cfg, params, EngineConfig(num_slots=3, max_len=64, chunk_sizes=(4, 16)), "float32")
    engine.warmup()
    compiles = []
    listener = lambda name, *_, **__: compiles.append(name)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        rng = np.random.default_rng(9)
        for slot, n in enumerate((3, 9, 21)):
            logits = engine.prefill(slot, rng.integers(3, cfg.vocab_size, size=n), 0)
            token = int(np.argmax(np.asarray(logits)))
            tokens = np.zeros(3, np.int32)
            positions = np.zeros(3, np.int32)
            active = np.zeros(3, bool)
            tokens[slot], positions[slot], active[slot] = token, n, True
            assert np.isfinite(np.asarray(engine.decode(tokens, positions, active))).all()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert [c for c in compiles if c == "/jax/core/compile/backend_compile_duration"] == []


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
@pytest.mark.parametrize("precision", ["float", "w8a8"])
def test_fused_projections_give_the_same_logits(family, precision):
    """q/k/v and gate/up stacked into two matmuls (what load_model serves) change nothing: KV-shared layers
    keep q alone, k=v layers stack q and k, per-row scales and per-token activation scales are unchanged."""
    from core.weights import fuse_projections

    cfg = model_config(family)
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=12)
    if precision == "w8a8":
        params = to_w8a8(params)
    fused = fuse_projections(params)
    assert all("gate_up_proj" in layer and "gate_proj" not in layer for layer in fused["layers"])
    for spec, layer in zip(cfg.layers, fused["layers"], strict=True):
        assert ("qkv_proj" in layer) == spec.owns_cache and ("q_proj" in layer) != spec.owns_cache
    ids = np.random.default_rng(13).integers(3, cfg.vocab_size, size=(1, 20))
    with jax.disable_jit():  # op by op, so that fusion differences between the two programs cannot enter
        got, want = logits_for(cfg, fused, ids), logits_for(cfg, params, ids)
    scale = max(1.0, np.abs(want).max())
    if precision == "w8a8":  # integer products: stacking changes nothing but float epilogues
        np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)
        return
    # float32 GEMMs of another width may block, and so round, differently, and how much depends on the host's
    # kernels (AVX-512 hosts: 1.5e-5 of the largest logit on the Gemma 4 model). The bound is this host's own
    # float32 noise on the same model (the unfused model compiled against op by op), never below the fixed
    # 1e-5 bound of AVX2 hosts; a wrong slice or scale would be off by O(1).
    noise = np.abs(logits_for(cfg, params, ids) - want).max()
    np.testing.assert_allclose(got, want, atol=4 * max(noise, 2.5e-6 * scale), rtol=0)
