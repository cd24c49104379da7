"""Optional int8 weight storage (per-row scales) and the int4 PLE table stay close to float weights."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from core.config import expected_tensor_shapes
from core.kv_cache import CacheSpec, init_cache
from core.model import embedding_rows, sequence_logits
from core.weights import WeightPolicy, load_params, quantize_rows_int4, quantize_rows_int8, to_int4_ple
from tiny_models import model_config


class ArraySource:
    """An in-memory checkpoint with random tensors of the expected shapes."""

    def __init__(self, cfg, seed: int = 0):
        shapes, optional = expected_tensor_shapes(cfg)
        rng = np.random.default_rng(seed)
        # Gemma 4 norms multiply by w: centre them on 1 so activations keep their scale.
        self.tensors = {
            name: (rng.standard_normal(shape) * 0.05 + 1.0 if "norm" in name or "scalar" in name
                   else rng.standard_normal(shape) * 0.1).astype(np.float32)
            for name, shape in shapes.items() if name not in optional
        }
        self.config: dict = {}

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return self.tensors[name].shape

    def file_of(self, name):
        return "memory"

    def read(self, name):
        return self.tensors[name]


def logits_for(cfg, params, ids):
    fn = jax.jit(partial(sequence_logits, cfg=cfg))
    cache = init_cache(cfg, CacheSpec(1, ids.shape[1]))
    out, _ = fn(params, cache, jnp.asarray(ids, jnp.int32), jnp.zeros(1, jnp.int32),
                jnp.full(1, ids.shape[1], jnp.int32), jnp.zeros(1, jnp.int32))
    return np.asarray(out[0])


def test_int8_rows_roundtrip_within_half_a_step():
    w = np.random.default_rng(1).standard_normal((16, 40)).astype(np.float32)
    q = quantize_rows_int8(w)
    assert q["q"].dtype == np.int8
    restored = q["q"].astype(np.float32) * q["s"][:, None]
    assert np.all(np.abs(restored - w) <= q["s"][:, None] / 2 + 1e-7)


def test_int4_packing_roundtrip_through_the_model_lookup():
    w = np.random.default_rng(2).standard_normal((10, 24)).astype(np.float32)
    packed = quantize_rows_int4(w)
    assert packed["q4"].dtype == np.uint8 and packed["q4"].shape == (10, 12)
    rows = np.asarray(embedding_rows({k: jnp.asarray(v) for k, v in packed.items()}, jnp.array([3, 7]), jnp.float32))
    assert np.all(np.abs(rows - w[[3, 7]]) <= packed["s"][[3, 7], None] / 2 + 1e-6)


def dequantized(source: ArraySource, names: set[str], quantize) -> ArraySource:
    """The same checkpoint with the chosen tensors replaced by their dequantized values."""
    out = ArraySource.__new__(ArraySource)
    out.config, out.tensors = {}, dict(source.tensors)
    for name in names:
        q = quantize(source.tensors[name])
        values = q["q"] if "q" in q else np.stack([(q["q4"] & 0xF), (q["q4"] >> 4)], -1).reshape(len(q["s"]), -1)
        values = values.astype(np.float32) - (8 if "q4" in q else 0)
        out.tensors[name] = values * q["s"][:, None]
    return out


def test_int8_matrices_compute_exactly_what_their_dequantized_weights_compute():
    """Random tiny models amplify any weight change, so the check is exactness of the int8 path against
    the same weights dequantized; the quality of quantization itself is benchmarked on the real model."""
    cfg = model_config("gemma4")
    source = ArraySource(cfg)
    ids = np.random.default_rng(3).integers(3, cfg.vocab_size, size=(1, 30))
    matrices = {n for n, t in source.tensors.items() if t.ndim == 2 and n != "embed_tokens_per_layer.weight"}
    expected = logits_for(cfg, load_params(dequantized(source, matrices, quantize_rows_int8), cfg), ids)
    quantized = load_params(source, cfg, WeightPolicy(int8_matrices=True))
    assert quantized["layers"][0]["q_proj"]["q"].dtype == jnp.int8
    assert quantized["embed"]["q"].dtype == jnp.int8
    np.testing.assert_allclose(logits_for(cfg, quantized, ids), expected, atol=1e-4, rtol=0)


def test_int4_ple_table_computes_exactly_what_its_dequantized_table_computes():
    cfg = model_config("gemma4")
    source = ArraySource(cfg)
    ids = np.random.default_rng(4).integers(3, cfg.vocab_size, size=(1, 30))
    table = {"embed_tokens_per_layer.weight"}
    expected = logits_for(cfg, load_params(dequantized(source, table, quantize_rows_int4), cfg), ids)
    quantized = load_params(source, cfg, WeightPolicy(int4_ple=True))
    assert quantized["embed_per_layer"]["q4"].dtype == jnp.uint8
    np.testing.assert_allclose(logits_for(cfg, quantized, ids), expected, atol=1e-4, rtol=0)


def test_int4_ple_of_a_loaded_tree_equals_loading_with_the_policy():
    """to_int4_ple converts the table a few rows at a time; the result must be what load_params places."""
    cfg = model_config("gemma4")
    source = ArraySource(cfg)
    converted = to_int4_ple(load_params(source, cfg), rows_per_pass=7)  # a pass size that leaves a remainder
    loaded = load_params(source, cfg, WeightPolicy(int4_ple=True))
    for key in ("q4", "s"):
        np.testing.assert_array_equal(np.asarray(converted["embed_per_layer"][key]),
                                      np.asarray(loaded["embed_per_layer"][key]))
    gemma3 = load_params(ArraySource(model_config("gemma3")), model_config("gemma3"))
    assert to_int4_ple(gemma3) is gemma3  # no per-layer table: nothing to convert


def test_serving_loads_the_int4_table_when_the_config_asks(tiny_checkpoints):
    """`model.per_layer_embeddings: int4` reaches `load_model`, which places Gemma 4's table as packed int4 (the
    same arrays as `WeightPolicy(int4_ple=True)`); a Gemma 3 checkpoint has no such table and loads as before."""
    from core.runtime import load_model
    from server.config import load_config

    assert load_config().runtime_options().int4_ple is False
    assert load_config(overrides={"model.per_layer_embeddings": "int4"}).runtime_options().int4_ple is True
    directory, _ = tiny_checkpoints["gemma4"]
    packed = load_model(directory, dtype="float32", int4_ple=True).params["embed_per_layer"]
    plain = load_model(directory, dtype="float32").params["embed_per_layer"]
    assert set(packed) == {"q4", "s"} and packed["q4"].dtype == jnp.uint8
    want = quantize_rows_int4(np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(packed["q4"]), want["q4"])
    gemma3, _ = tiny_checkpoints["gemma3"]
    assert "embed_per_layer" not in load_model(gemma3, dtype="float32", int4_ple=True).params
