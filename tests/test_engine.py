"""The slot engine on tiny random models: sliding windows and padding, prefix continuation, slot independence,
save/restore and slot copies at any position, int8 KV, and zero recompilations after warm-up."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.engine import Engine, EngineConfig
from core.kv_cache import CacheSpec, init_cache
from core.model import sequence_logits
from core.sampling import SamplingParams, SlotRequest
from core.weights import random_params
from tiny_models import WINDOW, model_config

W = WINDOW
CHUNKS = (4, 8, 16)
SLOTS = 3
BUCKETS = (16, 32, 64)
VERIFY = 4  # speculative verify: the last token + up to 3 drafts
FAMILIES = ("gemma3", "gemma4")


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, compile_cache):
    cfg = model_config(request.param)
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=3)
    # Decode programs attending over 16, 32, 64 and 96 positions: the decode steps of every test below cross
    # those bucket boundaries (and the window), and must equal one full forward all the same.
    # Slot ranges of up to 8 positions move to and from the host in 8-position programs (transfer_sizes).
    engine = Engine(cfg, params, EngineConfig(num_slots=SLOTS, max_len=96, chunk_sizes=CHUNKS,
                                              attention_buckets=BUCKETS, verify_width=VERIFY, transfer_sizes=(8,)),
                    "float32")
    engine.warmup()
    full = jax.jit(partial(sequence_logits, cfg=cfg))

    def reference(ids: np.ndarray) -> np.ndarray:
        cache = init_cache(cfg, CacheSpec(num_slots=1, max_len=len(ids)))
        logits, _ = full(params, cache, jnp.asarray(ids[None], jnp.int32), jnp.zeros(1, jnp.int32),
                         jnp.full(1, len(ids), jnp.int32), None)
        return np.asarray(logits[0])

    return cfg, engine, reference


def one_slot_step(engine: Engine, slot: int, token: int, position: int) -> np.ndarray:
    tokens = np.zeros(engine.num_slots, np.int32)
    positions = np.zeros(engine.num_slots, np.int32)
    active = np.zeros(engine.num_slots, bool)
    tokens[slot], positions[slot], active[slot] = token, position, True
    return np.asarray(engine.decode(tokens, positions, active))[slot]  # no eager jax op (it would compile)


def greedy(engine: Engine, slot: int, prompt: np.ndarray, n: int) -> list[int]:
    out = [int(np.argmax(np.asarray(engine.prefill(slot, prompt, 0))))]
    while len(out) < n:
        out.append(int(np.argmax(one_slot_step(engine, slot, out[-1], len(prompt) + len(out) - 1))))
    return out


# Lengths on both sides of the window and of every chunk size, and across (2w, 3w+1).
LENGTHS = sorted({W - 1, W, W + 1, 2 * W + 3, 2 * W + 1, 2 * W + 5, 3 * W, 3 * W + 1, 3, 5, 15, 16, 17, 33})


@pytest.mark.parametrize("n", LENGTHS)
def test_chunked_prefill_then_decode_across_the_window_equals_full_forward(setup, n):
    cfg, engine, reference = setup
    extra = W + 3  # decode far enough to move the window past the prompt
    ids = np.random.default_rng(n).integers(3, cfg.vocab_size, size=n + extra)
    expected = reference(ids)
    for split in sorted({1, n // 3, n // 2, n - 1} - {0}):
        slot = split % SLOTS
        engine.prefill(slot, ids[:split], 0)
        got = [np.asarray(engine.prefill(slot, ids[split:n], split))]
        for t in range(n, n + extra):
            got.append(one_slot_step(engine, slot, int(ids[t]), t))
        np.testing.assert_allclose(np.stack(got), expected[n - 1:], atol=1e-4, rtol=0,
                                   err_msg=f"length {n}, split at {split}")


def test_decode_bucket_is_the_smallest_covering_every_position(setup):
    _, engine, _ = setup
    assert engine.buckets == (16, 32, 64, 96)
    assert engine.bucket_for(np.array([0, 15, 3])) == 16
    assert engine.bucket_for(np.array([0, 16, 3])) == 32
    assert engine.bucket_for(np.array([95, 0, 0])) == 96
    assert EngineConfig(max_len=8192).bucket_lengths() == (1024, 2048, 4096, 8192)
    assert EngineConfig(max_len=3000).bucket_lengths() == (1024, 2048, 3000)
    assert EngineConfig(max_len=512).bucket_lengths() == (512,)
    assert EngineConfig(max_len=8192, attention_buckets=()).bucket_lengths() == (8192,)
    with pytest.raises(ValueError, match="attention_buckets"):
        EngineConfig(max_len=64, attention_buckets=(32, 16))


@pytest.mark.parametrize("n", [5, 2 * W + 3])
def test_speculative_verify_gives_exactly_the_plain_greedy_tokens(setup, n):
    """Drafts that are partly right and partly wrong, past the window: the accepted tokens are the plain
    greedy continuation, and rejected drafts never corrupt the cache (a later step would then differ)."""
    cfg, engine, _ = setup
    rng = np.random.default_rng(n)
    prompt = rng.integers(3, cfg.vocab_size, size=n)
    want = greedy(engine, 1, prompt, 4 * W)
    got = [int(np.argmax(np.asarray(engine.prefill(2, prompt, 0))))]
    step = 0
    while len(got) < len(want):
        right = want[len(got):len(got) + step % VERIFY]  # 0..3 correct drafts, then wrong ones
        wrong = [int(t) for t in rng.integers(3, cfg.vocab_size, size=VERIFY - 1 - len(right))]
        drafts = (right + wrong)[:VERIFY - 1]
        out = engine.verify(2, [got[-1], *drafts], n + len(got) - 1)
        assert 1 <= len(out) <= len(right) + 1 + sum(1 for a, b in zip(wrong, want[len(got) + len(right):],
                                                                          strict=False) if a == b)
        got += out
        step += 1
    assert got[:len(want)] == want
    with pytest.raises(ValueError, match="verify takes"):
        engine.verify(2, list(range(VERIFY + 1)), 0)


def test_batched_prefill_of_several_slots_equals_each_alone(setup):
    """Slots continuing from different positions (one past the window, one from 0), prefilled in one
    call, give the logits and the next decode steps that one prefill per slot gives."""
    cfg, engine, reference = setup
    rng = np.random.default_rng(31)
    lengths = {0: (2 * W + 1, 3), 1: (0, 4), 2: (5, 2)}  # slot: (cached prefix, new tokens)
    ids = {slot: rng.integers(3, cfg.vocab_size, size=held + new + 3) for slot, (held, new) in lengths.items()}
    for slot, (held, _) in lengths.items():
        if held:
            engine.prefill(slot, ids[slot][:held], 0)
    pieces = [(slot, ids[slot][held:held + new], held) for slot, (held, new) in lengths.items()]
    logits = np.asarray(engine.prefill_rows(pieces))
    for slot, (held, new) in lengths.items():
        want = reference(ids[slot])
        np.testing.assert_allclose(logits[slot], want[held + new - 1], atol=1e-4, rtol=0)
        for t in range(held + new, held + new + 3):
            np.testing.assert_allclose(one_slot_step(engine, slot, int(ids[slot][t]), t), want[t], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="once per call"):
        engine.prefill_rows([(0, [5], 0), (0, [6], 1)])
    with pytest.raises(ValueError, match="tokens once per call"):
        engine.prefill_rows([(1, list(range(3, 3 + CHUNKS[0] + 1)), 0)])


def test_plan_chunks_covers_exactly_with_fixed_sizes(setup):
    _, engine, _ = setup
    for n in range(1, 60):
        plan = engine.plan_chunks(n)
        assert all(size in CHUNKS for size in plan)
        assert sum(plan) >= n and sum(plan[:-1]) < n


def test_slots_are_independent(setup):
    cfg, engine, _ = setup
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg.vocab_size, size=int(rng.integers(2, 3 * W))) for _ in range(SLOTS)]
    alone = [greedy(engine, 0, p, 12) for p in prompts]
    # Together: all slots prefilled, then decoded in the same batched steps.
    outs = [[int(np.argmax(np.asarray(engine.prefill(s, p, 0))))] for s, p in enumerate(prompts)]
    for _ in range(11):
        tokens = np.array([o[-1] for o in outs], np.int32)
        positions = np.array([len(p) + len(o) - 1 for p, o in zip(prompts, outs, strict=True)], np.int32)
        logits = np.asarray(engine.decode(tokens, positions, np.ones(SLOTS, bool)))
        for s in range(SLOTS):
            outs[s].append(int(np.argmax(logits[s])))
    assert outs == alone


def test_save_restore_and_slot_copy_continue_bit_identically(setup):
    cfg, engine, _ = setup
    rng = np.random.default_rng(9)
    prompt = rng.integers(3, cfg.vocab_size, size=2 * W + 5)
    follow = rng.integers(3, cfg.vocab_size, size=6)

    def continuation(slot: int) -> np.ndarray:
        logits = [np.asarray(engine.prefill(slot, follow, len(prompt)))]
        for t, tok in enumerate(follow[:4]):
            logits.append(one_slot_step(engine, slot, int(tok), len(prompt) + len(follow) + t))
        return np.stack(logits)

    engine.prefill(0, prompt, 0)
    snapshot = engine.save_slot(0, 0, len(prompt))
    baseline = continuation(0)
    # Restore the snapshot into another slot (holding garbage from earlier tests).
    engine.restore_slot(2, snapshot)
    assert np.array_equal(continuation(2), baseline)
    # Two-part snapshot: a prefix then the rest, restored on top of each other.
    engine.prefill(0, prompt, 0)
    first, second = engine.save_slot(0, 0, W + 2), engine.save_slot(0, W + 2, len(prompt))
    engine.restore_slot(1, first)
    engine.restore_slot(1, second)
    assert np.array_equal(continuation(1), baseline)
    # A save that does not wait reads the slot as it was when issued, though the slot is overwritten before
    # the snapshot's arrays are made.
    engine.prefill(0, prompt, 0)
    later = engine.save_slot(0, 0, len(prompt), wait=False)
    engine.prefill(0, follow, 0)
    size = later.nbytes  # known from the cache's shapes before the arrays are made (the host tier counts it)
    assert size == sum(a.nbytes for entry in later.layers.values() for a in entry.values()) > 0
    engine.restore_slot(1, later)
    assert np.array_equal(continuation(1), baseline)
    # Device copy of the whole prefix.
    engine.prefill(0, prompt, 0)
    engine.copy_prefix(0, 1, len(prompt))
    assert np.array_equal(continuation(1), baseline)


@pytest.mark.parametrize("n", [W // 2, W + 3, 2 * W + 1])
def test_any_prefix_of_a_slot_that_moved_far_past_it_is_reusable(setup, n):
    """A slot that went on for more than a window past position n still serves [0, n) to another slot, by a
    device copy or through the host, and the continuation equals a cold forward (bit for bit between the two
    reuse paths)."""
    cfg, engine, reference = setup
    ids = np.random.default_rng(13 + n).integers(3, cfg.vocab_size, size=n + 2 * W + 5)
    engine.prefill(0, ids, 0)  # slot 0 holds n + 2W + 5 positions: its window left n behind long ago
    want = reference(ids)[n:]
    engine.copy_prefix(0, 1, n)
    copied = np.asarray(engine.prefill(1, ids[n:], n))
    np.testing.assert_allclose(copied, want[-1], atol=1e-4, rtol=0)
    engine.restore_slot(2, engine.save_slot(0, 0, n))
    assert np.array_equal(np.asarray(engine.prefill(2, ids[n:], n)), copied)
    # A snapshot of only [n - 3, n) on top of a slot that holds [0, n - 3) of the same tokens does the same
    # (it moves as 8 positions, not a bucket's 16).
    engine.copy_prefix(0, 2, n - 3)
    small = [engine.programs[kind, 8] for kind in ("read", "write")]
    calls = [program.calls for program in small]
    engine.restore_slot(2, engine.save_slot(0, n - 3, n))
    assert np.array_equal(np.asarray(engine.prefill(2, ids[n:], n)), copied)
    assert [program.calls for program in small] == [c + 1 for c in calls]


def test_full_hit_recomputes_the_last_token_of_a_long_prompt(setup):
    """A slot holding a whole prompt past the window resumes at its last token (n = held - 1)."""
    cfg, engine, reference = setup
    ids = np.random.default_rng(31).integers(3, cfg.vocab_size, size=3 * W + 1)
    engine.prefill(0, ids, 0)
    engine.copy_prefix(0, 2, len(ids) - 1)
    np.testing.assert_allclose(np.asarray(engine.prefill(2, ids[-1:], len(ids) - 1)), reference(ids)[-1],
                               atol=1e-4, rtol=0)
    snap = engine.save_slot(0, 0, len(ids))
    engine.restore_slot(1, snap)
    np.testing.assert_allclose(np.asarray(engine.prefill(1, ids[-1:], len(ids) - 1)), reference(ids)[-1],
                               atol=1e-4, rtol=0)


def test_slot_ranges_out_of_bounds_are_refused(setup):
    _, engine, _ = setup
    with pytest.raises(ValueError, match="bad range"):
        engine.save_slot(0, 5, engine.max_len + 1)
    with pytest.raises(ValueError, match="cannot copy"):
        engine.copy_prefix(0, SLOTS, 4)


def test_prefill_rejects_positions_past_the_slot(setup):
    _, engine, _ = setup
    with pytest.raises(ValueError, match="exceed"):
        engine.prefill(0, np.ones(10, np.int32), engine.max_len - 5)


def test_no_compilation_after_warmup(setup):
    cfg, engine, _ = setup
    compiles = []
    listener = lambda name, *_, **__: compiles.append(name)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        rng = np.random.default_rng(17)
        for n in (1, 3, 7, 9, 20, 37):
            prompt = rng.integers(3, cfg.vocab_size, size=n)
            greedy(engine, n % SLOTS, prompt, 4)
        for start, end in ((2, 30), (0, 17), (60, 96)):
            engine.restore_slot(2, engine.save_slot(1, start, end))
        engine.copy_prefix(1, 0, 5)
        engine.copy_prefix(1, 0, 70)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert [c for c in compiles if c == "/jax/core/compile/backend_compile_duration"] == []


def test_int8_kv_cache_tracks_float_cache(setup):
    cfg, engine, reference = setup
    int8 = Engine(cfg, engine.params, EngineConfig(num_slots=2, max_len=96, chunk_sizes=CHUNKS, kv_dtype="int8"),
                  "float32")
    assert int8.bytes_per_slot < engine.bytes_per_slot / 3
    ids = np.random.default_rng(21).integers(3, cfg.vocab_size, size=3 * W + 2)
    expected = reference(ids)
    got = [np.asarray(int8.prefill(1, ids[:2 * W], 0))]
    for t in range(2 * W, len(ids)):
        got.append(one_slot_step(int8, 1, int(ids[t]), t))
    got = np.stack(got)[:-1]
    want = expected[2 * W - 1:-1]
    # Every query reads int8 keys and values, its own chunk's included (as a decode step does), so the prefill's
    # logits carry int8 error too; on the real model that costs +1.85% perplexity (gate 2%).
    assert np.abs(got - want).max() < 0.08 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("variant", ["w8a8-int8kv", "float"])
def test_prompt_logits_are_bit_identical_however_the_prompt_was_chunked(setup, variant):
    """With W8A8 weights and int8 KV (the CPU default) and on the float path alike, a prompt's logits are the
    same bits whether it was prefilled at once, resumed after any split point (every one, across chunk sizes,
    attention buckets and the window), or finished by decode steps: what a prefix-cache hit promises
    (core.device.EXACT_CPU_FLAGS, core.model.softmax, core.model.sliding_view_positions)."""
    from core.weights import to_w8a8

    cfg, engine, _ = setup
    quantized = variant == "w8a8-int8kv"
    exact = Engine(cfg, to_w8a8(engine.params) if quantized else engine.params,
                   EngineConfig(num_slots=2, max_len=96, chunk_sizes=CHUNKS, attention_buckets=BUCKETS,
                                kv_dtype="int8" if quantized else None), "float32")
    ids = np.random.default_rng(1).integers(3, cfg.vocab_size, size=5 * W)
    at_once = np.asarray(exact.prefill(0, ids, 0))
    differing = []
    for split in range(1, len(ids)):
        exact.prefill(1, ids[:split], 0)
        if not np.array_equal(np.asarray(exact.prefill(1, ids[split:], split)), at_once):
            differing.append(split)
    assert not differing, f"logits differ after splits at {differing}"
    exact.prefill(1, ids[:3 * W], 0)
    for t in range(3 * W, 5 * W):
        last = one_slot_step(exact, 1, int(ids[t]), t)
    np.testing.assert_array_equal(last, at_once)


def test_speculative_verify_with_int8_kv_gives_exactly_the_plain_greedy_tokens(setup):
    """The CPU serving default stores K/V in int8: a verify row quantizes its K/V into the cache and reads
    them back as the decode step at that position does, so speculation stays exact there too, across
    the window and rejected drafts."""
    cfg, engine, _ = setup
    int8 = Engine(cfg, engine.params, EngineConfig(num_slots=2, max_len=96, chunk_sizes=CHUNKS, kv_dtype="int8",
                                                   attention_buckets=BUCKETS, verify_width=VERIFY), "float32")
    rng = np.random.default_rng(37)
    prompt = rng.integers(3, cfg.vocab_size, size=W + 2)
    want = greedy(int8, 0, prompt, 3 * W)
    got = [int(np.argmax(np.asarray(int8.prefill(1, prompt, 0))))]
    step = 0
    while len(got) < len(want):
        right = want[len(got):len(got) + step % VERIFY]
        wrong = [int(t) for t in rng.integers(3, cfg.vocab_size, size=VERIFY - 1 - len(right))]
        got += int8.verify(1, [got[-1], *(right + wrong)[:VERIFY - 1]], len(prompt) + len(got) - 1)
        step += 1
    assert got[:len(want)] == want


def test_batched_verify_gives_exactly_the_plain_greedy_tokens_of_every_slot(setup):
    """W8A8 weights and int8 KV (the CPU default): every product is integer, so a slot's rows in a batched
    verify ([slots, width]) compute what the decode step over all slots computes. Slots at different
    positions, past the window and across bucket boundaries, with right, wrong and no drafts, get exactly the
    tokens that plain decode steps with every slot active give."""
    from core.weights import to_w8a8

    cfg, engine, _ = setup
    config = EngineConfig(num_slots=SLOTS, max_len=96, chunk_sizes=CHUNKS, kv_dtype="int8",
                          attention_buckets=BUCKETS, verify_width=VERIFY, rows_verify_width=3)
    params = to_w8a8(engine.params)
    plain, spec = Engine(cfg, params, config, "float32"), Engine(cfg, params, config, "float32")
    assert spec.rows_verify_exact and not engine.rows_verify_exact
    rng = np.random.default_rng(41)
    prompts = [rng.integers(3, cfg.vocab_size, size=n) for n in (W + 2, 5, 2 * W + 3)]
    total = 3 * W
    want = [[int(np.argmax(np.asarray(plain.prefill(s, p, 0))))] for s, p in enumerate(prompts)]
    while min(len(w) for w in want) < total + 3:
        positions = np.array([len(p) + len(w) - 1 for p, w in zip(prompts, want, strict=True)], np.int32)
        logits = np.asarray(plain.decode(np.array([w[-1] for w in want], np.int32), positions, np.ones(SLOTS, bool)))
        for s in range(SLOTS):
            want[s].append(int(np.argmax(logits[s])))
    got = [[int(np.argmax(np.asarray(spec.prefill(s, p, 0))))] for s, p in enumerate(prompts)]
    step = 0
    while min(len(g) for g in got) < total:
        starts = [len(p) + len(g) - 1 for p, g in zip(prompts, got, strict=True)]
        pieces = []
        for s, room in enumerate(spec.rows_verify_room(starts)):
            n_right = min((step + s) % 3, room - 1)  # 0, 1 or 2 right drafts, then wrong ones
            right = want[s][len(got[s]):len(got[s]) + n_right]
            wrong = [int(t) for t in rng.integers(3, cfg.vocab_size, size=room - 1 - len(right))]
            pieces.append((s, [got[s][-1], *right, *wrong][:room], starts[s]))
        out = spec.verify_rows(pieces)
        for s in range(SLOTS):
            assert 1 <= len(out[s]) <= len(pieces[s][1])
            got[s] += out[s]
        step += 1
    for s in range(SLOTS):
        assert got[s][:total] == want[s][:total], f"slot {s}"
    assert step < total  # drafts were accepted: fewer passes than tokens
    with pytest.raises(ValueError, match="W8A8"):
        engine.verify_rows([(0, [1], 0)])
    with pytest.raises(ValueError, match="once per call"):
        spec.verify_rows([(0, [1, 2, 3, 4], 0)])


# Sampled requests a verify step may serve (`scheduler.speculation.speculation_allowed`): temperature with and
# without truncation, logit bias, and a greedy one beside them.
SPECULATED = (SamplingParams(temperature=0.9, seed=11),
              SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=12),
              SamplingParams(temperature=1.3, top_p=0.8, logit_bias={5: 4.0, 9: -100.0}, seed=13),
              SamplingParams(temperature=0))


def sampled_continuations(engine: Engine, prompts: list[np.ndarray], total: int) -> list[list[int]]:
    """Slot s's request (SPECULATED[s]) prefilled with prompts[s] and then decoded, those slots active, the
    sampler drawing every token as the scheduler's plain decode steps do."""
    n = len(prompts)
    engine.begin_requests([SlotRequest(s, SPECULATED[s], p, SPECULATED[s].seed or 0) for s, p in enumerate(prompts)])
    out = [[int(engine.sample_slot(s, engine.prefill(s, p, 0), step=0).tokens[0])] for s, p in enumerate(prompts)]
    tokens, positions, steps = (np.zeros(engine.num_slots, np.int32) for _ in range(3))
    active = np.arange(engine.num_slots) < n
    while min(len(o) for o in out) < total:
        for s, (p, o) in enumerate(zip(prompts, out, strict=True)):
            tokens[s], positions[s], steps[s] = o[-1], len(p) + len(o) - 1, len(o)
        drawn = engine.sample(engine.decode(tokens, positions, active), active, steps).tokens
        for s in range(n):
            out[s].append(int(drawn[s]))
    return out


def test_verify_steps_draw_exactly_the_tokens_plain_sampling_draws(setup):
    """Seeded sampling draws each token from fold_in(seed, step): a verify pass that draws position i at
    step + i gives exactly the tokens plain decode steps sample, batched over slots (W8A8, int8 KV) and for a
    lone slot, with top-k/top-p/min-p, logit bias and greedy beside them, right and wrong drafts alike."""
    from core.weights import to_w8a8

    cfg, engine, _ = setup
    config = EngineConfig(num_slots=len(SPECULATED), max_len=96, chunk_sizes=CHUNKS, kv_dtype="int8",
                          attention_buckets=BUCKETS, verify_width=VERIFY, rows_verify_width=3)
    params = to_w8a8(engine.params)
    rng = np.random.default_rng(43)
    prompts = [rng.integers(3, cfg.vocab_size, size=n) for n in (W + 2, 5, 2 * W + 3, 7)]
    want = check_sampled_verify(Engine(cfg, params, config, "float32"), Engine(cfg, params, config, "float32"),
                                prompts, 3 * W, rng)
    assert 5 in want[2]  # the logit bias shows


def check_sampled_verify(plain: Engine, spec: Engine, prompts: list[np.ndarray], total: int,
                         rng: np.random.Generator) -> list[list[int]]:
    """Asserts that `spec`'s verify passes (batched, and now and then one slot's own) give the first `total`
    tokens `plain` samples step by step for slot s's request SPECULATED[s] (prompts[s]), drafts partly right.
    Returns plain's tokens."""
    slots = len(prompts)
    want = sampled_continuations(plain, prompts, total + spec.config.verify_tokens)
    assert len({tuple(w) for w in want}) == slots  # the streams differ
    spec.begin_requests([SlotRequest(s, SPECULATED[s], p, SPECULATED[s].seed or 0) for s, p in enumerate(prompts)])
    got = [[int(spec.sample_slot(s, spec.prefill(s, p, 0), step=0).tokens[0])] for s, p in enumerate(prompts)]
    passes = 0
    while min(len(g) for g in got) < total:
        starts = [len(p) + len(g) - 1 for p, g in zip(prompts, got, strict=True)]
        if passes % 3 == 2 and spec.config.verify_tokens > 1:  # now and then a lone slot's own verify
            s = passes % slots
            right = want[s][len(got[s]):len(got[s]) + spec.verify_room(starts[s]) - 2]
            got[s] += spec.verify(s, [got[s][-1], *right, 3], starts[s], step=len(got[s]))
            passes += 1
            continue
        pieces = []
        for s, room in enumerate(spec.rows_verify_room(starts)):
            n_right = min((passes + s) % 3, room - 1)  # 0, 1 or 2 right drafts, then wrong ones
            right = want[s][len(got[s]):len(got[s]) + n_right]
            wrong = [int(t) for t in rng.integers(3, spec.cfg.vocab_size, size=room - 1 - len(right))]
            pieces.append((s, [got[s][-1], *right, *wrong][:room], starts[s]))
        out = spec.verify_rows(pieces, [len(g) for g in got])
        for s in range(slots):
            got[s] += out[s]
        passes += 1
    for s in range(slots):
        assert got[s][:total] == want[s][:total], f"slot {s}"
    return want


def test_background_warmup_compiles_what_a_short_request_needs_first_and_the_rest_meanwhile(compile_cache):
    cfg = model_config("gemma3")  # the warm-up does not depend on the family
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=3)
    config = EngineConfig(num_slots=SLOTS, max_len=96, chunk_sizes=(4, 16), attention_buckets=(16, 32, 64),
                          verify_width=VERIFY)
    eng = Engine(cfg, params, config, "float32")
    eng.warmup(background=True)
    first = [k for k in eng.programs if (k[0].startswith("sample") and not k[-1])  # the unmasked samplers
             or k in {("prefill", 4, 16), ("decode", 16), ("verify", 16)}]
    assert all(eng.programs[k].ready for k in first) and len(first) < len(eng.programs)
    prompt = np.random.default_rng(8).integers(3, cfg.vocab_size, size=40)  # needs the 64 bucket: may wait
    during = greedy(eng, 0, prompt, 6)
    eng.programs.background.join(timeout=300)
    assert eng.programs.counts()["compiled"] == len(eng.programs)
    compiles = []
    listener = lambda name, *_, **__: compiles.append(name)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        after = greedy(eng, 1, prompt, 6)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert "/jax/core/compile/backend_compile_duration" not in compiles
    cold = Engine(cfg, params, config, "float32")  # no warm-up: each call compiles its program first
    assert after == during == greedy(cold, 2, prompt, 6)


def test_stopping_the_background_warmup_ends_it_after_the_program_it_is_compiling(compile_cache):
    """Whoever stops the engine stops its warm-up thread (a daemon thread inside XLA's compiler at interpreter
    exit aborts the process): it compiles nothing more, and a program it left out still compiles on demand."""
    cfg = model_config("gemma4")
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=4)
    config = EngineConfig(num_slots=SLOTS, max_len=96, chunk_sizes=(4, 8, 16), attention_buckets=(16, 32, 64),
                          verify_width=VERIFY)
    eng = Engine(cfg, params, config, "float32")
    eng.warmup(background=True)
    assert eng.programs.stop_background(timeout=120)
    assert not eng.programs.background.is_alive()
    # Stopped right after ready, the thread had a dozen programs (seconds of compiling) still to go.
    left = [k for k in eng.programs if not eng.programs[k].ready]
    assert left and eng.programs.counts()["compiled"] + len(left) == len(eng.programs)
    prompt = np.random.default_rng(9).integers(3, cfg.vocab_size, size=40)  # needs programs of the 64 bucket
    assert len(greedy(eng, 0, prompt, 3)) == 3
    assert ("decode", 64) in left and eng.programs["decode", 64].ready  # left out, then compiled on demand


def state_of(engine: Engine) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(jax.device_get((engine.cache, engine.sampler)))]


def test_first_runs_run_every_program_once_on_throwaway_state(setup):
    """A first run (one run right after compiling, so that no request pays XLA:CPU's one-time set-up) gets
    zeros but the parameters: every slot's KV and the sampler state stay as they were, for every kind."""
    from core.sampling import SamplingParams

    _, engine, _ = setup
    engine.prefill(1, np.arange(3, 3 + 2 * W + 1), 0)
    engine.begin_request(1, SamplingParams(temperature=0.7, repetition_penalty=1.2), [5, 6], seed=9)
    before = state_of(engine)
    kinds = {key[0] for key in engine.programs}
    assert kinds >= {"sample", "sample_row", "prefill", "prefill_rows", "decode", "verify", "read", "write", "copy"}
    calls = {key: engine.programs[key].calls for key in engine.programs}
    for key in engine.programs:
        engine.first_run(key)
    assert all(engine.programs[key].calls == calls[key] + 1 for key in engine.programs)
    assert all(np.array_equal(a, b) for a, b in zip(before, state_of(engine), strict=True))
    assert engine._scratch_cache is None  # outside a warm-up none is kept


def test_first_runs_before_ready_share_one_scratch_kv_cache_and_free_it(compile_cache, monkeypatch):
    """Each first run before ready hands its scratch KV cache to the next (only the first allocates one; a
    zeroed default-model pool is 585 MiB to fault in each time), never the live cache, and none is kept
    after ready."""
    cfg = model_config("gemma3")
    config = EngineConfig(num_slots=SLOTS, max_len=96, chunk_sizes=(4, 16), attention_buckets=(16, 32, 64),
                          verify_width=VERIFY)
    eng = Engine(cfg, random_params(cfg, std=0.1, norm_std=0.1, seed=3), config, "float32")
    leaves = jax.tree_util.tree_leaves(eng.cache)
    live = {a.unsafe_buffer_pointer() for a in leaves}
    like_first = sum((a.shape, a.dtype) == (leaves[0].shape, leaves[0].dtype) for a in leaves)
    made, zeros = [], jnp.zeros
    monkeypatch.setattr(jnp, "zeros",
                        lambda shape, dtype=None: made.append((tuple(shape), dtype)) or zeros(shape, dtype))
    taken = []
    run = eng.first_run

    def first_run(key):
        if eng._scratch_cache is not None:
            taken.append({a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(eng._scratch_cache)})
        run(key)

    monkeypatch.setattr(eng, "first_run", first_run)
    eng.warmup(first_runs=True)
    takers = [k for k in eng.programs if eng._first_needed(k) and k[0] in ("prefill", "decode", "verify_rows",
                                                                          "verify", "prefill_rows")]
    assert len(takers) >= 3 and len(taken) >= len(takers) - 2  # two compile threads: each may start one
    assert not any(live & pointers for pointers in taken)
    assert sum(shape == leaves[0].shape and dtype == leaves[0].dtype for shape, dtype in made) <= 2 * like_first
    assert eng._scratch_cache is None


def test_first_runs_of_batched_verify_under_adapters_leave_the_state_alone(compile_cache):
    from test_batched_verify import exact_engine
    from test_lora_engine import random_adapter

    cfg = model_config("gemma3")
    engine = exact_engine(cfg, random_params(cfg, std=0.1, norm_std=0.1, seed=13), slots=3, max_len=96,
                          chunks=(4, 8, 16), adapter_slots=2)
    engine.load_adapter(0, random_adapter(cfg, 8, seed=1))
    engine.use_adapter(1, 0)
    engine.prefill(1, np.arange(3, 3 + 2 * W + 1), 0)
    before = state_of(engine)
    keys = [key for key in engine.programs if key[0] == "verify_rows"]
    assert keys
    for key in keys:
        engine.first_run(key)
    assert all(np.array_equal(a, b) for a, b in zip(before, state_of(engine), strict=True))


def test_with_first_runs_every_program_has_run_once_when_warmed_up(compile_cache):
    """Before ready for the first requests' programs, on the background thread for the rest: no request
    waits for a program's first-run set-up, and a program a call ran first is not run again."""
    cfg = model_config("gemma3")
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=3)
    config = EngineConfig(num_slots=SLOTS, max_len=96, chunk_sizes=(4, 16), attention_buckets=(16, 32, 64),
                          verify_width=VERIFY)
    eng = Engine(cfg, params, config, "float32")
    eng.warmup(background=True, first_runs=True)
    first = {key for key in eng.programs if eng._first_needed(key)}
    assert {("decode", 16), ("prefill", 4, 16), ("prefill_rows", 16), ("verify", 16), ("copy", 16)} <= first
    assert {key for key in eng.programs if key[0].startswith("sample")} <= first  # the masked ones too
    assert all(eng.programs[key].calls == 1 for key in first)
    eng.programs.background.join(timeout=300)
    assert all(program.calls == 1 for program in eng.programs.values())
    # Both shapes of the sampling-parameter install were compiled too: admitting one request or several
    # compiles nothing.
    from core import sampling
    from core.sampling import SamplingParams

    compiled = sampling._write_slots._cache_size()
    eng.begin_request(1, SamplingParams(temperature=0.5), [3, 4], seed=1)
    eng.begin_requests([sampling.SlotRequest(s, SamplingParams(), [5], s) for s in (0, 2)])
    assert sampling._write_slots._cache_size() == compiled
    # Nor after a step, whose programs' outputs (the sampler state among them) are committed to the device.
    eng.sample(jnp.zeros((SLOTS, cfg.vocab_size), jnp.float32), np.ones(SLOTS, bool), np.zeros(SLOTS, np.int32))
    eng.begin_requests([sampling.SlotRequest(s, SamplingParams(), [5], s) for s in (0, 1)])
    eng.begin_request(2, SamplingParams(), [6], seed=2)
    assert sampling._write_slots._cache_size() == compiled
    # Everything compiled before ready (a batch run): only the first requests' programs run ahead.
    batch = Engine(cfg, params, config, "float32")
    batch.warmup(first_runs=True)
    assert {key for key in batch.programs if batch.programs[key].calls} == first


def test_a_bfloat16_slot_range_moves_to_the_host_and_back_bit_for_bit(compile_cache):
    """Accelerators keep bfloat16 KV; its host copies run on the bytes (numpy copies extension dtypes element by
    element), so the bits must survive both directions, through a bucket-sized and a small transfer program."""
    cfg = model_config("gemma3")
    engine = Engine(cfg, random_params(cfg, std=0.1, norm_std=0.1, seed=5),
                    EngineConfig(num_slots=2, max_len=32, chunk_sizes=(16,), attention_buckets=(16,), verify_width=0,
                                 kv_dtype="bfloat16", transfer_sizes=(8,)), "float32")
    engine.prefill(0, np.random.default_rng(2).integers(3, cfg.vocab_size, size=12), 0)
    whole, tail = engine.save_slot(0, 0, 12), engine.save_slot(0, 9, 12)
    engine.restore_slot(1, whole)
    for key, entry in engine.cache.items():
        for name, array in entry.items():
            held = np.asarray(array)
            assert whole.layers[key][name].dtype == held.dtype == np.dtype("bfloat16")
            assert np.array_equal(whole.layers[key][name].view(np.uint16), held[0, :12].view(np.uint16))
            assert np.array_equal(tail.layers[key][name].view(np.uint16), held[0, 9:12].view(np.uint16))
            assert np.array_equal(held[1, :12].view(np.uint16), held[0, :12].view(np.uint16))
