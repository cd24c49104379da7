"""Every prefix-reuse path through the scheduler gives exactly the tokens of a cold run (the same request
alone, caching off), on both model families and on the CPU serving default (W8A8 weights, int8 KV): the
session's own slot, another slot at a position it passed more than a window ago, the host tier serving a
prefix of an evicted conversation, a wait for another request's in-flight prefill, a full hit; and scopes
(agents, cache salts) that must not share."""

from __future__ import annotations

import pytest

from core.config import ModelConfig
from core.engine import Engine, EngineConfig
from core.weights import random_params, to_w8a8
from scheduler.request import GenerationRequest
from scheduler_helpers import VOCAB, cache_path_engine, cold, cold_logprobs, ids, make, request, run_all, token_logprobs
from tiny_models import CONFIGS, WINDOW

SLOTS = 4
SYSTEM_LEN = 3 * WINDOW + 2


@pytest.fixture(scope="module", params=["gemma3", "gemma4", "gemma3-w8a8-int8kv"])
def engine(request, compile_cache):
    return cache_path_engine(request.param, SLOTS)


SYSTEM = ids(1, SYSTEM_LEN)


def turn(system, seed: int, n: int = 5, **kw) -> GenerationRequest:
    prompt = system + ids(seed, n)
    return request(prompt, boundaries=(len(system),), **kw)


def test_own_slot_resumes_the_conversation(engine, tokenizer):
    sched = make(engine, tokenizer)
    first = turn(SYSTEM, 2, affinity="s")
    out1 = run_all(sched, [first])[0][0]
    second = request(first.prompt_ids + tuple(out1) + ids(3, 4), affinity="s")
    out2, _, fin = run_all(sched, [second])[0]
    assert fin.usage.cached_tokens == len(first.prompt_ids) + len(out1) - 1
    assert sched.kv.stats.slot_reuses == 1 and sched.kv.stats.device_copies == 0
    assert out2 == cold(engine, tokenizer, second)


@pytest.mark.parametrize("busy", [False, True])
def test_another_slot_serves_a_prefix_it_passed_more_than_a_window_ago(engine, tokenizer, busy):
    """Session a's slot has moved 2 windows past the system prompt (and may still be decoding); session b's
    request copies the system prompt from it."""
    sched = make(engine, tokenizer)
    a = turn(SYSTEM, 4, n=WINDOW, max_tokens=2 * WINDOW, affinity="a")
    handle_a = sched.submit(a)
    if busy:
        for _ in range(8):
            sched.step()
    else:
        sched.run_until_idle()
    assert sched.slots[0].held > SYSTEM_LEN + WINDOW
    b = turn(SYSTEM, 5, affinity="b")
    out_b, _, fin_b = run_all(sched, [b])[0]
    assert sched.kv.stats.device_copies == 1 and fin_b.usage.cached_tokens == SYSTEM_LEN
    assert out_b == cold(engine, tokenizer, b)
    assert handle_a.result(timeout=0)[0] == cold(engine, tokenizer, a)


def test_the_host_tier_serves_a_prefix_of_an_evicted_conversation(engine, tokenizer):
    sched = make(engine, tokenizer)
    run_all(sched, [turn(SYSTEM, 6, n=WINDOW, affinity="a")])
    others = [request(ids(100 + i, 20), affinity=f"other{i}", group="other", cache_scope="other") for i in range(SLOTS)]
    run_all(sched, others)  # every slot now holds another agent's session: a's was saved to the host
    assert sched.kv.stats.host_saves >= 1 and all(slot.scope != ("default", None) for slot in sched.slots)
    b = turn(SYSTEM, 7, affinity="b")
    out_b, _, fin_b = run_all(sched, [b])[0]
    assert sched.kv.stats.host_restores == 1 and fin_b.usage.cached_tokens == SYSTEM_LEN
    assert out_b == cold(engine, tokenizer, b)


def test_a_new_system_prompt_sent_by_four_sessions_at_once_is_computed_once(engine, tokenizer):
    sched = make(engine, tokenizer)
    system = ids(8, 5 * WINDOW)
    reqs = [turn(system, 10 + i, affinity=f"s{i}") for i in range(4)]
    results = run_all(sched, reqs)
    assert sched.kv.stats.in_flight_waits == 3
    assert sched.stats.prefill_tokens == len(system) + 4 * 5
    for req, (out, _, _) in zip(reqs, results, strict=True):
        assert out == cold(engine, tokenizer, req)
    assert sorted(fin.usage.cached_tokens for _, _, fin in results) == [0] + [len(system)] * 3


def test_the_same_request_twice_recomputes_only_its_last_token(engine, tokenizer):
    sched = make(engine, tokenizer)
    req = turn(SYSTEM, 12, n=2 * WINDOW)
    first = run_all(sched, [req])[0]
    again = run_all(sched, [req])[0]
    assert again[2].usage.cached_tokens == len(req.prompt_ids) - 1
    assert again[0] == first[0] == cold(engine, tokenizer, req)


def test_no_reuse_across_agents_or_cache_salts(engine, tokenizer):
    """Cache scopes as agents.service makes them, (agent, cache salt): KV is shared only within one."""
    sched = make(engine, tokenizer)
    prompt = SYSTEM + ids(13, 5)
    base = run_all(sched, [request(prompt, cache_scope=("x", None))])[0]
    for scope in (("y", None), ("x", "tenant-b")):
        out, _, fin = run_all(sched, [request(prompt, cache_scope=scope)])[0]
        assert fin.usage.cached_tokens == 0 and out == base[0], scope
    assert sched.kv.stats.device_copies == 0 and sched.kv.stats.host_restores == 0
    out, _, fin = run_all(sched, [request(prompt, cache_scope=("x", "tenant-b"))])[0]
    assert fin.usage.cached_tokens == len(prompt) - 1  # the same salt shares


@pytest.fixture(scope="module", params=["gemma3-w8a8-int8kv", "gemma4-w8a8-int8kv", "gemma3-float", "gemma4-float"])
def exact_engine(request, compile_cache):
    """The CPU serving default (W8A8 weights, int8 KV) and the float path, on both families, with more chunk
    sizes and buckets than a prompt of this file needs, so that resuming at a split point changes chunking and
    buckets."""
    family, _, variant = request.param.partition("-")
    cfg = ModelConfig.from_hf_dict({**CONFIGS[family], "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB})
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=11)
    quantized = variant == "w8a8-int8kv"
    eng = Engine(cfg, to_w8a8(params) if quantized else params,
                 EngineConfig(num_slots=SLOTS, max_len=160, chunk_sizes=(4, 8, 16), attention_buckets=(32, 64),
                              kv_dtype="int8" if quantized else None), "float32")
    eng.warmup()
    return eng


# Odd places (inside chunks, past the window, across a bucket): every split for a slot's own or copied KV; the host
# tier keeps runs of 16 tokens or more, and a request waits for an in-flight prefill that saves it 32 or more.
SPLITS = {"slot": (1, 7, 10, 22, 33, 38), "host-tier": (17, 29, 38), "in-flight": (33, 38)}
PROMPT = ids(40, 5 * WINDOW)


@pytest.mark.parametrize("path", sorted(SPLITS))
def test_a_prompt_resumed_at_any_split_gives_the_cold_tokens_and_logprobs_bit_for_bit(exact_engine, tokenizer,
                                                                                      path):
    """A request whose prompt starts with what an earlier request left (a prefix ending at a split point)
    reuses it from a slot (in place or copied), the host tier or a wait for its in-flight prefill, and streams exactly
    the cold run's tokens and logprobs: float equality, not closeness."""
    final = request(PROMPT, max_tokens=5, want_logprobs=True, affinity="b")
    want = cold_logprobs(exact_engine, tokenizer, final)
    assert all(lp is not None for _, lp in want)
    for split in SPLITS[path]:
        sched = make(exact_engine, tokenizer)
        first = request(PROMPT[:split], max_tokens=1, affinity="a")
        if path == "in-flight":
            sched.submit(first)
            handle = sched.submit(final)
        else:
            run_all(sched, [first])
            if path == "host-tier":
                run_all(sched, [request(ids(200 + i, 12), affinity=f"o{i}", group="other", cache_scope="other")
                                for i in range(SLOTS)])
            handle = sched.submit(final)
        sched.run_until_idle()
        got, fin = token_logprobs(handle)
        assert fin.usage.cached_tokens == split, (path, split, fin.usage.cached_tokens)
        assert got == want, f"{path}, split {split}"
        stats = sched.kv.stats
        assert {"slot": stats.device_copies + stats.slot_reuses, "host-tier": stats.host_restores,
                "in-flight": stats.in_flight_waits}[path] == 1
