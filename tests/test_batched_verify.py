"""Batched speculative verification is exact on the host running the suite: each row of a [slots, width]
verify pass gives the logits, bit for bit, of the decode step it stands for (the same tokens fed one step at
a time with every slot active), for both tiny families and the default model, W8A8 weights and int8 KV (where
the engine compiles the pass: `Engine.rows_verify_exact`). Greedy tokens agreeing is not enough: a last-bit
difference flips a near tie only now and then, so this compares the logits themselves, at every row, past
the sliding window, over several rounds. If this fails on a host, batched speculation (on by default) would
change outputs there: that host's class is news for docs/design-notes.md."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.engine import ROWS_VERIFY_WIDTH, Engine, EngineConfig
from core.model import decode_step, verify_chunk
from core.weights import random_params, to_w8a8
from tiny_models import WINDOW, model_config

ROUNDS = 4


def copied(tree):
    return jax.tree_util.tree_map(jnp.copy, tree)


def verify_against_decode(engine: Engine, prompts: list[np.ndarray], rng: np.random.Generator) -> int:
    """Prefill each slot with its prompt, then ROUNDS times: one verify pass over [slots, width] tokens (each
    slot its own number of valid ones) against that many decode steps on a copy of the same cache. Asserts
    every valid row equal; returns how many rows were compared."""
    assert engine.rows_verify_exact
    cfg, slots, width = engine.cfg, engine.num_slots, engine.config.rows_verify_width
    view_width = max(engine.config.verify_tokens, width, 1)  # as the engine's programs are built
    for slot, prompt in enumerate(prompts):
        engine.prefill(slot, prompt, 0)
    starts = np.array([len(p) for p in prompts], np.int32)
    adapters = jnp.asarray(engine.slot_adapters)  # each slot's LoRA adapter slot (engines with adapter slots)
    verify = {}
    compared = 0
    for round_ in range(ROUNDS):
        tokens = rng.integers(3, cfg.vocab_size, size=(slots, width)).astype(np.int32)
        n_valid = np.array([1 + (round_ + s) % width for s in range(slots)], np.int32)
        attend = engine.bucket_for(starts + n_valid - 1)
        if attend not in verify:
            verify[attend] = jax.jit(partial(verify_chunk, cfg=cfg, attend=attend, view_width=view_width))
        rows, _ = verify[attend](engine.params, copied(engine.cache), tokens, starts, n_valid, None,
                                 adapters=adapters)
        rows = np.asarray(rows)
        cache = engine.cache
        for j in range(width):
            step = starts + np.minimum(j, n_valid - 1)  # a slot out of drafts repeats its last row
            at = engine.bucket_for(step)
            logits, cache = jax.jit(partial(decode_step, cfg=cfg, attend=at, view_width=view_width))(
                engine.params, cache, tokens[np.arange(slots), np.minimum(j, n_valid - 1)], step,
                jnp.ones(slots, bool), adapters=adapters)
            logits = np.asarray(logits)
            for s in np.flatnonzero(j < n_valid):
                diff = np.abs(rows[s, j] - logits[s]).max()
                assert np.array_equal(rows[s, j], logits[s]), f"round {round_}, slot {s}, row {j}: max |diff| {diff}"
                compared += 1
        engine.cache = cache
        starts = starts + n_valid
    return compared


def exact_engine(cfg, params, slots: int, max_len: int, chunks: tuple[int, ...], adapter_slots: int = 0) -> Engine:
    config = EngineConfig(num_slots=slots, max_len=max_len, chunk_sizes=chunks, kv_dtype="int8",
                          attention_buckets=(), verify_width=0, rows_verify_width=ROWS_VERIFY_WIDTH,
                          adapter_slots=adapter_slots, adapter_rank=8)
    return Engine(cfg, to_w8a8(params), config, "float32")


@pytest.mark.parametrize("family", ("gemma3", "gemma4"))
def test_batched_verify_rows_equal_decode_rows_bit_for_bit_on_tiny_models(family, compile_cache):
    cfg = model_config(family)
    engine = exact_engine(cfg, random_params(cfg, std=0.1, norm_std=0.1, seed=13), slots=3, max_len=96,
                          chunks=(4, 8, 16))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg.vocab_size, size=n) for n in (WINDOW + 3, 2, 2 * WINDOW + 1)]
    assert verify_against_decode(engine, prompts, rng) >= 3 * ROUNDS


@pytest.mark.parametrize("family", ("gemma3", "gemma4"))
def test_batched_verify_rows_equal_decode_rows_under_lora_adapters(family, compile_cache):
    """Slots under two different adapters and one under none: each slot's float adapter products are one
    `linear` pair over the call's rows in a decode step and a verify pass alike (`core.model.lora_delta`),
    whose rows do not depend on the row count, so verify rows stay exact."""
    from test_lora_engine import mix_adapters

    cfg = model_config(family)
    engine = exact_engine(cfg, random_params(cfg, std=0.1, norm_std=0.1, seed=13), slots=3, max_len=96,
                          chunks=(4, 8, 16), adapter_slots=2)
    mix_adapters(engine, cfg)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, cfg.vocab_size, size=n) for n in (WINDOW + 3, 2, 2 * WINDOW + 1)]
    assert verify_against_decode(engine, prompts, rng) >= 3 * ROUNDS


@pytest.mark.slow
def test_batched_verify_rows_equal_decode_rows_bit_for_bit_on_the_default_model(real_model):
    from core.quality import reference_tokens

    engine = exact_engine(real_model.cfg, real_model.params, slots=8, max_len=1024, chunks=(32, 128))
    text = np.asarray(reference_tokens(real_model.tokenizer, 900))
    # Eight prompts of different lengths, some past the 512-token sliding window.
    prompts = [text[i * 7:i * 7 + n] for i, n in enumerate((5, 40, 130, 260, 513, 600, 700, 820))]
    rng = np.random.default_rng(17)
    assert verify_against_decode(engine, prompts, rng) >= 8 * ROUNDS


@pytest.mark.slow
def test_verify_passes_draw_the_plain_sampled_tokens_on_the_default_model(real_model):
    """Sampled requests speculate (`scheduler.speculation.speculation_allowed`): on the default model, W8A8
    and int8 KV, batched verify passes that draw each position at its own step give exactly the tokens plain
    decode steps sample (temperature alone, with llama.cpp's top-k/top-p/min-p, with a logit bias, greedy)."""
    from test_engine import check_sampled_verify

    from core.quality import reference_tokens

    engines = [exact_engine(real_model.cfg, real_model.params, slots=8, max_len=1024, chunks=(32, 128))
               for _ in range(2)]
    text = np.asarray(reference_tokens(real_model.tokenizer, 900))
    prompts = [text[i * 11:i * 11 + n] for i, n in enumerate((40, 300, 530, 9))]
    check_sampled_verify(*engines, prompts, 40, np.random.default_rng(19))
