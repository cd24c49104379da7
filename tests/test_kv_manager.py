"""Placement and reuse policy on plans, without a model: which slot a request gets, which cache operations
bring its prefix in (in place, device copy, host restore), what is saved before a slot is overwritten, the
in-flight wait, and cache scopes. A scheduler plan over a stub engine checks the wait end to end."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from core.engine import SlotSnapshot
from scheduler.kv_manager import CacheConfig, KVCacheManager
from scheduler.plan import CopyPrefix, RestoreFromHost, SaveToHost
from scheduler.request import GenerationRequest
from scheduler.sequence import SeqState, Sequence

SYSTEM = tuple(range(1000, 1040))  # a 40-token system prompt


def seq(prompt, n=0, agent="a", session=None, salt=None) -> Sequence:
    request = GenerationRequest(prompt_ids=tuple(prompt), group=agent, affinity=session, cache_scope=(agent, salt))
    return Sequence(id=n, request=request, handle=None, detokenizer=None, stop_matcher=None, max_tokens=8, seed=0)


def manager(slots=3, **config) -> KVCacheManager:
    return KVCacheManager(slots, CacheConfig(min_snapshot_tokens=4, min_wait_tokens=8, **config))


def hold(kv: KVCacheManager, index: int, tokens, agent="a", session=None, last_used=0.0) -> None:
    slot = kv.slots[index]
    slot.tokens, slot.scope, slot.affinity, slot.last_used = list(tokens), (agent, None), session, last_used


def kv_run(tokens, start=0) -> SlotSnapshot:
    pos = np.arange(start, len(tokens), dtype=np.float32)[:, None]
    return SlotSnapshot(start, len(tokens), {"layer0": {"k": pos, "v": pos}})


def test_a_cold_prompt_goes_to_an_empty_slot_with_no_operations():
    kv = manager()
    hold(kv, 0, SYSTEM + (1, 2, 3), last_used=5.0)
    s = seq((7, 8, 9))
    ops = []
    kv.place(s, ops)
    assert ops == [] and s.cursor == 0 and s.slot in (1, 2) and s.state is SeqState.PREFILLING
    assert kv.slots[s.slot].sequence is s and kv.slots[s.slot].tokens == []


def test_a_slot_holding_only_a_prefix_of_the_prompt_is_reused_in_place():
    kv = manager()
    hold(kv, 2, SYSTEM)  # e.g. an earlier request of the agent that left just its system prompt
    s = seq(SYSTEM + (5, 6))
    ops = []
    kv.place(s, ops)
    assert ops == [] and s.slot == 2 and s.cursor == s.cached_tokens == len(SYSTEM)
    assert kv.stats.slot_reuses == 1


def test_the_session_slot_is_preferred_and_resumes_its_conversation():
    kv = manager()
    conversation = SYSTEM + (1, 2, 3, 4, 5)
    hold(kv, 0, SYSTEM)
    hold(kv, 1, conversation + (9,), session="s")  # the last reply token differs from what the client sent back
    s = seq(conversation + (6, 7), session="s")
    ops = []
    kv.place(s, ops)
    assert s.slot == 1 and s.cursor == len(conversation) and ops == []


def test_a_prefix_another_slot_passed_long_ago_is_copied_to_a_free_slot():
    """Slot 0 holds another session's conversation; the new session shares its system prompt. The slot is
    not overwritten (its conversation would be lost): an empty slot takes a device copy of the prefix."""
    kv = manager()
    hold(kv, 0, SYSTEM + tuple(range(200)), session="other", last_used=1.0)
    s = seq(SYSTEM + (5, 6), session="new")
    ops = []
    kv.place(s, ops)
    assert s.slot != 0 and ops == [CopyPrefix(0, s.slot, len(SYSTEM))]
    assert kv.slots[s.slot].tokens == list(SYSTEM) and s.cached_tokens == len(SYSTEM)


def test_a_full_hit_recomputes_the_last_prompt_token():
    kv = manager()
    prompt = SYSTEM + (5, 6)
    hold(kv, 0, prompt + (11, 12), session="other")
    s = seq(prompt)
    ops = []
    kv.place(s, ops)
    assert ops == [CopyPrefix(0, s.slot, len(prompt) - 1)] and s.cursor == len(prompt) - 1


def test_an_overwritten_conversation_is_saved_first_and_restored_later():
    kv = manager(slots=2)
    conv_a = SYSTEM + tuple(range(10, 30))
    hold(kv, 0, conv_a, session="a", last_used=1.0)
    hold(kv, 1, tuple(range(500, 540)), session="b", last_used=2.0)
    c = seq(tuple(range(700, 720)), session="c")
    ops = []
    kv.place(c, ops)  # both slots hold other conversations: the least recently used one is saved first
    assert c.slot == 0 and ops == [SaveToHost(0, ("a", None), conv_a, 0)] and kv.stats.host_saves == 1
    kv.host.insert(("a", None), conv_a, kv_run(conv_a))  # what the executor does with that operation
    kv.extend(c.slot, list(c.prompt))  # what the update step does once c's prompt is computed
    kv.release(c)
    kv.slots[0].last_used = 0.0
    # Session a comes back with one more turn: the host serves its whole conversation.
    a2 = seq(conv_a + (1, 2), session="a")
    ops = []
    kv.place(a2, ops)
    assert a2.slot == 0 and len(ops) == 2 and isinstance(ops[1], RestoreFromHost)
    assert isinstance(ops[0], SaveToHost) and ops[0].start == 0  # c's 20 tokens were worth keeping too
    snapshot = ops[1].snapshot
    assert (snapshot.start, snapshot.end) == (0, len(conv_a)) and a2.cursor == len(conv_a)
    # A new session of agent a restores just the system prompt from that stored run.
    kv.release(a2)
    d = seq(SYSTEM + (3,), session="d")
    hold(kv, 0, tuple(range(800, 803)), agent="z", last_used=0.0)
    hold(kv, 1, tuple(range(900, 903)), agent="z", last_used=0.0)
    ops = []
    kv.place(d, ops)
    restore = [op for op in ops if isinstance(op, RestoreFromHost)]
    assert len(restore) == 1 and (restore[0].snapshot.start, restore[0].snapshot.end) == (0, len(SYSTEM))


def test_nothing_is_shared_across_agents_or_cache_salts():
    kv = manager()
    hold(kv, 0, SYSTEM + (1, 2), agent="a")
    kv.host.insert(("a", None), SYSTEM, kv_run(SYSTEM))
    for other in (seq(SYSTEM + (1, 2, 3), agent="b"), seq(SYSTEM + (1, 2, 3), agent="a", salt="tenant-2")):
        ops = []
        kv.place(other, ops)
        assert other.cursor == 0 and not any(isinstance(op, CopyPrefix | RestoreFromHost) for op in ops)
        kv.release(other)
    salted = seq(SYSTEM + (4,), agent="a", salt="t")
    kv.place(salted, [])
    kv.extend(salted.slot, list(SYSTEM))
    kv.release(salted)
    again = seq(SYSTEM + (5,), agent="a", salt="t")
    ops = []
    kv.place(again, ops)
    assert again.cursor == len(SYSTEM)  # the same salt shares


def test_a_request_waits_for_a_prefix_another_is_still_prefilling():
    kv = manager()
    first = seq(SYSTEM + (1, 2), n=1)
    kv.place(first, [])
    second = seq(SYSTEM + (3, 4), n=2)
    ops = []
    kv.place(second, ops)
    assert second.awaiting is first and second.awaited == len(SYSTEM) and ops == []
    assert kv.stats.in_flight_waits == 1
    first.cursor = 32  # the donor's prefill is under way
    kv.extend(first.slot, list(SYSTEM[:32]))
    assert not kv.resolve(second, ops) and ops == []
    first.cursor = len(SYSTEM) + 2
    kv.extend(first.slot, list(SYSTEM[32:]) + [1, 2])
    first.state = SeqState.DECODING
    assert kv.resolve(second, ops)
    assert ops == [CopyPrefix(first.slot, second.slot, len(SYSTEM))] and second.cursor == len(SYSTEM)
    assert second.awaiting is None


def test_no_wait_when_the_donor_is_gone_or_the_gain_is_small():
    kv = manager()
    first = seq(SYSTEM + (1,), n=1)
    kv.place(first, [])
    short = seq(SYSTEM[:5] + (9,), n=2)  # shares 5 tokens: below min_wait_tokens
    kv.place(short, [])
    assert short.awaiting is None
    waiter = seq(SYSTEM + (2,), n=3)
    kv.place(waiter, [])
    assert waiter.awaiting is first
    kv.extend(first.slot, list(SYSTEM[:16]))  # the donor computed 16 tokens, then was cancelled
    first.state = SeqState.FINISHED
    kv.release(first)
    ops = []
    assert kv.resolve(waiter, ops)
    assert ops == [CopyPrefix(first.slot, waiter.slot, 16)] and waiter.cursor == 16


def test_a_scheduler_plan_computes_a_shared_new_system_prompt_once():
    """Four sessions with the same new system prompt arrive together: the first plan prefills only the first
    one; the other three wait, and once its prefill has passed the prompt each copies it."""
    from scheduler.scheduler import Scheduler, SchedulerConfig

    engine = SimpleNamespace(num_slots=4, row_chunk=4, max_len=512, rows_verify_exact=False,
                             cfg=SimpleNamespace(vocab_size=100_000),
                             config=SimpleNamespace(chunk_sizes=(4, 16), verify_tokens=0, adapter_slots=0),
                             loaded_adapters=[],
                             compiled_for=lambda kind, positions: True)
    sched = Scheduler(engine, tokenizer=SimpleNamespace(detokenizer=lambda skip_special: None),
                      config=SchedulerConfig(prefill_budget=16), stop_ids=frozenset())
    handles = [sched.submit(GenerationRequest(prompt_ids=SYSTEM + (i,), affinity=f"s{i}")) for i in range(4)]
    sched._drain_inbox()
    plan = sched.planner.plan()
    first = handles[0]
    assert {chunk.seq.request.affinity for chunk in plan.chunks} == {"s0"} and not plan.rows
    waiting = [s for s in sched.planner.prefilling if s.awaiting is not None]
    assert len(waiting) == 3 and all(s.awaited == len(SYSTEM) for s in waiting)
    assert plan.cache_ops == []
    assert first.request.prompt_ids == SYSTEM + (0,)
    # Pretend the donor's prefill ran through the system prompt (what the update step records).
    donor = next(s for s in sched.planner.prefilling if s.awaiting is None)
    sched.kv.extend(donor.slot, list(SYSTEM))
    donor.cursor = len(SYSTEM)
    plan = sched.planner.plan()
    copies = [op for op in plan.cache_ops if isinstance(op, CopyPrefix)]
    assert sorted(op.dst for op in copies) == sorted(s.slot for s in waiting)
    assert all(op.src == donor.slot and op.n == len(SYSTEM) for op in copies)
