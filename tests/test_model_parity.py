"""Our JAX Gemma 3 / Gemma 4 against transformers on tiny random checkpoints loaded through our loader."""

from __future__ import annotations

import copy
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.config import ModelConfig
from core.engine import Engine, EngineConfig
from core.kv_cache import CacheSpec, init_cache
from core.loaders import open_checkpoint
from core.model import sequence_logits
from core.weights import load_params
from tiny_models import WINDOW

pytestmark = pytest.mark.slow
FAMILIES = ("gemma3", "gemma4")


def load_ours(directory):
    source = open_checkpoint(directory)
    cfg = ModelConfig.from_hf_dict(source.config)
    return cfg, load_params(source, cfg)


def full_logits(cfg, params, ids: np.ndarray) -> np.ndarray:
    b, t = ids.shape
    cache = init_cache(cfg, CacheSpec(num_slots=b, max_len=t))
    fn = jax.jit(partial(sequence_logits, cfg=cfg))
    logits, _ = fn(params, cache, jnp.asarray(ids, jnp.int32), jnp.zeros(b, jnp.int32),
                   jnp.full(b, t, jnp.int32), jnp.arange(b, dtype=jnp.int32))
    return np.asarray(logits)


def test_gemma4_checkpoint_has_e2b_structure_in_miniature(tiny_checkpoints):
    cfg, _ = load_ours(tiny_checkpoints["gemma4"][0])
    shared = [layer for layer in cfg.layers if not layer.owns_cache]
    assert {layer.kind for layer in shared} == {"sliding_attention", "full_attention"}
    assert len({layer.head_dim for layer in cfg.layers}) == 2
    assert cfg.ple_dim > 0
    assert {layer.mlp_dim for layer in shared} == {2 * cfg.layers[0].mlp_dim}
    assert cfg.sliding_window == WINDOW


@pytest.mark.parametrize("family", FAMILIES)
def test_full_forward_logits_match_transformers(tiny_checkpoints, family):
    import torch

    directory, hf_model = tiny_checkpoints[family]
    cfg, params = load_ours(directory)
    ids = np.random.default_rng(7).integers(3, cfg.vocab_size, size=(2, 5 * WINDOW - 3))
    with torch.no_grad():
        expected = hf_model(torch.tensor(ids)).logits.numpy()
        exact = copy.deepcopy(hf_model).double()(torch.tensor(ids)).logits.numpy()
    got = full_logits(cfg, params, ids)
    assert got.shape == expected.shape
    # Against transformers in float64: within 1e-4, or within 8x the error transformers' own float32 forward
    # makes here, whichever is larger. XLA's CPU kernels round differently by instruction set (on an AVX2 EPYC
    # one logit of 37,888 lands 2.6e-4 off, the same before and after the full-length sliding caches, with
    # transformers' float32 at 4e-5); a wrong formula is off by O(0.1).
    noise = float(np.abs(expected - exact).max())
    np.testing.assert_allclose(got, exact, atol=max(1e-4, 8 * noise), rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_continuation_matches_transformers_generate(tiny_checkpoints, family):
    import torch

    directory, hf_model = tiny_checkpoints[family]
    cfg, params = load_ours(directory)
    prompt = np.random.default_rng(11).integers(3, cfg.vocab_size, size=2 * WINDOW + 3)
    new_tokens = 48
    with torch.no_grad():
        out = hf_model.generate(torch.tensor(prompt[None]), max_new_tokens=new_tokens, do_sample=False,
                                min_new_tokens=new_tokens, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()

    engine = Engine(cfg, params, EngineConfig(num_slots=2, max_len=128, chunk_sizes=(4, 16)), "float32")
    slot = 1
    logits = engine.prefill(slot, prompt, 0)
    got = [int(np.argmax(np.asarray(logits)))]
    tokens, positions, active = (np.zeros(2, np.int32) for _ in range(3))
    active[slot] = 1
    while len(got) < new_tokens:
        tokens[slot], positions[slot] = got[-1], len(prompt) + len(got) - 1
        got.append(int(np.argmax(np.asarray(engine.decode(tokens, positions, active.astype(bool)))[slot])))
    assert got == expected
