"""The scheduler on a tiny random model with the real vocabulary and tokenizer: continuous batching,
slot affinity, prefix caching (same slot, another slot, host tier) that never changes output,
fairness, bounded queue, cancellation and stop strings."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from core.engine import Engine, EngineConfig
from core.sampling import SamplingParams
from core.weights import random_params
from scheduler.request import ContextLengthError, FinishEvent, FinishReason, GenerationRequest, QueueFullError
from scheduler_helpers import GREEDY, VOCAB, cold, ids, make, request, run_all
from tiny_models import GEMMA3, WINDOW


@pytest.fixture(scope="module")
def engine(compile_cache):
    from core.config import ModelConfig

    cfg = ModelConfig.from_hf_dict({**GEMMA3, "vocab_size": VOCAB})
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=5)
    eng = Engine(cfg, params, EngineConfig(num_slots=8, max_len=160, chunk_sizes=(4, 16)), "float32")
    eng.warmup()
    return eng


def test_second_turn_prefills_only_new_tokens_in_the_same_slot(engine, tokenizer):
    sched = make(engine, tokenizer)
    p1 = ids(1, 3 * WINDOW + 5)
    g1, _, fin1 = run_all(sched, [request(p1, affinity="s1")])[0]
    assert fin1.usage.cached_tokens == 0
    p2 = p1 + tuple(g1) + ids(2, 7)
    before = sched.stats.prefill_tokens
    g2, _, fin2 = run_all(sched, [request(p2, affinity="s1")])[0]
    assert fin2.usage.cached_tokens == len(p1) + len(g1) - 1  # the last sampled token was never fed
    assert sched.stats.prefill_tokens - before == 7 + 1
    assert sched.kv.stats.slot_reuses == 1
    assert g2 == cold(engine, tokenizer, request(p2))


def test_full_hit_recomputes_only_the_last_prompt_token(engine, tokenizer):
    """The slot moved past the prompt (its ring no longer holds the prompt's end), so the hit comes from
    the host snapshot hinted at the prompt's end."""
    sched = make(engine, tokenizer)
    p = ids(3, 2 * WINDOW + 3)
    first = run_all(sched, [request(p, affinity="a", boundaries=(len(p),))])[0]
    again = run_all(sched, [request(p, affinity="b")])[0]
    assert again[2].usage.cached_tokens == len(p) - 1
    assert again[0] == first[0] == cold(engine, tokenizer, request(p))


def test_prefix_from_another_busy_slot_is_copied_on_device(engine, tokenizer):
    sched = make(engine, tokenizer)
    p = ids(4, WINDOW - 2)  # within one window: another slot can serve a partial prefix
    a = sched.submit(request(p, max_tokens=20, affinity="a"))
    sched.step()
    b_prompt = p + ids(5, 4)
    b = sched.submit(request(b_prompt, affinity="b"))
    sched.run_until_idle()
    assert sched.kv.stats.device_copies == 1
    fin_b = b.result(timeout=0)
    assert fin_b[2].usage.cached_tokens == len(p)
    assert fin_b[0] == cold(engine, tokenizer, request(b_prompt))
    assert a.result(timeout=0)[0] == cold(engine, tokenizer, request(p, max_tokens=20))


def test_evicted_session_comes_back_from_the_host_tier(engine, tokenizer):
    sched = make(engine, tokenizer)
    p1 = ids(6, 4 * WINDOW)
    g1 = run_all(sched, [request(p1, affinity="home")])[0][0]
    # Eight other sessions take every slot, so "home" is evicted to the host tier.
    run_all(sched, [request(ids(100 + i, 20), affinity=f"other{i}") for i in range(8)])
    assert all(slot.affinity != "home" for slot in sched.slots)
    assert sched.kv.stats.host_saves >= 1
    p2 = p1 + tuple(g1) + ids(7, 5)
    g2, _, fin = run_all(sched, [request(p2, affinity="home")])[0]
    assert sched.kv.stats.host_restores == 1
    assert fin.usage.cached_tokens == len(p1) + len(g1) - 1
    assert g2 == cold(engine, tokenizer, request(p2))


def test_outputs_with_caching_equal_outputs_without(engine, tokenizer):
    """32 sessions of 4 agents sharing per-agent system prompts (longer than the window), three turns,
    over 8 slots: every output equals its cold single-request result; system prompts hit after first use.
    Cold results come first (each request alone, caching off), since both runs share the engine's slots."""
    agents = [f"agent{a}" for a in range(4)]
    system = {a: ids(200 + i, 3 * WINDOW + 2) for i, a in enumerate(agents)}
    sessions = [(f"s{i}", agents[i % 4]) for i in range(32)]
    turns: list[list[GenerationRequest]] = []
    expected: list[list[list[int]]] = []
    history = {s: system[a] for s, a in sessions}
    for turn in range(3):
        reqs, outs = [], []
        for i, (s, a) in enumerate(sessions):
            history[s] = history[s] + ids(1000 * turn + i, 3)
            reqs.append(request(history[s], max_tokens=4, affinity=s, group=a, cache_scope=a,
                                boundaries=(len(system[a]),)))
            outs.append(cold(engine, tokenizer, reqs[-1]))
            history[s] = history[s] + tuple(outs[-1])
        turns.append(reqs)
        expected.append(outs)

    sched = make(engine, tokenizer)
    for turn, reqs in enumerate(turns):
        results = run_all(sched, reqs)
        for (s, a), want, (out, _, fin) in zip(sessions, expected[turn], results, strict=True):
            assert out == want, (turn, s)
            if turn > 0:
                assert fin.usage.cached_tokens >= len(system[a])
        if turn == 0:
            hits = [fin.usage.cached_tokens >= len(system[a]) for (_, a), (_, _, fin) in zip(sessions, results,
                                                                                           strict=True)]
            # The first 8 are admitted together before any system prompt is cached; all later ones hit.
            assert sum(hits) >= 32 - 8
    assert sched.stats.cached_tokens > 0.5 * sched.stats.prompt_tokens


def test_new_request_joins_the_running_batch(engine, tokenizer):
    sched = make(engine, tokenizer)
    running = [sched.submit(request(ids(300 + i, 10), max_tokens=30)) for i in range(7)]
    sched.step()
    while sched.prefilling:  # until all seven are decoding
        sched.step()
    submitted_at = sched.iteration
    late = sched.submit(request(ids(400, 10), max_tokens=3))
    for _ in range(3):
        sched.step()
    first_late = next(iter(late.events(timeout=0)))
    assert first_late.iteration <= submitted_at + 1  # prefilled and sampled in the next iteration
    assert late.finished is not None and late.finished.reason is FinishReason.LENGTH
    assert all(h.finished is None for h in running)  # the others are still decoding
    sched.run_until_idle()


def test_leftover_budget_is_not_cut_into_smallest_chunks_of_a_long_prompt(engine, tokenizer):
    """Per token a smallest chunk costs about twice a larger one on CPU: once a prompt is planned, what is left
    of the budget does not start another prompt in smallest chunks that a larger chunk would take whole next
    iteration (a prompt's own short tail still runs in them), and the outputs are the cold ones."""
    sched = make(engine, tokenizer, prefill_budget=24)  # chunks (4, 16)
    short, long = request(ids(500, 18), max_tokens=3), request(ids(501, 40), max_tokens=3)
    handles = [sched.submit(short), sched.submit(long)]
    sched.step()  # the short prompt: 16 + its 2-token tail (padded to 4); 4 of the budget left
    seqs = {seq.request.prompt_ids: seq for seq in sched.planner.prefilling}
    assert short.prompt_ids not in seqs and seqs[long.prompt_ids].cursor == 0
    sched.run_until_idle()
    assert [h.result(timeout=0)[0] for h in handles] == [cold(engine, tokenizer, r) for r in (short, long)]


def test_long_prompt_delays_running_streams_by_at_most_one_chunk_per_token(engine, tokenizer):
    sched = make(engine, tokenizer)
    running = [sched.submit(request(ids(500 + i, 6), max_tokens=25)) for i in range(7)]
    sched.step()
    sched.step()
    chunks_before = sched.stats.prefill_chunks
    long_prompt = sched.submit(request(ids(600, 150), max_tokens=2))
    sched.run_until_idle()
    assert sched.stats.prefill_chunks - chunks_before >= 150 // 16  # it took many iterations to prefill
    for handle in running:
        iterations = [e.iteration for e in handle.events(timeout=0) if not isinstance(e, FinishEvent)]
        assert np.all(np.diff(iterations) <= 1)  # a token every iteration: never stalled by the prefill
    assert long_prompt.finished.usage.completion_tokens == 2


def test_fair_share_across_agents(engine, tokenizer):
    sched = make(engine, tokenizer)
    busy = [sched.submit(request(ids(700 + i, 5), max_tokens=2, group="busy")) for i in range(40)]
    quiet = [sched.submit(request(ids(800 + i, 5), max_tokens=2, group="quiet")) for i in range(3)]
    sched.run_until_idle()
    first = lambda h: next(iter(h.events(timeout=0))).iteration  # noqa: E731
    last_busy = max(first(h) for h in busy)
    assert max(first(h) for h in quiet) < last_busy / 2  # quiet agent is not starved behind the backlog
    # Priority 3 gets three admissions for every one of priority 1.
    sched = make(engine, tokenizer)
    low = [sched.submit(request(ids(900 + i, 5), max_tokens=1, group="low")) for i in range(30)]
    high = [sched.submit(request(ids(950 + i, 5), max_tokens=1, group="high", priority=3)) for i in range(30)]
    sched.run_until_idle()
    order = sorted(low + high, key=lambda h: (first(h), h in low))[:24]
    served_high = sum(h in high for h in order)
    assert served_high >= 2.5 * (len(order) - served_high) > 0


def test_bounded_queue_rejects_when_full(engine, tokenizer):
    sched = make(engine, tokenizer, max_waiting=3)
    for i in range(3):
        sched.submit(request(ids(i, 5)))
    with pytest.raises(QueueFullError):
        sched.submit(request(ids(9, 5)))
    sched.run_until_idle()
    sched.submit(request(ids(10, 5)))  # room again
    sched.run_until_idle()


def test_prompt_longer_than_the_slot_is_rejected_up_front(engine, tokenizer):
    sched = make(engine, tokenizer)
    with pytest.raises(ContextLengthError, match=f"the context holds {engine.max_len}"):
        sched.submit(request(ids(11, engine.max_len)))


def test_generation_stops_at_the_end_of_the_slot(engine, tokenizer):
    sched = make(engine, tokenizer)
    prompt = ids(12, engine.max_len - 3)
    out, _, fin = run_all(sched, [request(prompt, max_tokens=50)])[0]
    assert fin.reason is FinishReason.LENGTH and len(out) == 4


def test_cancellation_frees_the_slot_within_one_iteration(engine, tokenizer):
    sched = make(engine, tokenizer)
    handle = sched.submit(request(ids(13, 10), max_tokens=100))
    waiting_one = sched.submit(request(ids(14, 10), max_tokens=100))
    sched.step()
    handle.cancel()
    waiting_one.cancel()
    sched.step()
    assert handle.finished.reason is FinishReason.CANCELLED
    assert waiting_one.finished.reason is FinishReason.CANCELLED
    assert not any(slot.busy for slot in sched.slots)
    assert sched.stats.cancelled == 2


def test_stop_string_split_across_tokens_is_not_emitted(engine, tokenizer):
    prompt = ids(15, 12)
    base_ids, base_text, _ = run_all(make(engine, tokenizer), [request(prompt, max_tokens=12)])[0]
    pieces = [tokenizer.decode([t]) for t in base_ids]
    # A stop string straddling the boundary between two tokens' texts, in the middle of the output.
    k = next(i for i in range(3, len(pieces) - 1) if pieces[i] and pieces[i + 1])
    cut = len("".join(pieces[:k]))
    stop = base_text[cut - 1:cut + 1] if cut > 0 else base_text[:2]
    start = base_text.find(stop)
    out_ids, text, fin = run_all(make(engine, tokenizer), [request(prompt, max_tokens=12, stop=(stop,))])[0]
    assert fin.reason is FinishReason.STOP and fin.stop_sequence == stop  # which stop ended it
    assert text == base_text[:start]
    assert stop not in text


def test_threaded_loop_serves_sync_and_asyncio_callers(engine, tokenizer):
    sched = make(engine, tokenizer)
    sched.start()
    try:
        prompt = ids(16, 9)
        expected = cold(engine, tokenizer, request(prompt))
        assert sched.submit(request(prompt)).result(timeout=60)[0] == expected

        async def stream():
            handle = sched.submit(request(prompt), loop=asyncio.get_running_loop())
            return [e.token_id async for e in handle if not isinstance(e, FinishEvent)]

        assert asyncio.run(stream()) == expected
    finally:
        sched.stop()


def test_the_engine_loop_tells_the_engine_when_it_serves_and_when_it_waits(engine, tokenizer, monkeypatch):
    """A background warm-up holds back unrequested programs while steps run (core.programs.ProgramTable):
    the loop says so when work arrives and again when it runs out, once each, also when stopped busy."""
    calls: list[bool] = []
    monkeypatch.setattr(engine, "serving", calls.append)
    sched = make(engine, tokenizer)
    sched.start()
    try:
        sched.submit(request(ids(16, 9), max_tokens=3)).result(timeout=60)
        deadline = time.monotonic() + 10
        while calls != [False, True, False] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls == [False, True, False]  # quiet counts from the loop's start, then from each pause
        sched.submit(request(ids(16, 10), max_tokens=400))
        deadline = time.monotonic() + 10
        while len(calls) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sched.stop()
    assert calls == [False, True, False, True, False]


def test_speedups_wait_until_their_programs_are_compiled(engine, tokenizer):
    """While a background warm-up has not compiled the verify or batched-prefill programs, a greedy stream
    decodes plainly (same tokens) and short prompts prefill one by one instead of waiting for them; once
    they are compiled both speedups run."""
    fresh = Engine(engine.cfg, engine.params, engine.config, "float32")  # nothing compiled ahead
    prompt = ids(40, 12) * 4
    sched = make(fresh, tokenizer)
    early = run_all(sched, [request(prompt, max_tokens=12)])[0]
    assert sched.stats.speculative_steps == 0 and not fresh.compiled_for("verify", [0])
    shorts = [request(ids(60 + i, 10), max_tokens=2) for i in range(fresh.num_slots)]  # batched-prefill sized
    sched = make(fresh, tokenizer)
    run_all(sched, shorts)
    assert sched.stats.batched_prefills == 0 and not fresh.compiled_for("prefill_rows", [0])
    fresh.warmup()
    sched = make(fresh, tokenizer)
    late = run_all(sched, [request(prompt, max_tokens=12)])[0]
    assert sched.stats.speculative_steps > 0 and late[0] == early[0]
    sched = make(fresh, tokenizer)
    run_all(sched, shorts)
    assert sched.stats.batched_prefills > 0


def test_lone_greedy_stream_speculates_and_yields_exactly_the_plain_tokens(engine, tokenizer):
    prompt = ids(40, 12) * 4  # repetitive, so prompt lookup finds drafts from the start
    for max_tokens in (40, 9):  # 9: the length limit lands inside a multi-token step
        plain_sched = make(engine, tokenizer, speculative=False)
        plain = run_all(plain_sched, [request(prompt, max_tokens=max_tokens)])[0]
        sched = make(engine, tokenizer)
        spec = run_all(sched, [request(prompt, max_tokens=max_tokens)])[0]
        assert spec[0] == plain[0] and len(spec[0]) == max_tokens and spec[1] == plain[1]
        assert spec[2].reason is plain[2].reason is FinishReason.LENGTH
        assert sched.stats.speculative_steps > 0 and plain_sched.stats.speculative_steps == 0
        assert sched.stats.decode_steps == plain_sched.stats.decode_steps - sched.stats.accepted_draft_tokens
        # The slot holds what it computed: a follow-up turn reuses it as a cached prefix.
        follow = prompt + tuple(spec[0]) + ids(41, 3)
        again = run_all(sched, [request(follow, max_tokens=4)])[0]
        assert again[0] == cold(engine, tokenizer, request(follow, max_tokens=4))
        assert again[2].usage.cached_tokens >= len(prompt)


@pytest.fixture(scope="module")
def exact_engine(engine):
    """The CPU serving default: W8A8 weights and int8 KV, where batched verification is exact."""
    from core.weights import to_w8a8

    eng = Engine(engine.cfg, to_w8a8(engine.params), EngineConfig(num_slots=8, max_len=160, chunk_sizes=(4, 16),
                                                                   kv_dtype="int8", rows_verify_width=3), "float32")
    eng.warmup()
    return eng


def test_greedy_streams_share_batched_verify_steps_and_yield_exactly_the_plain_tokens(exact_engine, tokenizer):
    """Five plain-greedy streams (repetitive prompts, so prompt lookup drafts) run batched verify steps; every
    output equals plain decoding's, including lengths that end inside a multi-token step. With one penalised
    stream among them, nobody speculates in a batch (its draws depend on the tokens before them, counted by the
    sampler) and outputs still match."""
    engine = exact_engine
    assert engine.rows_verify_exact
    prompts = [ids(60 + i, 6 + i) * 4 for i in range(5)]
    lengths = [30, 9, 17, 30, 5]
    for penalised in (False, True):
        if penalised:  # the penalised stream is prefilled first and outlives the greedy ones
            lengths[0] = 40
        reqs = [request(p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
        if penalised:
            reqs[0] = request(prompts[0], max_tokens=40,
                              sampling=SamplingParams(temperature=0.8, seed=7, repetition_penalty=1.2))
        plain_sched = make(engine, tokenizer, speculative=False, prefix_caching=False)
        plain = run_all(plain_sched, reqs)
        sched = make(engine, tokenizer, prefix_caching=False)
        spec = run_all(sched, reqs)
        for got, want, n in zip(spec, plain, lengths, strict=True):
            assert got[0] == want[0] and len(got[0]) == n and got[1] == want[1]
            assert got[2].reason is want[2].reason is FinishReason.LENGTH
        if penalised:
            assert sched.stats.batched_speculative_steps == 0
        else:
            assert sched.stats.batched_speculative_steps > 0 and sched.stats.accepted_draft_tokens > 0
            assert sched.stats.decode_steps < plain_sched.stats.decode_steps


@pytest.fixture(scope="module")
def three_slot_exact_engine(engine):
    """`exact_engine` with three slots. A sampled draw shows a verify row's last-bit difference from its decode
    row where a greedy one seldom does, and on a Zen 4 host this tiny model's rows differed at eight slots
    (24 verify rows against 8 decode rows) at about half the positions, though not at three
    (tests/test_batched_verify.py checks three slots of the tiny families and eight of the default model)."""
    from core.weights import to_w8a8

    eng = Engine(engine.cfg, to_w8a8(engine.params), EngineConfig(num_slots=3, max_len=160, chunk_sizes=(4, 16),
                                                                   kv_dtype="int8", rows_verify_width=3), "float32")
    eng.warmup()
    return eng


def test_sampled_streams_speculate_and_yield_exactly_the_plain_tokens(three_slot_exact_engine, tokenizer,
                                                                      monkeypatch):
    """Seeded sampled streams (temperature alone; with top-k, top-p and min-p as llama.cpp's defaults; with a
    logit bias) and a greedy one, on repetitive prompts, three at a time: batched verify steps draw each
    position at its own step, so every output equals plain decoding's, token for token, lengths ending inside
    a multi-token step included; the last stream left verifies on its own, with the same tokens."""
    exact_engine = three_slot_exact_engine
    # Two streams draw a biased token about half the time (the random model's logits are nearly flat over 262k
    # tokens), so their drafts of it are accepted and rejected by chance; the longest ends alone.
    biased = {1234: 12.5}
    samplings = [SamplingParams(temperature=1.0, logit_bias=biased, seed=7),
                 SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=8),
                 SamplingParams(temperature=0.9, logit_bias=biased, seed=9), GREEDY]
    reqs = [request(ids(80 + i, 5 + i) * 5, max_tokens=n, sampling=p)
            for i, (p, n) in enumerate(zip(samplings, (50, 9, 40, 14), strict=True))]
    plain_sched = make(exact_engine, tokenizer, speculative=False, prefix_caching=False)
    plain = run_all(plain_sched, reqs)
    sched = make(exact_engine, tokenizer, prefix_caching=False)
    monkeypatch.setattr(sched.times, "rows_verify_cost", lambda: 1.0)  # every draft pays: verify all along
    spec = run_all(sched, reqs)
    for got, want, req in zip(spec, plain, reqs, strict=True):
        assert got[0] == want[0] and len(got[0]) == req.max_tokens and got[1] == want[1]
    assert len({tuple(p[0]) for p in plain}) == len(reqs) and 0.2 < plain[0][0].count(1234) / 50 < 0.8
    assert sched.stats.batched_speculative_steps > 0 and sched.stats.accepted_draft_tokens > 0
    assert sched.stats.speculative_steps > sched.stats.batched_speculative_steps  # the lone stream's own
    assert sched.stats.decode_steps < plain_sched.stats.decode_steps


def test_a_lone_stream_verifies_in_the_batched_program_until_its_own_is_loaded(exact_engine, tokenizer,
                                                                              monkeypatch):
    """Right after a restart the lone-stream verify program may still be loading while the batched one is
    ready (a first wave's slowest stream ends alone): the lone stream verifies its drafts there, with the plain
    tokens, rather than decoding one token a step."""
    req = request(ids(64, 10) * 4, max_tokens=30)
    plain = run_all(make(exact_engine, tokenizer, speculative=False), [req])[0]
    loaded = exact_engine.compiled_for
    monkeypatch.setattr(exact_engine, "compiled_for",
                        lambda kind, positions: kind != "verify" and loaded(kind, positions))
    sched = make(exact_engine, tokenizer)
    monkeypatch.setattr(sched.times, "rows_verify_cost", lambda: 1.0)  # so that one-token drafts pay too
    got = run_all(sched, [req])[0]
    assert got[0] == plain[0] and got[1] == plain[1]
    assert sched.stats.speculative_steps == sched.stats.batched_speculative_steps > 0
    assert sched.stats.accepted_draft_tokens > 0


def test_a_stream_that_may_not_speculate_never_asks_for_a_verify_program(engine, tokenizer, monkeypatch):
    """A step's ask loads a program on the warm-up thread while serving (core.programs.ASKS_WHILE_SERVING):
    a lone penalised stream, which never verifies, must not ask for one."""
    asked: list[str] = []
    loaded = engine.compiled_for
    monkeypatch.setattr(engine, "compiled_for", lambda kind, positions: asked.append(kind) or loaded(kind, positions))
    penalised = request(ids(64, 10) * 4, max_tokens=12,
                        sampling=SamplingParams(temperature=0.8, seed=3, frequency_penalty=0.5))
    run_all(make(engine, tokenizer), [penalised])
    assert not any(kind.startswith("verify") for kind in asked)
    run_all(make(engine, tokenizer), [request(ids(64, 10) * 4, max_tokens=12)])  # a greedy one does ask
    assert "verify" in asked


def test_batched_verify_is_skipped_when_it_costs_more_than_its_drafts_gain(exact_engine, tokenizer):
    """The same repetitive streams, but batched verify passes measured 50x a decode step: no expected
    acceptance pays for that, so the streams decode step by step together, with the same outputs."""
    reqs = [request(ids(60 + i, 6 + i) * 4, max_tokens=12) for i in range(3)]
    plain = run_all(make(exact_engine, tokenizer, speculative=False, prefix_caching=False), reqs)
    sched = make(exact_engine, tokenizer, prefix_caching=False)
    sched.times.record("decode", 0.01)  # as if both had been measured
    sched.times.record("verify_rows", 0.5)
    assert sched.times.rows_verify_cost() == 50
    got = run_all(sched, reqs)
    assert [g[0] for g in got] == [p[0] for p in plain]
    assert sched.stats.batched_speculative_steps == 0  # (a stream left alone may still verify on its own)


def test_new_streams_start_from_the_pooled_draft_record(exact_engine, tokenizer, monkeypatch):
    """A batched verify dearer than drafts of two at an even chance pay for (1.9 decode steps against 1.75
    expected tokens a row) is declined for new streams with no record; once recent streams' drafts were
    accepted 95 times in 100, new streams start from that record and verify from their first steps, with the
    outputs of plain decoding either way. (The prior alone: declined drafts checked against decode steps, which
    correct it, are left out here; the next test covers them.)"""
    reqs = [request(ids(60 + i, 6 + i) * 4, max_tokens=12) for i in range(3)]
    plain = run_all(make(exact_engine, tokenizer, speculative=False, prefix_caching=False), reqs)
    runs = {}
    for pooled in (None, (100, 95)):
        sched = make(exact_engine, tokenizer, prefix_caching=False)
        monkeypatch.setattr(sched.times, "rows_verify_cost", lambda: 1.9)
        monkeypatch.setattr(sched, "_record_declined", lambda *args: None)
        if pooled:
            sched.drafts.record(*pooled)
        assert [g[0] for g in run_all(sched, reqs)] == [p[0] for p in plain]
        runs[pooled] = sched.stats.batched_speculative_steps
    assert runs[None] == 0 and runs[(100, 95)] > 0


def test_declined_drafts_checked_against_decode_steps_bring_verify_steps_back(exact_engine, tokenizer,
                                                                              monkeypatch):
    """Drafts judged hopeless from a poor record (recent drafts accepted 0 times in 100) are declined, but each
    declined draft's first token is checked against the token the decode step gave: as the streams fall into
    repeats their drafts match, the estimates rise and batched verify steps resume, with plain decoding's
    outputs. Without those checks nothing would correct the record and the streams would decode to the end."""
    reqs = [request(ids(60 + i, 6 + i) * 4, max_tokens=40) for i in range(3)]
    plain = run_all(make(exact_engine, tokenizer, speculative=False, prefix_caching=False), reqs)
    runs = {}
    for checked in (True, False):
        sched = make(exact_engine, tokenizer, prefix_caching=False)
        monkeypatch.setattr(sched.times, "rows_verify_cost", lambda: 1.5)
        if not checked:
            monkeypatch.setattr(sched, "_record_declined", lambda *args: None)
        sched.drafts.record(100, 0)
        assert [g[0] for g in run_all(sched, reqs)] == [p[0] for p in plain]
        runs[checked] = (sched.stats.batched_speculative_steps, sched.stats.decode_steps, sched.drafts.rate)
    assert runs[True][0] > 0 and runs[True][1] < runs[False][1]
    assert runs[False][0] == 0 and runs[True][2] > 10 * runs[False][2]


def test_the_pooled_draft_record_follows_recent_verify_steps() -> None:
    from scheduler.speculation import DraftRate

    rate = DraftRate()
    assert rate.rate == 0.5  # no draft yet: an even chance
    for _ in range(100):
        rate.record(16, 4)  # a quarter accepted, for long
    assert rate.rate == pytest.approx(0.25, abs=0.01)
    for _ in range(60):  # then every draft accepted: the old record fades
        rate.record(16, 16)
    assert rate.rate > 0.95


def test_no_batched_verify_where_products_are_not_exact(engine, tokenizer):
    """float32 GEMMs may round differently by row count, so the float engine never verifies in a batch."""
    assert not engine.rows_verify_exact
    sched = make(engine, tokenizer)
    run_all(sched, [request(ids(70 + i, 8) * 3, max_tokens=8) for i in range(3)])
    assert sched.stats.batched_speculative_steps == 0


def test_no_speculation_for_penalised_or_logprob_streams(engine, tokenizer):
    from scheduler.speculation import speculation_allowed

    prompt = ids(42, 10) * 3
    sched = make(engine, tokenizer)
    run_all(sched, [request(prompt, max_tokens=8,
                            sampling=SamplingParams(temperature=0.7, seed=1, presence_penalty=0.5))])
    run_all(sched, [request(prompt, max_tokens=8, want_logprobs=True)])
    assert sched.stats.speculative_steps == 0
    assert speculation_allowed(GREEDY, constrained=False, wants_logprobs=False)
    assert not speculation_allowed(GREEDY, constrained=True, wants_logprobs=False)
    for knobs in ({"repetition_penalty": 1.1}, {"frequency_penalty": 0.2}, {"presence_penalty": -0.2},
                  {"dry_multiplier": 0.8}, {"logprobs": 2}):
        assert not speculation_allowed(SamplingParams(**{"temperature": 0.5, **knobs}), False, False), knobs
    for knobs in ({"logit_bias": {5: 1.0}}, {"temperature": 0.5, "top_k": 40, "top_p": 0.9, "min_p": 0.05}):
        assert speculation_allowed(SamplingParams(**knobs), False, False), knobs


def test_short_prompts_arriving_together_are_prefilled_in_one_call(engine, tokenizer):
    """Six short prompts (greedy and seeded sampling mixed) submitted at once: one batched prefill, first
    tokens sampled together, and every output equals the request served alone.
    The batched prefill matches a lone one to float rounding (its matmuls have other shapes), not bit for
    bit. The random model's logits are nearly flat over 262k tokens, so under top-p 0.9 neighbouring tokens'
    CDF boundaries lie ~1e-6 apart and rounding alone moves a draw across one; top-k 40 keeps the draw
    seeded and per-request (the thing under test) with boundaries far apart."""
    sampled = SamplingParams(temperature=0.8, top_k=40, seed=7)
    reqs = [request(ids(60 + i, 3), max_tokens=5, sampling=sampled if i % 2 else GREEDY) for i in range(6)]
    sched = make(engine, tokenizer, prefix_caching=False)
    results = run_all(sched, reqs)
    assert sched.stats.batched_prefills == 1
    for req, got in zip(reqs, results, strict=True):
        assert got[0] == cold(engine, tokenizer, req)
    few = make(engine, tokenizer, prefix_caching=False)  # fewer than half the slots: one call each
    run_all(few, reqs[:3])
    assert few.stats.batched_prefills == 0


def test_short_prefills_advance_together_a_chunk_at_a_time(engine, tokenizer):
    """Six prompts of three smallest chunks each: batched calls take one chunk of every one until all are done
    (three calls, not eighteen), and every output equals the request served alone."""
    width = engine.row_chunk
    reqs = [request(ids(80 + i, 3 * width - i % 2), max_tokens=3) for i in range(6)]
    sched = make(engine, tokenizer, prefix_caching=False)
    results = run_all(sched, reqs)
    assert sched.stats.batched_prefills == 3 and sched.stats.prefill_chunks == 3
    for req, got in zip(reqs, results, strict=True):
        assert got[0] == cold(engine, tokenizer, req)


def test_the_least_remaining_prefill_goes_first(engine, tokenizer):
    """A long new prompt and a short one admitted together: the short one's first token does not wait for the
    long prefill."""
    sched = make(engine, tokenizer, prefill_budget=16)
    long_one = sched.submit(request(ids(90, 120), max_tokens=2))
    short_one = sched.submit(request(ids(91, 6), max_tokens=2))
    sched.run_until_idle()
    first = lambda h: next(iter(h.events(timeout=0))).iteration  # noqa: E731
    assert first(short_one) == 0 and first(long_one) >= 120 // 16 - 1


def test_prefill_chunks_end_at_message_boundaries_that_cost_no_padded_call():
    from scheduler.sequence import Sequence

    req = GenerationRequest(prompt_ids=tuple(range(1, 101)), boundaries=(3, 40, 97))
    seq = Sequence(id=0, request=req, handle=None, detokenizer=None, stop_matcher=None, max_tokens=4, seed=0)
    assert seq.next_boundary(0, 4) == 40  # 3 leaves a 3-token piece; 40 has 4+ tokens on each side
    assert seq.next_boundary(40, 4) == 100  # 97 would leave a 3-token tail
    assert seq.next_boundary(38, 4) == 100


def test_seeded_sampling_is_reproducible_and_independent_of_slot_and_neighbours(engine, tokenizer):
    target = request(ids(23, 11), max_tokens=10, sampling=SamplingParams(temperature=1.0, top_k=40, top_p=0.9,
                                                                          seed=1234))
    neighbours = [request(ids(n, n), max_tokens=m, sampling=SamplingParams(temperature=0.7, seed=n))
                  for n, m in ((5, 3), (19, 12), (7, 6), (3, 9))]

    def generated(reqs):  # caching off: every request computes its own prompt, wherever it lands
        return [r[0] for r in run_all(make(engine, tokenizer, prefix_caching=False), reqs)]

    alone = generated([target])[0]
    assert generated([target, *neighbours])[0] == alone == generated([*neighbours, target])[-1]
    other_seed = request(target.prompt_ids, max_tokens=10,
                         sampling=SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=99))
    assert generated([other_seed])[0] != alone


def test_generation_with_every_sampler_variant_compiles_nothing_new(engine, tokenizer):
    import jax

    rng = np.random.default_rng(29)
    variants = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=1),
                SamplingParams(temperature=0.8, top_p=0.5, seed=2, frequency_penalty=0.5),
                SamplingParams(temperature=0, logit_bias=((5, 10.0),), logprobs=3)]
    reqs = [request(ids(int(rng.integers(1 << 20)), int(rng.integers(2, 40))), max_tokens=int(rng.integers(1, 8)),
                    sampling=v, ignore_eos=True) for v in variants * 2]
    run_all(make(engine, tokenizer), reqs[:1])  # eager helper ops of the scheduler itself
    compiles = []
    listener = lambda name, *_, **__: compiles.append(name)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        results = run_all(make(engine, tokenizer), reqs)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert [len(r[0]) for r in results] == [r.max_tokens for r in reqs]
    assert [c for c in compiles if c == "/jax/core/compile/backend_compile_duration"] == []


def test_a_dry_request_follows_its_definition_through_the_scheduler(engine, tokenizer):
    """A greedy DRY request (llama.cpp's default breakers) batched with a plain one: each token is the argmax
    of the cold prefill's logits lowered by DRY's penalties as tests/test_dry.py defines them, the first
    token (sampled after the prefill) included; DRY changes what the model says, and a prefix-cache hit gives
    the same output."""
    from test_dry import reference_penalties

    from core.dry import BreakerTables

    prompt = ids(70, 7) * 4  # repeats: runs to penalise from the first token on
    params = SamplingParams(temperature=0.0, dry_multiplier=2.0, dry_base=1.5, dry_allowed_length=1,
                            dry_penalty_last_n=40)
    sched = make(engine, tokenizer)
    got = run_all(sched, [request(prompt, max_tokens=10, sampling=params, affinity="d"),
                          request(ids(71, 5), max_tokens=10)])
    tokens = got[0][0]
    assert tokens != cold(engine, tokenizer, request(prompt, max_tokens=10))
    again = run_all(sched, [request(prompt, max_tokens=10, sampling=params, affinity="d")])[0]
    assert again[2].usage.cached_tokens > 0 and again[0] == tokens  # a cache hit: the same DRY output
    table = BreakerTables(tokenizer.token_bytes, tokenizer.vocab_size, tokenizer.encode).table(
        params.dry_sequence_breakers)
    history = list(prompt)
    for token in tokens:
        logits = np.asarray(engine.prefill(0, history, 0), np.float32)
        penalty = reference_penalties(history, VOCAB, 2.0, 1.5, 1, 40, table.heads()).astype(np.float32)
        assert int(np.argmax(logits - penalty)) == token
        history.append(token)


def test_a_stale_verify_time_is_measured_again() -> None:
    """One slow batched verify (a restarted server loading programs beside its first wave) must not stand for
    good: after VERIFY_RETRY_STEPS decode steps without a verify its figure is stale, and the retry's time
    replaces it instead of being averaged in."""
    from scheduler.planner import VERIFY_RETRY_STEPS, StepTimes

    times = StepTimes()
    assert not times.verify_stale()  # never measured: the prior stands, nothing to retry
    times.record("decode", 0.01)
    times.record("verify_rows", 0.5)
    for _ in range(VERIFY_RETRY_STEPS - 1):
        times.record("decode", 0.01)
        assert not times.verify_stale()
    times.record("decode", 0.01)
    assert times.verify_stale()
    times.record("verify_rows", 0.015)
    assert times.seconds["verify_rows"] == 0.015 and not times.verify_stale()
    assert times.rows_verify_cost() == pytest.approx(1.5)
    times.record("verify_rows", 0.025)  # fresh figures are pooled as before
    assert times.seconds["verify_rows"] == pytest.approx(0.02)


def test_one_slow_step_does_not_move_the_step_times() -> None:
    """A step kind's figure is the median of its recent steps: one verify step three times as slow as the
    others (a GC pause, the host busy elsewhere) leaves the verify-over-decode cost where it was, so it cannot
    decline verify steps until the next retry; a lasting change moves it within a few steps."""
    from scheduler.planner import STEP_TIME_WINDOW, StepTimes

    times = StepTimes()
    for _ in range(STEP_TIME_WINDOW):
        times.record("decode", 0.03)
        times.record("verify_rows", 0.05)
    times.record("verify_rows", 0.15)
    assert times.rows_verify_cost() == pytest.approx(0.05 / 0.03)
    for _ in range(STEP_TIME_WINDOW // 2 + 1):
        times.record("verify_rows", 0.08)  # the host slowed for good
    assert times.rows_verify_cost() == pytest.approx(0.08 / 0.03)


def test_streams_verify_again_after_a_verify_time_that_went_stale(exact_engine, tokenizer):
    """Repetitive greedy streams whose one measured batched verify looked 50x a decode step: after
    VERIFY_RETRY_STEPS decode steps they verify in a batch again, whose measured time replaces the stale
    figure, with the outputs of plain decoding."""
    from scheduler.planner import VERIFY_RETRY_STEPS

    reqs = [request(ids(60 + i, 6 + i) * 8, max_tokens=VERIFY_RETRY_STEPS + 24) for i in range(3)]
    plain = run_all(make(exact_engine, tokenizer, speculative=False, prefix_caching=False), reqs)
    sched = make(exact_engine, tokenizer, prefix_caching=False)
    sched.times.record("decode", 0.01)  # as if both had been measured
    sched.times.record("verify_rows", 0.5)
    got = run_all(sched, reqs)
    assert [g[0] for g in got] == [p[0] for p in plain]
    assert sched.stats.batched_speculative_steps >= 1
    assert sched.times.rows_verify_cost() < 50  # measured afresh, not averaged with the stale 50x


def test_streams_decode_rather_than_verify_while_a_short_turn_can_ride_along(engine, tokenizer, monkeypatch):
    """Greedy streams whose drafts always pay for a verify step, and a short prompt arriving meanwhile: the
    streams take decode steps that carry its chunk (a verify pass cannot), so it gets no prefill call of its
    own; without that rule it does, as the verify steps go on. Every output equals its cold run either way."""
    from core.weights import to_w8a8

    exact_engine = Engine(engine.cfg, to_w8a8(engine.params), EngineConfig(
        num_slots=4, max_len=160, chunk_sizes=(4, 16), kv_dtype="int8", rows_verify_width=3, verify_width=0,
        chunk_in_decode=True, carry_sizes=(4, 8)), "float32")
    exact_engine.warmup()
    streams = [request(ids(60 + i, 6 + i) * 4, max_tokens=30) for i in range(2)]
    turn = request(ids(90, 10), max_tokens=5)
    original = exact_engine.prefill_chunk
    runs = {}
    for rule in (True, False):
        sched = make(exact_engine, tokenizer, prefix_caching=False)
        monkeypatch.setattr(sched.times, "rows_verify_cost", lambda: 1.0)
        if not rule:
            monkeypatch.setattr(sched.planner, "_carry_waiting", lambda: False)
        handles = [sched.submit(r) for r in streams]
        while sched.planner.prefilling or sched.stats.batched_speculative_steps < 2:
            sched.step()
        separate: list[tuple] = []
        monkeypatch.setattr(exact_engine, "prefill_chunk", lambda *a, calls=separate, **kw: calls.append(a)
                            or original(*a, **kw))
        carried = sched.stats.carried_chunks
        handles.append(sched.submit(turn))
        sched.run_until_idle()
        monkeypatch.setattr(exact_engine, "prefill_chunk", original)
        for handle, req in zip(handles, [*streams, turn], strict=True):
            assert handle.result(timeout=0)[0] == cold(exact_engine, tokenizer, req)
        runs[rule] = (len(separate), sched.stats.carried_chunks - carried)
    assert runs[True][0] == 0 and runs[True][1] > 0
    assert runs[False][0] > 0
