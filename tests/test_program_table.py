"""The background warm-up's order (core.programs.ProgramTable): while the engine serves, it loads only the
programs its steps keep asking for, those first, and everything else once serving pauses, so that a restart's
loading does not slow the streams it serves meanwhile."""

from __future__ import annotations

import time

import jax
import numpy as np

from core.programs import ASKS_WHILE_SERVING, QUIET_S, Program, ProgramTable

KEYS = [("step", i) for i in range(5)]


def table_of() -> tuple[dict, ProgramTable]:
    """Five tiny programs; the first is needed before ready, the rest load in key order."""
    programs = {key: Program(str(key), jax.jit(lambda x, i=key[1]: x + i)) for key in KEYS}
    return programs, ProgramTable(programs, lambda key: (np.int32(0),), lambda key: key == KEYS[0], lambda key: key)


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def loaded(programs: dict) -> list[tuple[str, int]]:
    return [key for key in KEYS if programs[key].ready]


def warming_while_serving() -> tuple[dict, ProgramTable]:
    """A table whose caller serves from the start, its background warm-up started (KEYS[0] loaded)."""
    programs, table = table_of()
    table.serving(True)
    table.warmup(background=True)
    return programs, table


def pause_and_finish(programs: dict, table: ProgramTable) -> None:
    """Serving pauses: the warm-up loads everything left."""
    table.serving(False)
    table.background.join(timeout=60)
    assert loaded(programs) == KEYS


def ask(table: ProgramTable, key: tuple[str, int], times: int) -> None:
    for _ in range(times):
        table.want(key)


def test_while_serving_the_warmup_loads_only_what_steps_keep_wanting_then_the_rest_once_idle():
    programs, table = warming_while_serving()
    time.sleep(0.5)  # a tiny program loads in milliseconds: a warm-up not held back would have loaded them
    assert loaded(programs) == [KEYS[0]]
    ask(table, KEYS[3], ASKS_WHILE_SERVING - 1)  # a passing want (one stream alone for a step or two)
    time.sleep(0.3)
    assert loaded(programs) == [KEYS[0]]
    table.want(KEYS[3])  # asked for often enough: loaded before KEYS[1] and KEYS[2] while serving
    wait_for(lambda: programs[KEYS[3]].ready)
    time.sleep(0.2)
    assert loaded(programs) == [KEYS[0], KEYS[3]]
    pause_and_finish(programs, table)


def test_a_passing_want_loads_first_once_serving_pauses():
    programs, table = warming_while_serving()
    table.want(KEYS[4])
    time.sleep(0.3)
    assert loaded(programs) == [KEYS[0]]
    table.serving(False)  # idle: the wanted one loads at once, the rest after QUIET_S
    wait_for(lambda: programs[KEYS[4]].ready)
    assert loaded(programs) == [KEYS[0], KEYS[4]]
    pause_and_finish(programs, table)


def test_after_ready_the_unwanted_rest_waits_for_quiet_even_if_the_loop_idled_through_the_warmup():
    """A serving loop that started (idle) long before ready does not let the warm-up load at once: the first
    requests arrive right after ready."""
    programs, table = table_of()
    table.serving(False)
    time.sleep(QUIET_S + 0.2)  # idle for longer than QUIET_S before the warm-up even starts
    table.warmup(background=True)
    ready_at = time.monotonic()
    wait_for(lambda: programs[KEYS[1]].ready)
    assert time.monotonic() - ready_at >= QUIET_S * 0.9
    table.background.join(timeout=60)
    assert loaded(programs) == KEYS


def test_a_call_loads_its_own_program_and_wanting_a_loaded_one_does_nothing():
    programs, table = warming_while_serving()
    assert int(programs[KEYS[2]](np.int32(1))) == 3  # a call loads its own program on the calling thread
    ask(table, KEYS[4], ASKS_WHILE_SERVING)
    table.want(KEYS[2])  # already loaded: nothing to do
    wait_for(lambda: programs[KEYS[4]].ready)
    assert loaded(programs) == [KEYS[0], KEYS[2], KEYS[4]]
    pause_and_finish(programs, table)


def test_stopping_wakes_a_warmup_held_back_by_serving():
    programs, table = warming_while_serving()
    assert table.stop_background(timeout=10)  # it was waiting, not loading
    assert loaded(programs) == [KEYS[0]]


def test_quiet_means_nothing_served_for_a_while_and_stopping_ends_the_wait():
    """What waits for quiet (the grammar bridge) starts QUIET_S after the last step, never while serving nor
    before a serving loop has started (its first requests arrive right after ready)."""
    import threading

    _, table = table_of()
    answers: list[tuple[bool, float]] = []
    waiter = threading.Thread(target=lambda: answers.append((table.wait_quiet(), time.monotonic())))
    waiter.start()
    time.sleep(QUIET_S + 0.2)
    assert not answers  # no loop yet
    table.serving(True)
    time.sleep(0.3)
    assert not answers  # serving: still waiting
    idle_at = time.monotonic()
    table.serving(False)
    waiter.join(timeout=10)
    assert answers[0][0] and answers[0][1] - idle_at >= QUIET_S * 0.9
    table.serving(True)
    waiter = threading.Thread(target=lambda: answers.append((table.wait_quiet(), time.monotonic())))
    waiter.start()
    table.stop_background(timeout=1)
    waiter.join(timeout=10)
    assert answers[1][0] is False


def test_the_first_run_hook_follows_each_compile_unless_a_call_ran_the_program_first():
    programs, table = table_of()
    ran: list[tuple[str, int]] = []
    table.first_run = lambda key: ran.append(key) or programs[key](np.int32(0))
    table.serving(True)
    table.warmup(background=True)
    assert ran == [KEYS[0]]  # before ready
    programs[KEYS[2]](np.int32(1))  # a call compiles and runs it first
    table.serving(False)
    table.background.join(timeout=60)
    assert ran == [KEYS[0], KEYS[1], KEYS[3], KEYS[4]]
    assert all(program.calls == 1 for program in programs.values())
