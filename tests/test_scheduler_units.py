"""The scheduler's parts that need no model: the admission queue's fair share and bound, and what a sampled
token does to its sequence (`scheduler.output`)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from core.engine import SampleResult
from core.sampling import SamplingParams
from scheduler.admission import Admission
from scheduler.output import accept, finish_event
from scheduler.request import FinishReason, GenerationRequest, QueueFullError, RequestHandle
from scheduler.sequence import Sequence
from scheduler.stop_strings import StopMatcher

EOS = 1


def seq(group: str = "a", priority: int = 1, stop: tuple[str, ...] = (), max_tokens: int = 8, tokenizer=None,
        **request) -> Sequence:
    req = GenerationRequest(prompt_ids=(5, 6), group=group, priority=priority, stop=stop, max_tokens=max_tokens,
                            **request)
    return Sequence(id=0, request=req, handle=RequestHandle(req),
                    detokenizer=tokenizer.detokenizer(skip_special=True) if tokenizer else None,
                    stop_matcher=StopMatcher(stop) if stop else None, max_tokens=max_tokens, seed=0)


def sampled(*tokens: int) -> SampleResult:
    n = len(tokens)
    return SampleResult(np.asarray(tokens, np.int32), np.zeros(n, np.float32), np.zeros((n, 0), np.int32),
                        np.zeros((n, 0), np.float32))


def fill(admission: Admission, *groups: tuple[str, int, int]) -> None:
    for group, priority, n in groups:
        for _ in range(n):
            admission.reserve()
            admission.add(seq(group, priority))


def test_admission_shares_slots_across_groups_by_priority_and_bounds_the_queue():
    shared = Admission(limit=100)
    fill(shared, ("busy", 1, 20), ("vip", 3, 20))
    order = [shared.pick().group for _ in range(16)]
    assert order.count("vip") == 3 * order.count("busy") == 12  # three admissions per pass unit
    admission = Admission(limit=40)
    fill(admission, ("busy", 1, 30), ("quiet", 1, 2))
    assert admission.waiting == 32 and admission.counts() == {"busy": 30, "quiet": 2}
    assert "quiet" in [admission.pick().group for _ in range(2)]  # not starved behind a backlog
    assert admission.waiting == 30
    fill(admission, ("late", 1, 10))
    with pytest.raises(QueueFullError):
        admission.reserve()
    # A group that starts waiting joins at the smallest pass: no credit banked while it was idle.
    assert [admission.pick().group for _ in range(6)].count("late") == 2


def test_admission_takes_back_cancelled_and_drained_requests():
    admission = Admission(limit=10)
    queued = [seq(g) for g in "abab"]
    for s in queued:
        admission.reserve()
        admission.add(s)
    queued[1].handle.cancel()
    assert admission.take_cancelled() == [queued[1]] and admission.waiting == 3
    assert sorted(s.group for s in admission.drain()) == ["a", "a", "b"] and admission.waiting == 0
    assert admission.pick() is None


def test_admission_counts_reservations_from_many_threads_exactly():
    admission = Admission(limit=1000)
    threads = [threading.Thread(target=lambda: [admission.reserve() for _ in range(100)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert admission.waiting == 800


def test_a_token_goes_on_stops_or_ends_the_output(tokenizer):
    word = tokenizer.encode(" hello")
    s = seq(stop=("lo",), tokenizer=tokenizer)
    verdicts = [accept(s, sampled(t), 0, frozenset({EOS}), iteration=3, slot_full=False) for t in word]
    assert verdicts[-1].finish is FinishReason.STOP  # the stop string completed
    assert all(v.event is not None and v.event.iteration == 3 for v in verdicts)
    assert "".join(v.event.text for v in verdicts) + finish_event(s, FinishReason.STOP).text == " hel"
    eos = seq(tokenizer=tokenizer)
    assert accept(eos, sampled(EOS), 0, frozenset({EOS}), 0, False) == accept(eos, sampled(EOS), 0,
                                                                               frozenset({EOS}), 0, False)
    assert accept(eos, sampled(EOS), 0, frozenset({EOS}), 0, False).finish is FinishReason.STOP
    kept = seq(tokenizer=tokenizer, ignore_eos=True)
    assert accept(kept, sampled(EOS), 0, frozenset({EOS}), 0, False).finish is None
    short = seq(max_tokens=2, tokenizer=tokenizer)
    assert accept(short, sampled(word[0]), 0, frozenset(), 0, False).finish is None
    assert accept(short, sampled(word[0]), 0, frozenset(), 0, False).finish is FinishReason.LENGTH
    full = seq(tokenizer=tokenizer)
    assert accept(full, sampled(word[0]), 0, frozenset(), 0, slot_full=True).finish is FinishReason.LENGTH
    dead = accept(seq(tokenizer=tokenizer), sampled(-1), 0, frozenset(), 0, False)
    assert (dead.event, dead.finish) == (None, FinishReason.ERROR) and "dead end" in dead.error


def test_a_token_the_grammar_refuses_ends_the_output_with_an_error_and_is_never_shown(tokenizer):
    class Refusing:
        keys = None
        error = "not in the grammar"

        def consume(self, token: int) -> bool:
            return False

    s = seq(tokenizer=tokenizer, constraint=Refusing(), sampling=SamplingParams(temperature=0.0))
    verdict = accept(s, sampled(tokenizer.encode("x")[0]), 0, frozenset(), 0, False)
    assert verdict.event is None and verdict.finish is FinishReason.ERROR and "not in the grammar" in verdict.error


def test_the_finish_event_flushes_held_text_and_reports_usage_and_timings(tokenizer):
    s = seq(stop=("END",), tokenizer=tokenizer)
    s.cached_tokens = 1
    for t in tokenizer.encode(" the EN"):
        accept(s, sampled(t), 0, frozenset(), 0, False)
    event = finish_event(s, FinishReason.LENGTH)
    assert event.text.endswith("EN")  # held back as a possible stop string, given back at the end
    assert (event.usage.prompt_tokens, event.usage.cached_tokens, event.usage.completion_tokens) == (2, 1, 2)
    assert event.reason is FinishReason.LENGTH and "ttft_s" in event.timings and not event.budget_closed


def test_a_program_first_run_is_left_out_of_the_step_times():
    """A step that ran some program for the first time carries one-time set-up: its time must not enter the
    planner's cost estimates (a first batched verify measured 6x a decode step would never be tried again)."""
    import jax

    from core.programs import Program, ProgramTable
    from scheduler.executor import _record_time
    from scheduler.plan import StepOutcome

    programs = {key: Program(str(key), jax.jit(lambda x: x + 1)) for key in (("decode", 8), ("verify_rows", 8))}
    table = ProgramTable(programs, lambda key: (np.int32(0),), lambda key: True, lambda key: key)
    engine = type("Engine", (), {"programs": table})()
    out = StepOutcome()
    for key in ("decode", "verify_rows"):
        ran = table.programs_run()
        programs[key, 8](np.int32(1))  # its first run
        _record_time(engine, out, key, 0.0, ran)
    assert out.seconds == {} and table.programs_run() == 2
    ran = table.programs_run()
    programs["decode", 8](np.int32(2))
    _record_time(engine, out, "decode", 0.0, ran)
    assert set(out.seconds) == {"decode"} and programs["decode", 8].calls == 2
