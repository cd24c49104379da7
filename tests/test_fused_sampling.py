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
from scheduler.request import FinishReason
from scheduler_helpers import VOCAB, ids, make, request, token_logprobs
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


def mixed_requests():
    """More requests than slots (admissions mid-flight), streams of different lengths (a queued step meets
    ended streams), both sampler variants, a greedy stream and one asking for logprobs."""
    samplings = [replace(PLAIN if i % 2 else FULL, seed=11 + i) for i in range(6)]
    samplings[4] = SamplingParams(temperature=0)
    samplings[3] = replace(samplings[3], logprobs=3)
    return [request(ids(i, 9 + 4 * i), max_tokens=7 + 3 * (i % 3), sampling=samplings[i], want_logprobs=i == 3)
            for i in range(6)]


def outputs(sched, reqs):
    """Each request's (token id, logprob) pairs and finish reason."""
    handles = [sched.submit(r) for r in reqs]
    sched.run_until_idle()
    return [(pairs, end.reason) for pairs, end in map(token_logprobs, handles)]


def test_the_scheduler_samples_inside_the_decode_program_with_the_same_outputs(real_vocab_pair, tokenizer,
                                                                               monkeypatch):
    """Outputs equal the two-program engine's with and without the next step queued before the last one's
    tokens are read (`SchedulerConfig.overlap_steps`), and the queued steps happen."""
    plain, fused = real_vocab_pair
    for engine in real_vocab_pair:
        engine.warmup()
    assert fused.fused_ready(np.zeros(4, np.int32), True) and fused.fused_ready(np.full(4, 50), False)
    expected = outputs(make(plain, tokenizer), mixed_requests())
    calls = {"decode": 0}
    original = fused.decode

    def counted(*args, **kw):
        calls["decode"] += 1
        return original(*args, **kw)

    monkeypatch.setattr(fused, "decode", counted)
    serial = make(fused, tokenizer, overlap_steps=False)
    assert outputs(serial, mixed_requests()) == expected and serial.stats.overlapped_steps == 0
    overlapped = make(fused, tokenizer)
    assert outputs(overlapped, mixed_requests()) == expected
    assert calls["decode"] == 0  # every decode step sampled inside the fused program
    assert overlapped.stats.overlapped_steps > 0
    assert overlapped.stats.decode_steps < serial.stats.decode_steps + overlapped.stats.overlapped_steps


def test_a_stream_cancelled_under_a_queued_step_ends_and_the_others_are_unchanged(real_vocab_pair, tokenizer):
    plain, fused = real_vocab_pair
    reqs = [request(ids(20 + i, 12), max_tokens=12, sampling=replace(PLAIN, seed=40 + i)) for i in range(3)]
    expected = outputs(make(plain, tokenizer), reqs)
    sched = make(fused, tokenizer)
    handles = [sched.submit(r) for r in reqs]
    while sched._follow_on is None:  # a step is queued behind the one whose tokens were just read
        sched.step()
    handles[1].cancel()
    sched.run_until_idle()
    got = [token_logprobs(handle) for handle in handles]
    assert got[1][1].reason is FinishReason.CANCELLED and len(got[1][0]) < 12
    assert [(pairs, end.reason) for pairs, end in (got[0], got[2])] == [expected[0], expected[2]]
    assert sched.running == 0 and all(slot.sequence is None for slot in sched.slots)


def test_a_queued_step_needs_the_step_it_follows(real_vocab_pair):
    from core.engine import FOLLOWING

    fused = real_vocab_pair[1]
    tokens = np.array([FOLLOWING, 5, 5, 5], np.int32)
    with pytest.raises(ValueError, match="previous step"):
        fused.dispatch_decode_sample(tokens, np.zeros(4, np.int32), np.ones(4, bool), np.zeros(4, np.int32))
