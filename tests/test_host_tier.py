"""The host tier's radix tree of KV runs: any prefix of a stored run is served, shared heads are stored once,
scopes never mix, LRU leaves go first within the byte budget, and fetched KV is exactly what was stored."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from core.engine import SlotSnapshot
from scheduler.host_tier import HostTier, common_run

SCOPE = ("agent", None)
BYTES_PER_POSITION = 2 * 4 * 4  # "k" and "v" of 4 float32 each


def positions_kv(tokens, start: int = 0) -> SlotSnapshot:
    """KV whose values encode (position, token), so a fetch can be checked exactly."""
    pos = np.arange(start, len(tokens), dtype=np.float32)
    tok = np.asarray(tokens[start:], np.float32)
    k = np.stack([pos, tok, pos * 2, tok * 2], axis=1)
    return SlotSnapshot(start, len(tokens), {"layer0": {"k": k, "v": -k}})


def check_fetch(tier: HostTier, tokens, start: int, end: int, scope=SCOPE) -> None:
    got = tier.fetch(scope, tokens, start, end)
    want = positions_kv(tokens[:end], start)
    assert (got.start, got.end) == (start, end)
    assert np.array_equal(got.layers["layer0"]["k"], want.layers["layer0"]["k"])
    assert np.array_equal(got.layers["layer0"]["v"], want.layers["layer0"]["v"])


def test_any_prefix_of_a_stored_run_is_served() -> None:
    tier = HostTier(10_000)
    conv = (1, 2, 3, 4, 5, 6, 7, 8)
    assert tier.insert(SCOPE, conv, positions_kv(conv)) == 8
    assert tier.match(SCOPE, (1, 2, 3, 9)) == 3  # a prompt that leaves the run mid-edge
    assert tier.match(SCOPE, conv + (9, 9)) == 8
    assert tier.match(SCOPE, (2, 3)) == 0 and tier.match(SCOPE, ()) == 0
    check_fetch(tier, (1, 2, 3, 9), 0, 3)
    check_fetch(tier, conv + (9,), 2, 8)
    with pytest.raises(ValueError, match="not stored"):
        tier.fetch(SCOPE, (1, 2, 3, 9), 0, 4)


def test_a_shared_head_is_stored_once() -> None:
    tier = HostTier(10_000)
    system = tuple(range(100, 120))
    a, b = system + (1, 2, 3), system + (7, 8)
    tier.insert(SCOPE, a, positions_kv(a))
    # b's owner knows the tree holds its first 20 positions, so it sends only the rest.
    assert tier.match(SCOPE, b) == 20
    assert tier.insert(SCOPE, b, positions_kv(b, 20)) == 2
    assert tier.bytes_used == (20 + 3 + 2) * BYTES_PER_POSITION
    assert tier.stats()["nodes"] == 3  # the head, split off a's run, and the two tails
    check_fetch(tier, a, 0, 23)
    check_fetch(tier, b, 0, 22)
    check_fetch(tier, b, 5, 21)
    assert tier.insert(SCOPE, a, positions_kv(a, 10)) == 0  # already held
    # A run whose head the tree does not hold (evicted since the caller looked) is not stored.
    assert tier.insert(SCOPE, (5, 5, 5), positions_kv((5, 5, 5), 1)) == 0 and tier.match(SCOPE, (5, 5, 5)) == 0


def test_scopes_never_share() -> None:
    tier = HostTier(10_000)
    conv = (1, 2, 3, 4)
    tier.insert(("x", None), conv, positions_kv(conv))
    assert tier.match(("y", None), conv) == 0
    assert tier.match(("x", "salt"), conv) == 0
    assert tier.match(("x", None), conv) == 4


def test_least_recently_used_leaves_go_first() -> None:
    run = 10 * BYTES_PER_POSITION
    tier = HostTier(3 * run)
    convs = [tuple(range(k * 100, k * 100 + 10)) for k in range(3)]
    for conv in convs:
        tier.insert(SCOPE, conv, positions_kv(conv))
    tier.fetch(SCOPE, convs[0], 0, 5)  # conv 0 becomes the most recent; conv 1 is now the oldest
    assert tier.match(SCOPE, convs[1]) == 10  # match is a pure query: it refreshes nothing
    new = tuple(range(900, 910))
    assert tier.insert(SCOPE, new, positions_kv(new)) == 10
    assert tier.match(SCOPE, convs[1]) == 0
    assert all(tier.match(SCOPE, c) == 10 for c in (convs[0], convs[2], new))
    assert tier.stats()["evictions"] == 1 and tier.bytes_used == 3 * run


def test_a_node_with_children_outlives_them() -> None:
    """Evicting the tails of two sessions leaves their shared head, which is then a leaf itself."""
    tier = HostTier(22 * BYTES_PER_POSITION)
    system = tuple(range(10))
    a, b = system + (1, 2, 3, 4, 5), system + (7, 8, 9, 10, 11)
    tier.insert(SCOPE, a, positions_kv(a))
    tier.insert(SCOPE, b, positions_kv(b, 10))
    other = tuple(range(500, 512))
    tier.insert(SCOPE, other, positions_kv(other))  # 20 + 12 > 22: both tails go, oldest first
    assert tier.match(SCOPE, a) == 10 and tier.match(SCOPE, b) == 10
    assert tier.match(SCOPE, other) == 12
    assert tier.bytes_used == 22 * BYTES_PER_POSITION


def test_a_run_larger_than_the_budget_is_refused_without_side_effects() -> None:
    tier = HostTier(5 * BYTES_PER_POSITION)
    small = (1, 2, 3)
    tier.insert(SCOPE, small, positions_kv(small))
    big = tuple(range(50, 60))
    assert tier.insert(SCOPE, big, positions_kv(big)) == 0
    assert tier.match(SCOPE, small) == 3 and tier.match(SCOPE, big) == 0


def test_invalid_arguments() -> None:
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError):
            HostTier(bad)  # type: ignore[arg-type]
    tier = HostTier(100)
    with pytest.raises(ValueError, match="ends at"):
        tier.insert(SCOPE, (1, 2, 3), positions_kv((1, 2)))


def test_common_run_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(0, 400))
        label = tuple(int(x) for x in rng.integers(0, 3, size=n))
        key = list(label)
        cut = int(rng.integers(0, n + 1))
        if cut < n:
            key[cut] = 7
        key = (9, 9) + tuple(key) + (1,)
        want = next((i for i in range(min(len(key) - 2, n)) if key[2 + i] != label[i]), min(len(key) - 2, n))
        assert common_run(key, 2, label) == want


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_the_budget_and_serve_exact_kv(seed: int) -> None:
    """Random conversations over a few shared heads, against a model of what must hold: the budget is never
    exceeded, every match is a true common prefix of something stored, and fetched KV is always exact."""
    rng = random.Random(seed)
    tier = HostTier(300 * BYTES_PER_POSITION)
    heads = [tuple(rng.randrange(1000) for _ in range(rng.randrange(5, 40))) for _ in range(4)]
    stored: list[tuple[int, ...]] = []
    for _ in range(200):
        conv = rng.choice(heads) + tuple(rng.randrange(4) for _ in range(rng.randrange(1, 60)))
        have = tier.match(SCOPE, conv)
        if have < len(conv):
            tier.insert(SCOPE, conv, positions_kv(conv, have))
            stored.append(conv)
        assert tier.bytes_used <= tier.budget_bytes
        probe = rng.choice(stored)[: rng.randrange(1, 80)] + (5000,)
        n = tier.match(SCOPE, probe)
        assert n <= max(sum(1 for _ in iter_common(probe, s)) for s in stored)
        if n:
            check_fetch(tier, probe, rng.randrange(n), n)


def iter_common(a, b):
    for x, y in zip(a, b, strict=False):
        if x != y:
            return
        yield x


def test_concurrent_stats_reads() -> None:
    tier = HostTier(10_000)
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            stats = tier.stats()
            assert stats["bytes_used"] <= stats["budget_bytes"]

    thread = threading.Thread(target=reader)
    thread.start()
    for k in range(200):
        conv = (k % 7, k)
        tier.insert(SCOPE, conv, positions_kv(conv, tier.match(SCOPE, conv)))
    stop.set()
    thread.join()


class HeldCopy:
    """A snapshot still to be made (as `Engine.save_slot(wait=False)` returns one), whose copy lands only
    when ``release`` is called; counts how often, and on which threads, its arrays are made."""

    def __init__(self, tokens, start: int = 0, held: bool = True) -> None:
        self.made = positions_kv(tokens, start)
        self.landed = threading.Event()
        if not held:
            self.landed.set()
        self.threads: list[str] = []
        self.snapshot = SlotSnapshot(start, len(tokens), pending=self._make, position_bytes=BYTES_PER_POSITION)

    def _make(self):
        self.threads.append(threading.current_thread().name)
        assert self.landed.wait(10), "the test never released this copy"
        return self.made.layers

    def release(self) -> None:
        self.landed.set()


def test_a_run_whose_copy_has_not_landed_is_stored_and_served() -> None:
    tier = HostTier(10_000)
    system = tuple(range(100, 120))
    a, b = system + (1, 2, 3), system + (7, 8)
    held = HeldCopy(a)
    assert tier.insert(SCOPE, a, held.snapshot) == 23  # returns before the copy lands
    assert tier.bytes_used == 23 * BYTES_PER_POSITION  # counted from the shapes, not the arrays
    assert tier.match(SCOPE, b) == 20
    # a split of the run that has not landed: both parts are served from the one copy
    assert tier.insert(SCOPE, b, positions_kv(b, 20)) == 2
    held.release()
    check_fetch(tier, a, 0, 23)
    check_fetch(tier, b, 3, 22)
    tier.settle()
    assert len(held.threads) == 1  # the snapshot's arrays were made once
    assert tier.bytes_used == 25 * BYTES_PER_POSITION


def test_the_helper_thread_makes_runs_and_skips_dropped_ones() -> None:
    tier = HostTier(12 * BYTES_PER_POSITION)
    first, evicted, kept = HeldCopy((1,) * 10), HeldCopy((2,) * 10, held=False), HeldCopy((3,) * 10, held=False)
    tier.insert(SCOPE, (1,) * 10, first.snapshot)  # the helper waits inside this copy
    tier.insert(SCOPE, (2,) * 10, evicted.snapshot)  # evicts the first (least recently used)
    tier.insert(SCOPE, (3,) * 10, kept.snapshot)  # evicts the second before the helper reached it
    first.release()
    tier._unmade.join()
    assert evicted.threads == []  # dropped: its copy is never made
    assert kept.threads == ["slotserve-kv-host"]
    check_fetch(tier, (3,) * 10, 0, 10)
    assert tier.match(SCOPE, (1,) * 10) == tier.match(SCOPE, (2,) * 10) == 0


def test_copies_in_flight_are_bounded() -> None:
    from scheduler.host_tier import COPIES_IN_FLIGHT

    tier = HostTier(10**6)
    blocker = HeldCopy((0,) * 4)
    tier.insert(SCOPE, (0,) * 4, blocker.snapshot)
    queued = [HeldCopy((i, 1, 2)) for i in range(1, COPIES_IN_FLIGHT + 1)]
    for i, held in enumerate(queued, 1):
        tier.insert(SCOPE, (i, 1, 2), held.snapshot)
    over = HeldCopy((99, 1, 2), held=False)
    tier.insert(SCOPE, (99, 1, 2), over.snapshot)
    assert over.threads == [threading.current_thread().name]  # past the bound: made by the caller
    for held in [blocker, *queued]:
        held.release()
    tier.settle()
    check_fetch(tier, (99, 1, 2), 0, 3)
    check_fetch(tier, (COPIES_IN_FLIGHT, 1, 2), 1, 3)


def test_conversations_wait_for_copies_in_flight() -> None:
    tier = HostTier(10_000)
    conv = (5, 6, 7, 8)
    held = HeldCopy(conv)
    tier.insert(SCOPE, conv, held.snapshot)
    threading.Timer(0.05, held.release).start()
    [(scope, tokens, snap)] = tier.conversations()
    assert (scope, tokens) == (SCOPE, conv)
    assert np.array_equal(snap.layers["layer0"]["k"], positions_kv(conv).layers["layer0"]["k"])
