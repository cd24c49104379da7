from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import numpy as np
import pytest

from scheduler.host_tier import HostTier


@dataclass(frozen=True)
class Snap:
    nbytes: int
    tag: str = ""


def test_put_and_lookup_longest_prefix() -> None:
    tier: HostTier[Snap] = HostTier(1000)
    assert tier.put((1, 2, 3), Snap(10, "short"))
    assert tier.put((1, 2, 3, 4, 5), Snap(10, "long"))
    assert tier.lookup((1, 2, 3, 4, 5, 6)) == (5, Snap(10, "long"))
    assert tier.lookup((1, 2, 3, 4)) == (3, Snap(10, "short"))
    assert tier.lookup([1, 2]) is None
    assert tier.lookup(np.array([1, 2, 3], dtype=np.int32)) == (3, Snap(10, "short"))
    assert tier.lookup(()) is None
    assert tier.contains((1, 2, 3)) and not tier.contains((1, 2, 3, 4))
    assert tier.entries == 2 and tier.bytes_used == 20 and len(tier) == 2


def test_lru_eviction_keeps_recently_looked_up() -> None:
    tier: HostTier[Snap] = HostTier(300)
    tier.put((1,), Snap(100, "a"))
    tier.put((2,), Snap(100, "b"))
    tier.put((3,), Snap(100, "c"))
    assert tier.lookup((1, 9)) == (1, Snap(100, "a"))  # "a" becomes most recent; "b" is now oldest
    tier.put((4,), Snap(100, "d"))
    assert not tier.contains((2,))
    assert all(tier.contains((k,)) for k in (1, 3, 4))
    assert tier.stats()["evictions"] == 1


def test_contains_does_not_refresh() -> None:
    tier: HostTier[Snap] = HostTier(200)
    tier.put((1,), Snap(100))
    tier.put((2,), Snap(100))
    assert tier.contains((1,))
    tier.put((3,), Snap(100))
    assert not tier.contains((1,)) and tier.contains((2,))
    assert tier.stats()["hits"] == 0 and tier.stats()["misses"] == 0


def test_eviction_frees_enough_for_a_large_entry() -> None:
    tier: HostTier[Snap] = HostTier(100)
    for k in range(5):
        tier.put((k,), Snap(20))
    assert tier.put((9,), Snap(70))
    assert tier.bytes_used == 90 and tier.entries == 2  # evicted the four oldest
    assert tier.contains((4,)) and tier.contains((9,))
    assert tier.stats()["evictions"] == 4


def test_oversize_refused_without_side_effects() -> None:
    tier: HostTier[Snap] = HostTier(100)
    tier.put((1,), Snap(60, "kept"))
    assert not tier.put((2,), Snap(101))
    assert not tier.put((1,), Snap(101))  # same key: the old entry stays
    assert tier.lookup((1,)) == (1, Snap(60, "kept"))
    assert tier.bytes_used == 60 and tier.entries == 1
    assert tier.stats()["evictions"] == 0
    assert tier.put((3,), Snap(100 - 60))  # exactly fills the budget
    assert tier.bytes_used == 100


def test_replacement_updates_bytes() -> None:
    tier: HostTier[Snap] = HostTier(100)
    tier.put((1, 2), Snap(30, "old"))
    tier.put((5,), Snap(40))
    assert tier.put([1, 2], Snap(50, "new"))
    assert tier.bytes_used == 90 and tier.entries == 2
    assert tier.lookup((1, 2)) == (2, Snap(50, "new"))
    # Growing the replaced entry evicts others but never the entry being replaced.
    assert tier.put((1, 2), Snap(90, "bigger"))
    assert tier.entries == 1 and tier.bytes_used == 90
    assert tier.stats()["evictions"] == 1
    assert tier.put((1, 2), Snap(10, "smaller"))
    assert tier.bytes_used == 10


def test_discard() -> None:
    tier: HostTier[Snap] = HostTier(100)
    tier.put((1, 2), Snap(30))
    tier.put((1, 2, 3), Snap(30))
    tier.discard((1, 2, 3))
    tier.discard((7,))  # absent: no-op
    assert tier.bytes_used == 30 and tier.entries == 1
    assert tier.lookup((1, 2, 3)) == (2, Snap(30))
    assert tier.stats()["evictions"] == 0


def test_stats_counts() -> None:
    tier: HostTier[Snap] = HostTier(50)
    tier.put((1,), Snap(20))
    tier.put((2,), Snap(20))
    tier.lookup((1, 5))
    tier.lookup((3,))
    tier.lookup((2,))
    tier.lookup(())
    tier.put((3,), Snap(20))  # evicts (1,): (2,) was looked up after it
    assert tier.stats() == {
        "hits": 2,
        "misses": 2,
        "evictions": 1,
        "bytes_used": 40,
        "entries": 2,
        "budget_bytes": 50,
    }
    assert not tier.contains((1,))


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        HostTier(-1)
    tier: HostTier[Snap] = HostTier(10)
    with pytest.raises(ValueError):
        tier.put((), Snap(1))
    with pytest.raises(ValueError):
        tier.put((1,), Snap(-1))
    assert tier.entries == 0 and tier.bytes_used == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_random_puts_respect_budget_and_lru(seed: int) -> None:
    """Against a reference model: a list in LRU order with sizes."""
    rng = random.Random(seed)
    budget = 1000
    tier: HostTier[Snap] = HostTier(budget)
    lru: list[tuple[tuple[int, ...], Snap]] = []  # least recent first
    for step in range(2000):
        key = tuple(rng.randrange(3) for _ in range(rng.randint(1, 5)))
        op = rng.random()
        if op < 0.5:
            snap = Snap(rng.choice([0, 50, 120, 300, 700, 1001]), str(step))
            ok = tier.put(key, snap)
            assert ok == (snap.nbytes <= budget)
            if ok:
                lru = [(k, s) for k, s in lru if k != key]
                while sum(s.nbytes for _, s in lru) + snap.nbytes > budget:
                    lru.pop(0)
                lru.append((key, snap))
        elif op < 0.85:
            matches = [(k, s) for k, s in lru if key[: len(k)] == k]
            expected = max(matches, key=lambda m: len(m[0]), default=None)
            got = tier.lookup(key)
            if expected is None:
                assert got is None
            else:
                assert got == (len(expected[0]), expected[1])
                lru.remove(expected)
                lru.append(expected)
        else:
            tier.discard(key)
            lru = [(k, s) for k, s in lru if k != key]
        assert tier.bytes_used <= budget
        assert tier.bytes_used == sum(s.nbytes for _, s in lru)
        assert tier.entries == len(lru)
    for k, _ in lru:
        assert tier.contains(k)


def test_concurrent_stats_reads() -> None:
    tier: HostTier[Snap] = HostTier(500)
    stop = threading.Event()
    seen: list[dict[str, int]] = []

    def reader() -> None:
        while not stop.is_set():
            seen.append(tier.stats())

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(2000):
            tier.put((i % 37, i % 5), Snap(60))
            tier.lookup((i % 37, i % 5, 1))
    finally:
        stop.set()
        thread.join()
    assert seen
    for s in seen:
        assert s["bytes_used"] <= 500 and s["bytes_used"] == 60 * s["entries"]
