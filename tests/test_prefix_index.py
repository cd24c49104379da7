from __future__ import annotations

import random
import time

import numpy as np
import pytest

from scheduler.prefix_index import _EMPTY, PrefixIndex, _common_len, as_key


def check_structure(index: PrefixIndex) -> None:
    """Radix-tree invariants: non-empty labels, children keyed by their first token, no valueless node with
    fewer than two children except the root (i.e. removal pruned and merged), and the size count is right."""
    count = 0
    stack = [(index._root, True)]
    while stack:
        node, is_root = stack.pop()
        if node.value is not _EMPTY:
            count += 1
        if not is_root:
            assert len(node.label) > 0
            assert node.value is not _EMPTY or len(node.children) >= 2
        for first, child in node.children.items():
            assert child.label[0] == first
            stack.append((child, False))
    assert index._root.value is _EMPTY
    assert count == len(index)


def brute_longest(ref: dict[tuple[int, ...], object], key: tuple[int, ...]):
    best = None
    for k, v in ref.items():
        if len(k) <= len(key) and key[: len(k)] == k and (best is None or len(k) > best[0]):
            best = (len(k), v)
    return best


def random_key(rng: random.Random, bases: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Keys that share prefixes heavily: a prefix of a base key, optionally with a short random tail."""
    base = rng.choice(bases)
    key = base[: rng.randint(0, len(base))]
    if rng.random() < 0.5:
        key += tuple(rng.randrange(4) for _ in range(rng.randint(0, 6)))
    if not key:
        key = (rng.randrange(4),)
    return key


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_match_dict(seed: int) -> None:
    rng = random.Random(seed)
    shared = tuple(rng.randrange(4) for _ in range(40))
    bases = [shared + tuple(rng.randrange(4) for _ in range(rng.randint(0, 30))) for _ in range(6)]
    bases += [tuple(rng.randrange(4) for _ in range(20)) for _ in range(3)]
    index: PrefixIndex[int] = PrefixIndex()
    ref: dict[tuple[int, ...], int] = {}
    for step in range(3000):
        key = random_key(rng, bases)
        form = rng.choice([tuple, list, lambda k: np.array(k, dtype=np.int32)])
        op = rng.random()
        if op < 0.4:
            assert index.insert(form(key), step) == ref.get(key)
            ref[key] = step
        elif op < 0.65:
            assert index.remove(form(key)) == ref.pop(key, None)
        elif op < 0.8:
            assert index.get(form(key)) == ref.get(key)
            assert (form(key) in index) == (key in ref)
        else:
            assert index.longest_prefix(form(key)) == brute_longest(ref, key)
        assert len(index) == len(ref)
        if step % 50 == 0:
            check_structure(index)
    check_structure(index)
    assert dict(index.items()) == ref
    assert [k for k, _ in index.items()] == sorted(ref)
    for key in list(ref):
        assert index.remove(key) == ref.pop(key)
        check_structure(index)
    assert len(index) == 0 and list(index.items()) == []
    assert not index._root.children


def test_common_len_matches_brute_force() -> None:
    rng = random.Random(3)
    for _ in range(500):
        n = rng.choice([1, 5, 9, 63, 64, 65, 200, 3000])
        label = tuple(rng.randrange(1000) for _ in range(n))
        cut = rng.randint(0, n)
        key = (7,) * 3 + label[:cut] + tuple(rng.randrange(1000, 2000) for _ in range(rng.randint(0, 3)))
        expected = next((i for i, (a, b) in enumerate(zip(key[3:], label, strict=False)) if a != b), None)
        if expected is None:
            expected = min(len(key) - 3, n)
        assert _common_len(key, 3, label) == expected


def test_empty_key() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    for empty in ((), [], np.array([], dtype=np.int64)):
        with pytest.raises(ValueError):
            index.insert(empty, "x")
    index.insert((1, 2), "a")
    assert index.get(()) is None
    assert () not in index
    assert index.remove(()) is None
    assert index.longest_prefix(()) is None
    assert len(index) == 1


def test_replacement_returns_old_value() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    assert index.insert([1, 2, 3], "a") is None
    assert index.insert((1, 2, 3), "b") == "a"
    assert len(index) == 1
    assert index.get([1, 2, 3]) == "b"


def test_none_is_a_storable_value() -> None:
    index: PrefixIndex[None] = PrefixIndex()
    index.insert((5,), None)
    assert (5,) in index and len(index) == 1
    assert index.longest_prefix((5, 6)) == (1, None)


def test_split_and_merge() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    index.insert((1, 2, 3, 4, 5), "long")
    index.insert((1, 2, 3, 9), "branch")  # splits the edge at 3 tokens
    index.insert((1, 2), "mid")  # splits again, value on the new node
    assert index.get((1, 2, 3)) is None
    assert index.get((1, 2)) == "mid"
    check_structure(index)
    assert index.remove((1, 2, 3, 9)) == "branch"  # (1,2,3) branch node now has one child: merged away
    check_structure(index)
    root_child = index._root.children[1]
    assert root_child.label == (1, 2)
    (only,) = root_child.children.values()
    assert only.label == (3, 4, 5) and only.value == "long"
    assert index.remove((1, 2)) == "mid"  # valueless with one child: merged into it
    check_structure(index)
    assert index._root.children[1].label == (1, 2, 3, 4, 5)
    assert index.remove((1, 2, 3, 4, 5)) == "long"
    assert not index._root.children


def test_remove_absent_keys_changes_nothing() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    index.insert((1, 2, 3, 4), "a")
    index.insert((1, 2, 7), "b")
    for absent in ((1, 2), (1, 2, 3), (1, 2, 3, 4, 5), (9,), (1, 2, 8)):
        assert index.remove(absent) is None
    assert len(index) == 2
    check_structure(index)


def test_longest_prefix() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    index.insert((1, 2), "two")
    index.insert((1, 2, 3, 4), "four")
    index.insert((1, 2, 3, 4, 5, 6), "six")
    assert index.longest_prefix((1,)) is None
    assert index.longest_prefix((1, 2)) == (2, "two")
    assert index.longest_prefix((1, 2, 3)) == (2, "two")
    assert index.longest_prefix((1, 2, 3, 4, 5)) == (4, "four")  # (1..6) is not a prefix of it
    assert index.longest_prefix((1, 2, 3, 4, 5, 6, 7)) == (6, "six")
    assert index.longest_prefix((1, 2, 3, 5, 5, 6)) == (2, "two")  # diverges inside an edge
    assert index.longest_prefix((2, 1)) is None
    assert index.longest_prefix(np.array([1, 2, 3, 4], dtype=np.uint16)) == (4, "four")


def test_longest_prefix_is_always_a_prefix() -> None:
    rng = random.Random(7)
    index: PrefixIndex[tuple[int, ...]] = PrefixIndex()
    for _ in range(300):
        key = tuple(rng.randrange(3) for _ in range(rng.randint(1, 12)))
        index.insert(key, key)
    for _ in range(2000):
        query = tuple(rng.randrange(3) for _ in range(rng.randint(0, 14)))
        found = index.longest_prefix(query)
        if found is not None:
            n, stored = found
            assert stored == query[:n] and len(stored) == n
        # No longer stored prefix exists.
        for m in range(len(query), (found[0] if found else 0), -1):
            assert query[:m] not in index


def test_key_types() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    index.insert(np.array([3, 4, 5], dtype=np.int64), "a")
    assert index.get([3, 4, 5]) == "a"
    assert index.get((3, 4, 5)) == "a"
    assert [np.int32(3), np.int32(4), np.int32(5)] in index
    assert list(index.items()) == [((3, 4, 5), "a")]
    assert all(type(t) is int for t in next(index.keys()))
    with pytest.raises(TypeError):
        index.insert(np.array([1.0, 2.0]), "float")
    with pytest.raises(ValueError):
        index.insert(np.zeros((2, 2), dtype=np.int64), "2d")
    with pytest.raises(TypeError):
        index.insert("abc", "str")  # type: ignore[arg-type]
    assert "abc" not in index
    assert as_key(range(3)) == (0, 1, 2)


def test_clear() -> None:
    index: PrefixIndex[int] = PrefixIndex()
    index.insert((1,), 1)
    index.clear()
    assert len(index) == 0 and index.get((1,)) is None


def test_long_keys_are_fast() -> None:
    """8K-token keys sharing a 2K system prompt: no per-token Python work on the hot paths."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, 262144, 2048).tolist()
    keys = [tuple(system + rng.integers(0, 262144, 6144).tolist()) for _ in range(50)]
    index: PrefixIndex[int] = PrefixIndex()
    start = time.perf_counter()
    for i, key in enumerate(keys):
        index.insert(key, i)
        index.insert(key[:4096], i)  # splits an 8K edge near its middle
    for i, key in enumerate(keys):
        assert index.get(key) == i
        assert index.longest_prefix(key + (1, 2, 3)) == (8192, i)
        assert index.longest_prefix(key[:6000]) == (4096, i)
    elapsed = time.perf_counter() - start
    # ~450 operations on 8K keys; per-token Python loops would take tens of seconds.
    assert elapsed < 2.0, elapsed
    check_structure(index)


def test_prompt_lookup_draft_follows_the_latest_longest_match():
    from scheduler.speculation import propose_draft

    assert propose_draft([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert propose_draft([5, 6, 7, 5, 6, 8, 5, 6], 2) == [8, 5]  # the latest occurrence of [5, 6]
    assert propose_draft([1, 2, 3, 4, 9, 2, 3, 4], 2) == [9, 2]  # longest suffix (2, 3, 4) wins over (4,)
    assert propose_draft([1, 2, 3, 4], 3) == []
    assert propose_draft([7, 7], 4) == [7]
    assert propose_draft([1, 2], 0) == [] and propose_draft([], 3) == []


def test_draft_index_grown_token_by_token_drafts_what_the_full_scan_drafts():
    """The scheduler's incremental index (a prompt, then generated tokens a few at a time) proposes exactly
    propose_draft's draft at every length, on repetitive and on random histories."""
    from scheduler.speculation import DraftIndex, propose_draft

    rng = np.random.default_rng(5)
    for vocab in (3, 12, 1000):
        history = [int(t) for t in rng.integers(0, vocab, size=300)]
        index = DraftIndex()
        index.extend(history[:40])
        done = 40
        while done < len(history):
            for max_tokens in (0, 1, 2, 7):
                assert index.draft(max_tokens) == propose_draft(history[:done], max_tokens), (vocab, done)
            step = int(rng.integers(1, 4))
            index.extend(history[done:done + step])
            done += step
    assert DraftIndex().draft(3) == []
