"""Sampling inside the decode program (`EngineConfig.fused_sampling`, an option, off by default): the
fused step gives the tokens, logprobs, top logprobs, sampler state and KV of a decode call followed by a sample
call, bit for bit, in both sampler variants and with idle slots; the scheduler takes it for steps with no
constrained row, and its outputs equal those of an engine without it."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest

from core.engine import Engine, EngineConfig
from core.sampling import SamplingParams
from core.weights import random_params
from scheduler_helpers import VOCAB, ids, make, request, run_all
from tiny_models import model_config

SLOTS = 3
# needs_full=False serves plain temperature sampling; the full variant penalties and truncation.
PLAIN = SamplingParams(temperature=0.8)
FULL = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.4)


def engine_pair(cfg, params, **config):
    """(unfused, fused) engines over the same weights."""
    made = []
    for fused in (False, True):
        made.append(Engine(cfg, params, EngineConfig(fused_sampling=fused, **config), "float32"))
    return made


@pytest.fixture(scope="module", params=("gemma3", "gemma4"))
def tiny_pair(request, compile_cache):
    cfg = model_config(request.param)
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=7)
    return engine_pair(cfg, params, num_slots=SLOTS, max_len=64, chunk_sizes=(8,), attention_buckets=(32,),
                       verify_width=0)


def same_tree(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True))


@pytest.mark.parametrize("sampling", (PLAIN, FULL), ids=("plain", "full"))
def test_the_fused_step_equals_decode_then_sample_bit_for_bit(tiny_pair, sampling):
    plain, fused = tiny_pair
    needs_full = sampling is FULL
    assert not plain.fused_ready(np.zeros(SLOTS, np.int32), needs_full)  # no such program without the option
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 500, size=n) for n in (5, 11, 3)]
    tokens = np.zeros(SLOTS, np.int32)
    for engine in (plain, fused):
        for slot, prompt in enumerate(prompts):
            engine.prefill(slot, prompt, 0)
            engine.begin_request(slot, sampling, list(prompt), seed=100 + slot)
    positions = np.array([len(p) for p in prompts], np.int32)
    steps = np.zeros(SLOTS, np.int32)
    for i in range(40):  # crosses the 32-position bucket: both programs per path
        active = np.array([True, i % 3 != 0, i < 20])  # slots idle now and then, one for good
        at = np.where(active, positions, 0).astype(np.int32)
        expected = plain.sample(plain.decode(tokens, at, active), active, steps, needs_full=needs_full)
        got = fused.decode_sample(tokens, at, active, steps, needs_full)
        for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
            assert np.array_equal(getattr(expected, name), getattr(got, name)), (i, name)
        tokens = np.where(active, expected.tokens, tokens).astype(np.int32)
        positions += active
        steps += active
    assert same_tree(plain.sampler, fused.sampler)
    assert same_tree(plain.cache, fused.cache)


@pytest.fixture(scope="module")
def real_vocab_pair(compile_cache):
    from core.config import ModelConfig
    from tiny_models import GEMMA3

    cfg = ModelConfig.from_hf_dict({**GEMMA3, "vocab_size": VOCAB})
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=5)
    return engine_pair(cfg, params, num_slots=4, max_len=96, chunk_sizes=(4, 16), attention_buckets=(32,))


def test_the_scheduler_samples_inside_the_decode_program_with_the_same_outputs(real_vocab_pair, tokenizer,
                                                                               monkeypatch):
    plain, fused = real_vocab_pair
    for engine in real_vocab_pair:
        engine.warmup()
    assert fused.fused_ready(np.zeros(4, np.int32), True) and fused.fused_ready(np.full(4, 50), False)

    def reqs():
        return [request(ids(i, 9 + 4 * i), max_tokens=10, sampling=replace(PLAIN if i % 2 else FULL, seed=11 + i))
                for i in range(6)]  # more requests than slots: admissions mid-flight

    expected = [result[0] for result in run_all(make(plain, tokenizer), reqs())]
    calls = {"decode": 0}
    original = fused.decode

    def counted(*args, **kw):
        calls["decode"] += 1
        return original(*args, **kw)

    monkeypatch.setattr(fused, "decode", counted)
    got = [result[0] for result in run_all(make(fused, tokenizer), reqs())]
    assert got == expected
    assert calls["decode"] == 0  # every decode step sampled inside the fused program
