"""Stacked program parameters (`core.param_stack`, `EngineConfig.stack_params`, on for accelerators): the
engine's steps take one array per shape and dtype instead of one per tensor, and compute the same bits as an
engine holding the tree: prefill, the fused decode + sample step, verify, under LoRA adapters loaded into the
stacked slots; the KV identity does not depend on the form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_lora_engine import random_adapter, tiny

from core.engine import NO_ADAPTER, Engine, EngineConfig
from core.param_stack import ParamStack
from core.sampling import SamplingParams
from core.weights import random_params

SLOTS = 3


def test_leaves_of_one_shape_share_an_array_and_come_back_unchanged():
    tree = {"layers": [{"w": jnp.full((2, 3), i, jnp.float32), "n": jnp.full((3,), -i, jnp.float32)}
                       for i in range(4)], "embed": jnp.arange(12.0).reshape(4, 3), "bias": jnp.ones(3, jnp.int32)}
    stack = ParamStack(tree)
    stacked = stack.stack(tree)
    # [2, 3] x4, [3] float x4, the embedding alone (kept as it was, not copied), [3] int32 alone
    assert sorted(a.shape for a in stacked) == [(3,), (4, 2, 3), (4, 3), (4, 3)]
    assert any(a is tree["embed"] for a in stacked)
    back = stack.unstack(stacked)
    for x, y in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(back), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    # A replacement restacks only the groups holding what it touched, and sees the rest as shapes only.
    def bump(t):
        assert isinstance(t["embed"], jax.ShapeDtypeStruct)
        return {**t, "layers": [{**lp, "n": lp["n"] + 1} for lp in t["layers"]]}

    bumped = stack.replace(stacked, bump, touched=lambda path: path.endswith("['n']"))
    assert [a is b for a, b in zip(stacked, bumped, strict=True)].count(False) == 1
    assert np.array_equal(stack.unstack(bumped)["layers"][2]["n"], np.full(3, -1.0))
    with pytest.raises(ValueError, match="structure"):
        stack.stack({"other": tree["embed"]})


@pytest.fixture(scope="module")
def engines(compile_cache):
    """(tree, stacked) engines over tiny Gemma 4 weights (layers of two head sizes, KV-shared layers), with two
    adapter slots and the fused sampler."""
    cfg = tiny("gemma4")
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=11)
    config = dict(num_slots=SLOTS, max_len=32, chunk_sizes=(8,), attention_buckets=(), verify_width=4,
                  fused_sampling=True, adapter_slots=2, adapter_rank=4)
    made = [Engine(cfg, params, EngineConfig(**config, stack_params=stacked), "float32") for stacked in (False, True)]
    return cfg, made


def test_a_stacked_engine_computes_what_the_tree_engine_computes(engines):
    cfg, (tree, stacked) = engines
    assert len(jax.tree_util.tree_leaves(stacked.params)) < len(jax.tree_util.tree_leaves(tree.params)) / 4
    assert stacked.kv_identity() == tree.kv_identity()
    assert stacked.adapter_bytes_per_slot == tree.adapter_bytes_per_slot
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 500, size=n) for n in (5, 9, 3)]
    sampling = SamplingParams(temperature=0.8)
    results = []
    for engine in (tree, stacked):
        engine.load_adapter(0, random_adapter(cfg, 4, seed=1))
        engine.load_adapter(1, random_adapter(cfg, 2, seed=2))
        out = []
        for slot, (prompt, adapter) in enumerate(zip(prompts, (1, NO_ADAPTER, 0), strict=True)):
            engine.use_adapter(slot, adapter)
            out.append(np.asarray(engine.prefill(slot, prompt, 0)))
            engine.begin_request(slot, sampling, list(prompt), seed=slot)
        tokens, positions = np.ones(SLOTS, np.int32), np.array([len(p) for p in prompts], np.int32)
        active, steps = np.ones(SLOTS, bool), np.zeros(SLOTS, np.int32)
        for _ in range(4):
            sampled = engine.decode_sample(tokens, positions, active, steps, needs_full=False)
            out += [sampled.tokens, sampled.logprobs]
            tokens, positions, steps = sampled.tokens, positions + 1, steps + 1
        out.append(np.asarray(engine.verify(0, [int(t) for t in prompts[0][:3]], len(prompts[0]) + 4)))
        engine.load_adapter(1, None)  # unloading writes zeros into the stacked slot
        out.append(np.asarray(engine.prefill(0, prompts[0], 0)))
        results.append(out)
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        assert np.array_equal(a, b), i
