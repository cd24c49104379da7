"""core.sampling: greedy, seeded sampling, truncation sets, masks, penalties, counts, logprobs, validation.

Truncation tests run with a tiny candidate cap (k_max=8 on V=1000) as well as the default, so both the
candidate fast path and the exact bisection / full-row fallbacks are checked against a numpy reference.
Timings: benchmarks/sampler.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import sampling
from core.sampling import SamplingParams

S, V = 8, 1000
SAMPLE = jax.jit(sampling.sample, static_argnames=("num_top", "needs_full", "k_max"))
ACTIVE = jnp.ones((S,), jnp.bool_)


def make_state(params: list[SamplingParams | None], vocab: int = V, prompts: list[list[int]] | None = None,
               seeds: list[int] | None = None) -> sampling.SamplerState:
    state = sampling.init_state(len(params), vocab)
    for i, p in enumerate(params):
        if p is not None:
            prompt = prompts[i] if prompts else []
            state = sampling.set_slot(state, i, p, prompt, seeds[i] if seeds else 1000 + i)
    return state


def steps(n: int = 0) -> jax.Array:
    return jnp.full((S,), n, jnp.int32)


N_DRAWS = 1500  # one draw count everywhere keeps the number of compiles down


@functools.partial(jax.jit, static_argnames=("k_max", "needs_full"))
def draw_many(logits: jax.Array, state: sampling.SamplerState, mask: jax.Array | None,
              k_max: int = sampling.K_MAX, needs_full: bool = True) -> jax.Array:
    """[N_DRAWS, S] tokens for steps 0..N_DRAWS-1 (independent draws per row, state not advanced).

    lax.map, not vmap, so the sampler's lax.conds stay real branches as in the decode step."""
    s = logits.shape[0]
    active = jnp.ones((s,), jnp.bool_)

    def one(step: jax.Array) -> jax.Array:
        step_s = jnp.full((s,), step, jnp.int32)
        return sampling.sample(logits, state, mask, step_s, active, k_max=k_max, needs_full=needs_full)[0]

    return jax.lax.map(one, jnp.arange(N_DRAWS, dtype=jnp.int32))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x[np.isfinite(x)].max()
    return x - (m + np.log(np.exp(x - m).sum()))


def ref_allowed(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Tokens a truncated draw may return, by the textbook definitions in float64."""
    x = np.asarray(x, np.float64)
    keep = np.isfinite(x)
    if 0 < p.top_k < len(x):  # k >= V keeps everything
        keep &= x >= np.sort(x)[::-1][p.top_k - 1]
    prob = np.where(keep, np.exp((x - x[keep].max()) / p.temperature), 0.0)
    prob /= prob.sum()
    if p.top_p < 1:
        greater = np.array([prob[x > xi].sum() for xi in x])  # mass of strictly more likely tokens
        assert np.all(np.abs(greater[keep] - p.top_p) > 1e-3), "top_p too close to a boundary"
        keep &= greater < p.top_p
    if p.min_p:
        ratio = prob / prob.max()
        assert np.all(np.abs(ratio[keep] - p.min_p) > 1e-3 * p.min_p), "min_p too close to a boundary"
        keep &= ratio >= p.min_p
    return keep


def head_logits(seed: int = 0) -> np.ndarray:
    """V=1000: a geometric head of 40 tokens (ratio e^-0.15) at random positions over a low tail."""
    rng = np.random.default_rng(seed)
    x = rng.normal(-6.0, 1.0, V)
    head = rng.permutation(V)[:40]
    x[head] = 4.0 - 0.15 * np.arange(40)
    return x.astype(np.float32)


# ---------------------------------------------------------------------------------------------- greedy


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).normal(size=(S, V)).astype(np.float32)
    logits[3, [10, 20]] = 50.0  # tie -> first index, like np.argmax
    state = make_state([SamplingParams(temperature=0.0)] * S)
    tok, lp, *_ = SAMPLE(jnp.asarray(logits), state, None, steps(), ACTIVE)
    np.testing.assert_array_equal(np.asarray(tok), logits.argmax(-1))
    expect = [log_softmax(row)[t] for row, t in zip(logits, logits.argmax(-1), strict=True)]
    np.testing.assert_allclose(np.asarray(lp), expect, atol=1e-5)


def test_greedy_respects_mask_bias_and_penalties():
    x = np.zeros((S, V), np.float32)
    x[:, 0], x[:, 1], x[:, 2] = 5.0, 4.9, -3.0
    x[4] = -5.0
    x[4, 0], x[4, 1] = -1.0, -1.1  # negative logits: the repetition penalty multiplies
    mask = np.ones((S, V), np.bool_)
    mask[0, 0] = False
    params = [
        SamplingParams(temperature=0.0),  # 0: mask bans token 0 -> 1
        SamplingParams(temperature=0.0, logit_bias=((0, -100.0),)),  # 1: ban -> 1
        SamplingParams(temperature=0.0, logit_bias=((2, 100.0),)),  # 2: force -> 2
        SamplingParams(temperature=0.0, repetition_penalty=1.2),  # 3: 5 / 1.2 < 4.9 -> 1
        SamplingParams(temperature=0.0, repetition_penalty=1.2),  # 4: -1 * 1.2 < -1.1 -> 1
        SamplingParams(temperature=0.0, frequency_penalty=0.2),  # 5: 5 - 0.2 * 1 < 4.9 after one 0
        SamplingParams(temperature=0.0, presence_penalty=0.2),  # 6: same via presence
        SamplingParams(temperature=0.0),  # 7: control -> 0
    ]
    prompts = [[], [], [], [0], [0], [], [], [0]]
    state = make_state(params, prompts=prompts)
    xs, packed = jnp.asarray(x), jnp.asarray(sampling.pack_mask(mask))
    tok, *_, state = SAMPLE(xs, state, packed, steps(0), ACTIVE, num_top=5)
    np.testing.assert_array_equal(np.asarray(tok), [1, 1, 2, 1, 1, 0, 0, 0])
    # Rows 5, 6 now have one 0 in their output; rows 3, 4 have seen token 1 too, so it is penalised alike.
    tok, *_ = SAMPLE(xs, state, packed, steps(1), ACTIVE, num_top=5)
    np.testing.assert_array_equal(np.asarray(tok), [1, 1, 2, 0, 0, 1, 1, 0])


# ------------------------------------------------------------------------------------- seeds and slots


def test_seed_key_matches_prng_key():
    np.testing.assert_array_equal(sampling.seed_key_data(12345), jax.random.key_data(jax.random.PRNGKey(12345)))


def test_same_seed_and_step_reproduce():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(S, V)).astype(np.float32))
    state = make_state([SamplingParams(temperature=1.0)] * S, seeds=[7] * S)
    a = np.asarray(SAMPLE(logits, state, None, steps(3), ACTIVE)[0])
    b = np.asarray(SAMPLE(logits, state, None, steps(3), ACTIVE)[0])
    np.testing.assert_array_equal(a, b)
    many = np.asarray(draw_many(logits, state, None))
    assert len({tuple(r) for r in many[:20]}) > 1  # the step changes the draw


def test_row_independent_of_slot_and_neighbours():
    req = SamplingParams(temperature=0.9, top_p=0.8, repetition_penalty=1.2, frequency_penalty=0.3,
                         presence_penalty=0.2, logit_bias=((3, 2.0),))
    prompt = [5, 6, 7]
    neighbours_a = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.95),
                    SamplingParams(temperature=1.0, min_p=0.001), SamplingParams(temperature=2.0, top_k=50),
                    None, SamplingParams(temperature=0.5), SamplingParams(temperature=0.0, presence_penalty=1.0)]
    neighbours_b = [SamplingParams(temperature=0.0)] * 7
    rng = np.random.default_rng(2)

    def run(slot: int, neighbours: list[SamplingParams | None], k_max: int) -> tuple[list, list]:
        params = list(neighbours)
        params.insert(slot, req)
        prompts = [[] for _ in range(S)]
        prompts[slot] = prompt
        state = make_state(params, prompts=prompts, seeds=[int(s) for s in rng.integers(0, 2**40, S)])
        state = sampling.set_slot(state, slot, req, prompt, 424242)
        toks, lps = [], []
        for i in range(50):
            logits = rng.normal(size=(S, V)).astype(np.float32) * 2
            logits[slot] = head_logits(i)
            mask = rng.random((S, V)) < 0.5
            mask[slot] = np.arange(V) % 3 != 1
            tok, lp, _, _, state = SAMPLE(jnp.asarray(logits), state, jnp.asarray(sampling.pack_mask(mask)),
                                          jnp.asarray(rng.integers(0, 9, S), jnp.int32).at[slot].set(i),
                                          ACTIVE, num_top=5, k_max=k_max)
            toks.append(int(tok[slot]))
            lps.append(float(lp[slot]))
        return toks, lps

    a = run(0, neighbours_a, 8)
    b = run(5, neighbours_b, 8)
    assert a == b
    assert len(set(a[0])) > 5  # really sampling
    assert all(t % 3 != 1 for t in a[0])


def test_cheap_variant_matches_full_for_plain_rows():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(S, V)).astype(np.float32) * 2)
    params = [SamplingParams(temperature=t) for t in (0.0, 0.5, 1.0, 1.5, 0.0, 0.7, 3.0, 1.0)]
    params[3] = SamplingParams(temperature=1.5, logit_bias=((1, 3.0), (2, -1.0)), logprobs=3)
    assert not sampling.batch_needs_full(params)
    assert sampling.batch_needs_full([*params[:-1], SamplingParams(top_p=0.5)])
    state = make_state(params)
    full = draw_many(logits, state, None, k_max=8, needs_full=True)
    cheap = draw_many(logits, state, None, k_max=8, needs_full=False)
    np.testing.assert_array_equal(np.asarray(full), np.asarray(cheap))


# -------------------------------------------------------------------------------------------- truncation

TRUNCATIONS = [
    SamplingParams(temperature=1.0, top_k=5),  # inside the candidates
    SamplingParams(temperature=1.0, top_k=20),  # beyond k_max=8: count bisection
    SamplingParams(temperature=1.0, top_p=0.9),  # nucleus of ~15: mass bisection when k_max=8
    SamplingParams(temperature=0.7, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=1.0, min_p=0.001),  # wide set: a second pass over the row
    SamplingParams(temperature=0.7, top_k=30, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.5, top_k=12, top_p=0.97),
]


@pytest.mark.parametrize("k_max", [8, sampling.K_MAX])
def test_truncation_obeys_definitions(k_max: int):
    x = head_logits(4)
    state = make_state(TRUNCATIONS)
    tok = np.asarray(draw_many(jnp.asarray(np.tile(x, (S, 1))), state, None, k_max=k_max))
    for row, p in enumerate(TRUNCATIONS):
        allowed = ref_allowed(x, p)
        drawn = set(tok[:, row].tolist())
        assert drawn <= set(np.flatnonzero(allowed).tolist()), (p, sorted(drawn - set(np.flatnonzero(allowed))))
        if allowed.sum() <= 20:
            assert drawn == set(np.flatnonzero(allowed).tolist()), p


def test_truncation_small_vocab_and_ties():
    # V=40 <= k_max: the candidates are the whole vocabulary. Ties at a cut are kept (threshold sets).
    x = np.linspace(3.0, -3.0, 40).astype(np.float32)
    x[[7, 8]] = x[6]  # tokens 6, 7, 8 tie: top_k=7 keeps all three
    params = [SamplingParams(temperature=1.0, top_k=7), SamplingParams(temperature=1.0, top_p=0.6),
              SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=1.0),
              SamplingParams(temperature=2.0, top_k=3, top_p=0.9), SamplingParams(temperature=0.0, top_k=3),
              SamplingParams(temperature=1.0, top_k=39), SamplingParams(temperature=1.0, top_k=100)]
    state = make_state(params, vocab=40)
    tok = np.asarray(draw_many(jnp.asarray(np.tile(x, (S, 1))), state, None))
    for row, p in enumerate(params):
        drawn = set(tok[:, row].tolist())
        allowed = set(np.flatnonzero(ref_allowed(x, p)).tolist()) if p.temperature else {0}
        assert drawn <= allowed, (p, drawn - allowed)
        if len(allowed) <= 12:
            assert drawn == allowed, p
    assert set(tok[:, 0].tolist()) == set(range(9))


@pytest.mark.parametrize("k_max", [8, sampling.K_MAX])
def test_empirical_frequencies_match(k_max: int):
    # Two rows per setting with different seeds; frequencies within 5 sigma of the exact probabilities.
    x = head_logits(5)
    plist = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9),
             SamplingParams(temperature=1.3, top_k=20), SamplingParams(temperature=1.0, min_p=0.01)]
    params = [p for p in plist for _ in range(2)]
    state = make_state(params)
    n = N_DRAWS
    tok = np.asarray(draw_many(jnp.asarray(np.tile(x, (S, 1))), state, None, k_max=k_max))
    for i, p in enumerate(plist):
        allowed = ref_allowed(x, p)
        prob = np.where(allowed, np.exp((x - x.max()) / p.temperature), 0.0)
        prob /= prob.sum()
        freq = np.bincount(tok[:, 2 * i: 2 * i + 2].ravel(), minlength=V) / (2 * n)
        sigma = np.sqrt(prob * (1 - prob) / (2 * n))
        assert np.all(np.abs(freq - prob) <= 5 * sigma + 1e-3), p


def test_temperature_moves_frequencies():
    x = np.full(V, -30.0, np.float32)
    x[:5] = [2.0, 1.0, 0.0, -1.0, -2.0]
    temps = [0.25, 0.5, 1.0, 2.0]
    params = [SamplingParams(temperature=t) for t in temps for _ in range(2)]
    tok = np.asarray(draw_many(jnp.asarray(np.tile(x, (S, 1))), make_state(params), None))
    top = [np.mean(tok[:, 2 * i: 2 * i + 2] == 0) for i in range(len(temps))]
    tail = [np.mean(tok[:, 2 * i: 2 * i + 2] >= 3) for i in range(len(temps))]
    assert top[0] > top[1] > top[2] > top[3]
    assert tail[0] < tail[1] < tail[2] < tail[3]


# ------------------------------------------------------------------------------------------------- masks


def test_pack_unpack_mask_lsb_first():
    bits = np.zeros((1, 2), np.uint32)
    bits[0, 0] = 0b101
    bits[0, 1] = 1 << 31
    got = np.asarray(sampling.unpack_mask(jnp.asarray(bits), 64))
    assert np.flatnonzero(got[0]).tolist() == [0, 2, 63]
    rand = np.random.default_rng(6).random((3, 77)) < 0.3
    np.testing.assert_array_equal(np.asarray(sampling.unpack_mask(jnp.asarray(sampling.pack_mask(rand)), 77)),
                                  rand)
    with pytest.raises(ValueError):
        sampling.unpack_mask(jnp.asarray(bits), 100)


def test_mask_never_violated():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(S, V)).astype(np.float32) * 3
    mask = rng.random((S, V)) < np.array([0.5, 0.1, 0.01, 0.003, 0.5, 0.05, 0.9, 0.2])[:, None]
    mask[3] = False
    mask[3, [17, 999]] = True  # two allowed tokens, equally likely
    logits[3, [17, 999]] = -50.0
    logits[5, mask[5]] -= 100.0  # allowed tokens far below disallowed ones
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=2.0, top_k=3),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, min_p=0.5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.95),
              SamplingParams(temperature=5.0, top_k=20), SamplingParams(temperature=1.0, min_p=0.0001)]
    tok = np.asarray(draw_many(jnp.asarray(logits), make_state(params), jnp.asarray(sampling.pack_mask(mask)),
                               k_max=8))
    for row in range(S):
        assert mask[row, tok[:, row]].all(), row
    assert set(tok[:, 3].tolist()) == {17, 999}


def test_all_zero_mask_row_returns_minus_one():
    logits = jnp.asarray(np.random.default_rng(8).normal(size=(S, V)).astype(np.float32))
    mask = np.ones((S, V), np.bool_)
    mask[[1, 6]] = False
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 4 + [SamplingParams(temperature=0.0)] * 4
    state = make_state(params)
    tok, lp, top_ids, top_lp, new = SAMPLE(logits, state, jnp.asarray(sampling.pack_mask(mask)), steps(),
                                           ACTIVE, num_top=5)
    tok, lp = np.asarray(tok), np.asarray(lp)
    assert tok[1] == -1 and tok[6] == -1 and lp[1] == -np.inf and lp[6] == -np.inf
    assert (np.asarray(top_ids)[[1, 6]] == -1).all()
    assert (np.delete(tok, [1, 6]) >= 0).all() and np.isfinite(np.delete(lp, [1, 6])).all()
    counts = np.asarray(new.counts)
    assert counts[[1, 6]].sum() == 0 and counts.sum() == S - 2


# ------------------------------------------------------------------------------------ counts and logprobs


def test_counts_accumulate_only_for_active_rows_and_reset():
    logits = jnp.asarray(np.random.default_rng(9).normal(size=(S, V)).astype(np.float32))
    state = make_state([SamplingParams(temperature=1.0)] * S, prompts=[[1, 2]] * S)
    active = jnp.asarray([True, False] * 4)
    drawn = []
    for i in range(5):
        tok, *_, state = SAMPLE(logits, state, None, steps(i), active)
        drawn.append(np.asarray(tok))
    counts, seen = np.asarray(state.counts), np.asarray(state.seen)
    drawn = np.stack(drawn)
    for row in range(S):
        if row % 2:
            assert counts[row].sum() == 0 and np.flatnonzero(seen[row]).tolist() == [1, 2]
        else:
            np.testing.assert_array_equal(counts[row], np.bincount(drawn[:, row], minlength=V))
            assert set(np.flatnonzero(seen[row]).tolist()) == {1, 2} | set(drawn[:, row].tolist())
    state = sampling.set_slot(state, 2, SamplingParams(), [9], 1)
    assert np.asarray(state.counts)[2].sum() == 0
    assert np.flatnonzero(np.asarray(state.seen)[2]).tolist() == [9]
    np.testing.assert_array_equal(np.asarray(state.counts)[0], counts[0])


def test_logprobs_are_processed_untruncated():
    rng = np.random.default_rng(10)
    logits = rng.normal(size=(S, V)).astype(np.float32) * 2
    mask = rng.random((S, V)) < 0.7
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, repetition_penalty=1.3, frequency_penalty=0.5,
                             presence_penalty=0.25, logit_bias=((11, 1.5), (12, -2.0)))
              for t, k, p in [(0.0, 0, 1.0), (0.5, 5, 1.0), (1.0, 0, 0.3), (2.0, 40, 0.9)] * 2]
    prompts = [rng.integers(0, V, 30).tolist() for _ in range(S)]
    state = make_state(params, prompts=prompts)
    outputs: list[list[int]] = [[] for _ in range(S)]
    packed = jnp.asarray(sampling.pack_mask(mask))
    for i in range(4):
        tok, lp, top_ids, top_lp, state = SAMPLE(jnp.asarray(logits), state, packed, steps(i), ACTIVE,
                                                 num_top=5)
        for row, p in enumerate(params):
            x = logits[row].astype(np.float64)
            seen = sorted(set(prompts[row]) | set(outputs[row]))
            x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
            c = np.bincount(outputs[row], minlength=V)
            x -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
            for t, b in p.logit_bias:
                x[t] += b
            x[~mask[row]] = -np.inf
            ref = log_softmax(x)
            t_row = int(tok[row])
            assert mask[row, t_row]
            np.testing.assert_allclose(float(lp[row]), ref[t_row], atol=1e-4)
            order = np.argsort(-ref, kind="stable")[:5]
            np.testing.assert_array_equal(np.asarray(top_ids[row]), order)
            np.testing.assert_allclose(np.asarray(top_lp[row]), ref[order], atol=1e-4)
            assert np.all(np.diff(np.asarray(top_lp[row])) <= 0)
            if p.temperature == 0:
                assert t_row == order[0]
            outputs[row].append(t_row)


def test_rows_that_do_not_report_logprobs_skip_them_and_change_nothing_else():
    """A slot installed with logprobs=False gets logprob 0 and no top tokens (-1 / -inf); every token, every
    reporting row's logprobs and the state are what they are when every row reports, and a step where no row
    reports draws the same tokens. Its normaliser is skipped then: the logprob outputs would differ if not."""
    rng = np.random.default_rng(12)
    logits = jnp.asarray(rng.normal(size=(S, V)).astype(np.float32) * 2)
    mask = rng.random((S, V)) < 0.7
    mask[5] = False  # a row with no allowed token still reports -inf and token -1
    packed = jnp.asarray(sampling.pack_mask(mask))
    params = [SamplingParams(temperature=t, top_p=p, repetition_penalty=1.2) for t, p in [(0.0, 1.0), (0.9, 0.8)] * 4]

    def run(reports: list[bool]):
        state = sampling.init_state(S, V)
        for row, (p, flag) in enumerate(zip(params, reports, strict=True)):
            state = sampling.set_slot(state, row, p, [row], 50 + row, logprobs=flag)
        outs = []
        for step in range(3):
            *out, state = SAMPLE(logits, state, packed, steps(step), ACTIVE, num_top=4)
            outs.append([np.asarray(o) for o in out])
        return outs, state

    every, every_state = run([True] * S)
    reports = [row % 3 == 0 for row in range(S)]
    some, some_state = run(reports)
    none, _ = run([False] * S)
    for (tok, lp, ids, top_lp), (tok_s, lp_s, ids_s, top_lp_s), (tok_n, lp_n, ids_n, top_lp_n) in zip(
            every, some, none, strict=True):
        np.testing.assert_array_equal(tok_s, tok)
        np.testing.assert_array_equal(tok_n, tok)
        assert tok[5] == -1 and lp_s[5] == -np.inf and lp_n[5] == -np.inf
        for row in range(S):
            if reports[row]:
                np.testing.assert_array_equal(lp_s[row], lp[row])
                np.testing.assert_array_equal(ids_s[row], ids[row])
                np.testing.assert_array_equal(top_lp_s[row], top_lp[row])
            for (got_lp, got_ids, got_top), flags in (((lp_s, ids_s, top_lp_s), reports),
                                                       ((lp_n, ids_n, top_lp_n), [False] * S)):
                if flags[row]:
                    continue
                assert got_lp[row] == (0.0 if row != 5 else -np.inf)
                assert (got_ids[row] == -1).all() and (got_top[row] == -np.inf).all()
        assert np.all(lp[[0, 1, 2, 3, 4, 6, 7]] < 0)  # real logprobs where every row reports
    for a, b in zip(jax.tree_util.tree_leaves(every_state)[:-1], jax.tree_util.tree_leaves(some_state)[:-1],
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_block_top_k_matches_lax_top_k_with_ties():
    rng = np.random.default_rng(11)
    x = rng.integers(0, 6, size=(4, 1000)).astype(np.float32)  # heavy ties
    x[1, 500:] = -np.inf
    for k in (1, 7, 20, 200):
        got = sampling._block_top_k(sampling._to_blocks(jnp.asarray(x), 64), k)
        ref = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))


def test_bisect_threshold_exact():
    # Largest c with sum(w[x >= c]) >= target, against brute force over the distinct values; the
    # targets sit midway between consecutive f values so float32 sums cannot flip the answer.
    rng = np.random.default_rng(12)
    x = np.round(rng.normal(size=(4, 500)) * 4, 1).astype(np.float32)  # many ties
    x[1, :100] = -np.inf
    x[2] = np.abs(x[2]) + 1e-3  # all positive (one sign of the float order key)
    w = np.where(np.isfinite(x), rng.random((4, 500)), 0.0).astype(np.float32)
    w[3] = np.isfinite(x[3])  # count mode, as for top-k
    targets, expect = [], []
    for row in range(4):
        vals = np.unique(x[row][np.isfinite(x[row])])[::-1]
        f = np.array([w[row][x[row] >= c].sum(dtype=np.float64) for c in vals])
        i = rng.integers(1, len(vals) - 1)
        targets.append((f[i - 1] + f[i]) / 2)  # f(vals[i]) >= target > f(vals[i - 1])
        expect.append(vals[i])
    xs = jnp.asarray(x)
    lo = jnp.min(jnp.where(jnp.isfinite(xs), xs, jnp.inf), -1)
    got = sampling._bisect_threshold(xs, jnp.asarray(w), jnp.asarray(targets, jnp.float32), lo, xs.max(-1),
                                     jnp.asarray([True, True, True, True]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expect, np.float32))


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"top_k": -1}, {"top_k": 2.5}, {"top_k": True},
    {"top_p": 0.0}, {"top_p": 1.01}, {"top_p": -0.5},
    {"min_p": -0.1}, {"min_p": 1.5},
    {"seed": -1}, {"seed": 2**64}, {"seed": 1.5},
    {"repetition_penalty": 0.0}, {"repetition_penalty": -1.0},
    {"frequency_penalty": 2.5}, {"presence_penalty": -3.0},
    {"logit_bias": ((1, 101.0),)}, {"logit_bias": ((1, -100.5),)}, {"logit_bias": ((-1, 1.0),)},
    {"logit_bias": ((1, 1.0), (1, 2.0))}, {"logit_bias": ((1, 2, 3),)},
    {"logit_bias": tuple((i, 1.0) for i in range(sampling.MAX_LOGIT_BIAS + 1))},
    {"logprobs": 21}, {"logprobs": -1},
])
def test_params_validation(kwargs: dict):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_params_accepts_edges_and_dict_bias():
    p = SamplingParams(temperature=0, top_p=1.0, min_p=1.0, seed=2**64 - 1, logit_bias={5: -100, 6: 100},
                       logprobs=20, frequency_penalty=-2, presence_penalty=2)
    assert p.logit_bias == ((5, -100.0), (6, 100.0))
    assert p.greedy and p.needs_full
    assert not SamplingParams(temperature=0.0, top_k=5).needs_full  # truncation is moot when greedy


def test_set_slot_validation():
    state = sampling.init_state(2, 50)
    with pytest.raises(ValueError):
        sampling.set_slot(state, 2, SamplingParams(), [], 0)
    with pytest.raises(ValueError):
        sampling.set_slot(state, 0, SamplingParams(), [50], 0)
    with pytest.raises(ValueError):
        sampling.set_slot(state, 0, SamplingParams(logit_bias=((50, 1.0),)), [], 0)
    with pytest.raises(ValueError):
        sampling.set_slot(state, 0, SamplingParams(), [], -5)


# ------------------------------------------------------------------------------------- an external reference


def test_repetition_penalty_and_bias_equal_transformers_logits_processors():
    """The repetition penalty means what transformers' RepetitionPenaltyLogitsProcessor (the reference vLLM and
    llama.cpp follow: divide a seen token's positive logit, multiply a negative one, over prompt and output) and
    its SequenceBiasLogitsProcessor compute: the sampler's logprobs (log_softmax of its processed logits) equal
    log_softmax of transformers' processed scores for the same prompt + output ids."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, size=(S, V)).astype(np.float32)
    penalties = [1.0, 1.1, 1.3, 2.0, 0.8, 1.5, 1.05, 3.0]
    prompts = [list(rng.integers(0, V, size=int(rng.integers(0, 40)))) for _ in range(S)]
    bias = ((int(rng.integers(0, V)), 2.5), (int(rng.integers(0, V)), -4.0))
    params = [SamplingParams(temperature=0.0, repetition_penalty=p, logit_bias=bias) for p in penalties]
    state = make_state(params, prompts=prompts)
    *_, top_ids, top_lps, _ = SAMPLE(jnp.asarray(logits), state, None, steps(0), ACTIVE, num_top=V)
    got = np.full((S, V), -np.inf)
    np.put_along_axis(got, np.asarray(top_ids), np.asarray(top_lps, np.float64), axis=1)
    for row in range(S):
        ids = torch.tensor([prompts[row] or [0]], dtype=torch.long)
        scores = torch.tensor(logits[row:row + 1])
        if prompts[row]:
            scores = RepetitionPenaltyLogitsProcessor(penalties[row])(ids, scores)
        scores = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})(ids, scores)
        want = torch.log_softmax(scores.double(), dim=-1)[0].numpy()
        np.testing.assert_allclose(got[row], want, rtol=0, atol=2e-5, err_msg=f"row {row}")


def test_set_slots_installs_each_row_and_leaves_the_others() -> None:
    """One program call installs an iteration's admissions: every field of the named slots as its request
    says (vocabulary-wide flags packed on the host, unpacked on the device), the other slots untouched."""
    from core import dry

    history = 16
    before = sampling.init_state(4, V, history=history)
    before = before._replace(counts=jnp.ones_like(before.counts), temperature=jnp.full((4,), 0.5, jnp.float32))
    dry_on = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.2,
                            presence_penalty=0.3, top_k=V + 5, logit_bias=((7, 2.0), (999, -1.0)),
                            dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=3, dry_penalty_last_n=-1)
    plain = SamplingParams(top_k=40)
    prompt_a, prompt_b = [5, 6, 5, 6, 999], [0, 31, 32, 33, 64]
    breakers = np.array([6, 998], np.int32)
    state = sampling.set_slots(before, [
        sampling.SlotRequest(3, dry_on, prompt_a, 2**40 + 3, breakers, logprobs=False),
        sampling.SlotRequest(1, plain, prompt_b, 12),
    ])
    got = jax.tree_util.tree_map(np.asarray, state)
    old = jax.tree_util.tree_map(np.asarray, before)
    for untouched in (0, 2):
        for name, a in zip(got._fields, got, strict=True):
            if name != "dry":
                assert np.array_equal(a[untouched], getattr(old, name)[untouched]), name
    a, b = 3, 1
    np.testing.assert_array_equal(got.temperature[[a, b]], np.float32([0.7, plain.temperature]))
    np.testing.assert_array_equal(got.top_p[[a, b]], np.float32([0.9, plain.top_p]))
    np.testing.assert_array_equal(got.min_p[a], np.float32(0.05))
    np.testing.assert_array_equal(got.repetition_penalty[a], np.float32(1.1))
    np.testing.assert_array_equal(got.frequency_penalty[a], np.float32(0.2))
    np.testing.assert_array_equal(got.presence_penalty[a], np.float32(0.3))
    assert got.top_k[a] == 0 and got.top_k[b] == 40  # k >= V keeps everything
    assert got.key[a].tolist() == [2**40 + 3 >> 32, (2**40 + 3) & 0xFFFFFFFF] and got.key[b].tolist() == [0, 12]
    assert not got.counts[[a, b]].any()
    assert sorted(np.flatnonzero(got.seen[a])) == sorted(set(prompt_a))
    assert sorted(np.flatnonzero(got.seen[b])) == sorted(prompt_b)  # bits at word edges (31, 32, 64)
    assert got.bias_ids[a, :3].tolist() == [7, 999, V] and got.bias_vals[a, :2].tolist() == [2.0, -1.0]
    assert got.bias_ids[b].tolist() == [V] * sampling.MAX_LOGIT_BIAS
    assert got.logprobs[a] == 0 and got.logprobs[b] == 1
    d = got.dry
    np.testing.assert_array_equal(d.multiplier[[a, b]], np.float32([0.8, plain.dry_multiplier]))
    np.testing.assert_array_equal(d.base[a], np.float32(1.75))
    assert d.allowed[a] == 3 and d.window[a] == history and d.window[b] == 0
    assert d.max_exp[a] == dry.max_exponent(1.75) and d.length[a] == len(prompt_a) and d.length[b] == 0
    assert d.history[a].tolist() == prompt_a + [0] * (history - len(prompt_a))
    assert d.match[a].tolist() == dry.prompt_matches(prompt_a, history, history).tolist()
    assert np.flatnonzero(d.breaker[a]).tolist() == [6, 998] and not d.breaker[b].any()
    with pytest.raises(ValueError, match="twice"):
        sampling.set_slots(before, [sampling.SlotRequest(1, plain, [], 0), sampling.SlotRequest(1, plain, [], 1)])
