"""A decode step that carries another slot's prompt chunk (`Engine.decode_with_chunk`) gives, bit for bit, what
the decode step and the prefill chunk give as two calls: every decode row's logits, the chunk's last logits and
the whole KV cache, on both tiny families (with and without LoRA adapters) and the default model, W8A8 weights
and int8 KV (where the engine builds the program). Then the scheduler: chat turns that arrive while streams
decode ride along with decode steps instead of calls of their own, and every output equals its cold run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.engine import Engine, EngineConfig
from core.weights import random_params, to_w8a8
from scheduler_helpers import VOCAB, cold, ids, make, request
from tiny_models import WINDOW, model_config

ROUNDS = 4


def copied(tree):
    return jax.tree_util.tree_map(jnp.copy, tree)


def carrying_engine(cfg, params, slots: int, max_len: int, chunks: tuple[int, ...], adapter_slots: int = 0,
                    quantized: bool = True, carries: tuple[int, ...] = (4, 8)) -> Engine:
    config = EngineConfig(num_slots=slots, max_len=max_len, chunk_sizes=chunks, kv_dtype="int8" if quantized else None,
                          verify_width=0, chunk_in_decode=True, carry_sizes=carries, adapter_slots=adapter_slots,
                          adapter_rank=8)
    return Engine(cfg, to_w8a8(params) if quantized else params, config, "float32")


def carried_against_separate(engine: Engine, prompts: list[np.ndarray], rng: np.random.Generator) -> int:
    """Slots 0..S-2 hold their prompts and decode; the last slot holds its prompt and prefills a chunk of
    1..(the largest carry size) tokens each round, padded to each carry size in some round. Each round runs both
    ways on copies of one cache and asserts equal decode rows, chunk logits and caches. Returns the rounds
    compared."""
    assert engine.chunk_in_decode
    slots, widest = engine.num_slots, engine.carry_sizes[-1]
    lengths = [1 + (23 * round_) % widest for round_ in range(ROUNDS)]
    assert {engine.carry_width(n) for n in lengths} == set(engine.carry_sizes)
    for slot, prompt in enumerate(prompts):
        engine.prefill(slot, prompt, 0)
    positions = np.array([len(p) for p in prompts], np.int32)
    carried = slots - 1
    active = np.arange(slots) != carried
    for round_ in range(ROUNDS):
        tokens = rng.integers(3, engine.cfg.vocab_size, size=slots).astype(np.int32)
        chunk = rng.integers(3, engine.cfg.vocab_size, size=lengths[round_]).astype(np.int32)
        start = int(positions[carried])
        before = engine.cache
        engine.cache = copied(before)
        logits, chunk_logits = engine.decode_with_chunk(tokens, positions, active, carried, chunk, start)
        together = engine.cache
        engine.cache = copied(before)
        alone = engine.decode(tokens, positions, active)
        chunk_alone = engine.prefill_chunk(carried, chunk, start)
        for s in np.flatnonzero(active):
            assert np.array_equal(np.asarray(logits[s]), np.asarray(alone[s])), f"round {round_}, slot {s}"
        assert np.array_equal(np.asarray(chunk_logits), np.asarray(chunk_alone)), f"round {round_}: chunk"
        for a, b in zip(jax.tree_util.tree_leaves(together), jax.tree_util.tree_leaves(engine.cache), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)), f"round {round_}: cache"
        positions = positions + active
        positions[carried] += len(chunk)
    return ROUNDS


@pytest.mark.parametrize("family", ("gemma3", "gemma4"))
def test_a_carried_chunk_and_the_decode_rows_keep_their_bits_on_tiny_models(family, compile_cache):
    cfg = model_config(family)
    engine = carrying_engine(cfg, random_params(cfg, std=0.1, norm_std=0.1, seed=13), slots=3, max_len=96,
                             chunks=(4, 8, 16))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg.vocab_size, size=n) for n in (WINDOW + 3, 2, 2 * WINDOW - 4)]
    assert carried_against_separate(engine, prompts, rng) == ROUNDS


def test_a_carry_whose_padding_runs_past_the_end_of_its_slot_keeps_its_bits(compile_cache):
    """The carried slot's chunks (1, 8, 7 and 6 tokens) end at the slot's last position, the last one padded to
    8 rows, two past it: decode rows, chunk logits and the whole cache still equal the separate calls'."""
    cfg = model_config("gemma3")
    engine = carrying_engine(cfg, random_params(cfg, std=0.1, norm_std=0.1, seed=13), slots=3, max_len=96,
                             chunks=(4, 8, 16))
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, cfg.vocab_size, size=n) for n in (WINDOW + 3, 2, 96 - (1 + 8 + 7 + 6))]
    assert carried_against_separate(engine, prompts, rng) == ROUNDS


@pytest.mark.parametrize("family", ("gemma3", "gemma4"))
def test_a_carried_chunk_keeps_its_bits_under_lora_adapters(family, compile_cache):
    """Decode rows under two adapters and the carried chunk under a third slot's adapter: each group's adapter
    products keep the shapes of its own call."""
    from test_lora_engine import mix_adapters

    cfg = model_config(family)
    engine = carrying_engine(cfg, random_params(cfg, std=0.1, norm_std=0.1, seed=13), slots=3, max_len=96,
                             chunks=(4, 8, 16), adapter_slots=2)
    mix_adapters(engine, cfg)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, cfg.vocab_size, size=n) for n in (WINDOW + 3, 2, 2 * WINDOW - 4)]
    assert carried_against_separate(engine, prompts, rng) == ROUNDS


def test_no_carrying_program_where_products_are_not_exact_and_bad_calls_are_refused(compile_cache):
    cfg = model_config("gemma3")
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=13)
    float_engine = carrying_engine(cfg, params, slots=3, max_len=64, chunks=(4, 8), quantized=False)
    assert not float_engine.chunk_in_decode
    assert not any(key[0] == "decode_chunk" for key in float_engine.programs)
    engine = carrying_engine(cfg, params, slots=3, max_len=64, chunks=(4, 8))
    tokens, positions = np.ones(3, np.int32), np.zeros(3, np.int32)
    with pytest.raises(ValueError, match="not decoding"):  # the carried slot also decodes
        engine.decode_with_chunk(tokens, positions, np.ones(3, bool), 2, np.ones(3, np.int32), 0)
    with pytest.raises(ValueError, match="not decoding"):  # longer than the largest carry size
        engine.decode_with_chunk(tokens, positions, np.array([1, 1, 0], bool), 2, np.ones(9, np.int32), 0)
    with pytest.raises(ValueError, match="no carrying program"):
        float_engine.decode_with_chunk(tokens, positions, np.array([1, 1, 0], bool), 2, np.ones(3, np.int32), 0)
    with pytest.raises(ValueError, match="exceed"):
        engine.decode_with_chunk(tokens, positions, np.array([1, 1, 0], bool), 2, np.ones(4, np.int32), 62)


@pytest.mark.slow
def test_a_carried_chunk_and_the_decode_rows_keep_their_bits_on_the_default_model(real_model):
    from core.quality import reference_tokens

    engine = carrying_engine(real_model.cfg, real_model.params, slots=8, max_len=1024, chunks=(32, 128),
                             carries=EngineConfig.carry_sizes)
    text = np.asarray(reference_tokens(real_model.tokenizer, 900))
    # Seven decoding prompts of different lengths, some past the 512-token sliding window; the carried slot's
    # chunks cross the window too.
    prompts = [text[i * 7:i * 7 + n] for i, n in enumerate((5, 40, 130, 260, 513, 600, 700, 490))]
    assert carried_against_separate(engine, prompts, np.random.default_rng(17)) == ROUNDS


@pytest.fixture(scope="module")
def engine(compile_cache):
    from core.config import ModelConfig
    from tiny_models import GEMMA3

    cfg = ModelConfig.from_hf_dict({**GEMMA3, "vocab_size": VOCAB})
    eng = carrying_engine(cfg, random_params(cfg, std=0.1, norm_std=0.1, seed=5), slots=8, max_len=160,
                          chunks=(4, 16))
    eng.warmup()
    return eng


def turns_while_streams_decode(engine, tokenizer, monkeypatch) -> int:
    """Two streams decode; then two short prompts (10 and 7 tokens) arrive together. Asserts that they never
    get a prefill call of their own and that every output equals the request run alone with caching off;
    returns how many chunks decode steps carried for them."""
    long = [request(ids(1, 20), max_tokens=24), request(ids(2, 23), max_tokens=24)]
    short = [request(ids(3, 10), max_tokens=5), request(ids(4, 7), max_tokens=5)]
    sched = make(engine, tokenizer, prefix_caching=False)
    handles = [sched.submit(r) for r in long]
    while sched.planner.prefilling or sched.stats.decode_steps < 2:
        sched.step()
    separate = []
    original = engine.prefill_chunk
    monkeypatch.setattr(engine, "prefill_chunk", lambda *a, **kw: separate.append(a) or original(*a, **kw))
    carried = sched.stats.carried_chunks  # the second long prompt's tail rode along with the first's steps
    handles += [sched.submit(r) for r in short]
    sched.run_until_idle()
    assert separate == []
    for handle, req in zip(handles, long + short, strict=True):
        assert handle.result(timeout=0)[0] == cold(engine, tokenizer, req)
    return sched.stats.carried_chunks - carried


def test_turns_arriving_while_streams_decode_ride_along_and_match_their_cold_runs(engine, tokenizer, monkeypatch):
    """Each short prompt rides along with decode steps, up to the largest carry size (8) per step (the second
    waits for the first: first come, first served): 10 tokens as 8 + 2 (padded to 4), 7 in one 8-row carry."""
    assert engine.carry_sizes == (4, 8)
    assert turns_while_streams_decode(engine, tokenizer, monkeypatch) == 2 + 1


def test_a_carry_narrower_than_the_covering_one_serves_until_that_program_is_loaded(engine, tokenizer, monkeypatch):
    """A restarted server loads the wider carry programs after ready: until then chunks ride in the narrower
    ones (4 rows: 10 tokens in 3 carries, 7 in 2), and the outputs stay those of the cold runs."""
    loaded = engine.compiled_for
    monkeypatch.setattr(engine, "compiled_for", lambda kind, positions, width=None: width != 8
                        and loaded(kind, positions, width))
    assert turns_while_streams_decode(engine, tokenizer, monkeypatch) == 3 + 2


def carries_before_each_long_chunk(engine, tokenizer, monkeypatch, shorts: list[tuple[int, ...]], long_prompt):
    """Two streams decode; then the short prompts and a long one arrive together. Asserts that every request's
    tokens equal its cold run; returns, for each call of the long prompt's own prefill chunks, how many chunks
    decode steps had carried since the arrival."""
    streams = [request(ids(1, 20), max_tokens=40), request(ids(2, 23), max_tokens=40)]
    later = [request(prompt, max_tokens=5) for prompt in shorts] + [request(long_prompt, max_tokens=5)]
    sched = make(engine, tokenizer, prefix_caching=False)
    handles = [sched.submit(r) for r in streams]
    while sched.planner.prefilling or sched.stats.decode_steps < 2:
        sched.step()
    base = sched.stats.carried_chunks
    long_slot = []
    calls = []
    original = engine.prefill_chunk

    def spy(slot, tokens, start):
        if long_slot and slot == long_slot[0]:
            calls.append(sched.stats.carried_chunks - base)
        return original(slot, tokens, start)

    monkeypatch.setattr(engine, "prefill_chunk", spy)
    handles += [sched.submit(r) for r in later]
    sched.step()  # admits them all; the long prompt's slot is known from here
    long_slot.append(next(seq.slot for seq in sched.planner.prefilling if len(seq.prompt) == len(long_prompt)))
    sched.run_until_idle()
    for handle, req in zip(handles, streams + later, strict=True):
        assert handle.result(timeout=0)[0] == cold(engine, tokenizer, req)
    return calls


def test_a_long_prompt_waits_while_a_short_turn_rides_along(engine, tokenizer, monkeypatch):
    """A short turn (10 tokens: 2 carries) and a long prompt (40 tokens) arrive while streams decode: the long
    prompt's first chunk runs only after the short turn's last carry, not in the same iterations (where it
    would hold back the turn's first token and every stream's next), and every output equals its cold run."""
    from scheduler.planner import MAX_DEFERRED_LONG

    assert MAX_DEFERRED_LONG >= 2
    calls = carries_before_each_long_chunk(engine, tokenizer, monkeypatch, [ids(3, 10)], ids(5, 40))
    assert calls and calls[0] == 2


def test_short_turns_defer_a_long_prompt_a_bounded_number_of_iterations(engine, tokenizer, monkeypatch):
    """Three short turns (6 carries in all, one per step) and a long prompt: the long prompt waits at most
    MAX_DEFERRED_LONG carry steps in a row, then gets a chunk beside the next carry."""
    from scheduler.planner import MAX_DEFERRED_LONG

    shorts = [ids(3, 10), ids(4, 11), ids(6, 12)]
    calls = carries_before_each_long_chunk(engine, tokenizer, monkeypatch, shorts, ids(5, 40))
    assert calls and calls[0] == MAX_DEFERRED_LONG < 6
