from __future__ import annotations

import random

import pytest

from scheduler.stop_strings import StopMatcher


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Brute force: the first end position at which some stop is complete; among stops ending there, the one
    starting earliest. Returns (text before it, that stop) or (text, None)."""
    for end in range(1, len(text) + 1):
        candidates = [s for s in stops if text[:end].endswith(s)]
        if candidates:
            stop = max(candidates, key=len)
            return text[: end - len(stop)], stop
    return text, None


def longest_held(text: str, stops: list[str]) -> str:
    """Longest suffix of text that is a proper prefix of some stop (what must still be held back)."""
    for k in range(len(text), 0, -1):
        if any(len(s) > k and s.startswith(text[-k:]) for s in stops):
            return text[-k:]
    return ""


def run(stops: list[str], deltas: list[str]) -> tuple[str, StopMatcher]:
    matcher = StopMatcher(stops)
    out = []
    for delta in deltas:
        text, stopped = matcher.push(delta)
        out.append(text)
        if stopped:
            break
    out.append(matcher.flush())
    return "".join(out), matcher


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    # Empty deltas happen (a token that decodes to nothing yet).
    for _ in range(rng.randint(0, 2)):
        deltas.insert(rng.randint(0, len(deltas)), "")
    return deltas


def test_stop_split_char_by_char() -> None:
    stops = ["<end_of_turn>"]
    text = "Hello <world> <end_of_turn> ignored"
    matcher = StopMatcher(stops)
    emitted = ""
    for ch in text:
        out, stopped = matcher.push(ch)
        emitted += out
        assert "<e" not in emitted
        if stopped:
            break
    assert stopped and matcher.stopped and matcher.matched == "<end_of_turn>"
    assert emitted == "Hello <world> "
    assert matcher.flush() == ""


def test_stop_split_over_token_deltas() -> None:
    out, matcher = run(["<end_of_turn>"], ["Done.", "<end", "_of", "_turn", ">", "more"])
    assert out == "Done." and matcher.matched == "<end_of_turn>"


def test_stop_at_very_start() -> None:
    matcher = StopMatcher(["###"])
    assert matcher.push("##") == ("", False)
    assert matcher.push("#abc") == ("", True)
    assert matcher.matched == "###"
    assert StopMatcher(["x"]).push("xyz") == ("", True)


def test_held_back_text_released_as_soon_as_possible() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("abc ST") == ("abc ", False)
    assert matcher.held == "ST"
    assert matcher.push("O") == ("", False)
    assert matcher.push("P!") == ("", True)
    matcher = StopMatcher(["STOP"])
    assert matcher.push("ST") == ("", False)
    assert matcher.push("x") == ("STx", False)  # can no longer start a stop
    assert matcher.held == ""
    assert matcher.push("SS") == ("S", False)  # "SS": only the last S may start STOP
    assert matcher.flush() == "S"


def test_failed_partial_match_restarts() -> None:
    # "aab" within "aaab": the attempt starting at the first "a" fails, the one starting at the second wins.
    out, matcher = run(["aab"], list("aaab"))
    assert out == "a" and matcher.matched == "aab"
    matcher = StopMatcher(["aab"])
    assert matcher.push("a") == ("", False)
    assert matcher.push("a") == ("", False)
    assert matcher.push("a") == ("a", False)  # the first "a" can no longer start "aab"
    assert matcher.push("b") == ("", True)
    out, _ = run(["abcabd"], ["abcab", "cabd"])
    assert out == "abc"


def test_overlapping_candidates_first_to_end_wins() -> None:
    # "ab" completes before "abc" could; the stream stops there.
    out, matcher = run(["abc", "ab"], ["xab", "c"])
    assert out == "x" and matcher.matched == "ab"
    # A shorter stop completing inside a longer one that started earlier stops first: generation cannot wait.
    out, matcher = run(["abcd", "bc"], ["abcd"])
    assert out == "a" and matcher.matched == "bc"
    out, matcher = run(["abcd", "bc"], list("abcd"))
    assert out == "a" and matcher.matched == "bc"
    # Same end: the one starting first (the longer) is reported; the emitted text precedes it.
    out, matcher = run(["b", "ab"], ["zab"])
    assert out == "z" and matcher.matched == "ab"
    # In one delta, an earlier-ending stop wins over one listed first.
    out, matcher = run(["zzz", "y"], ["xyzzz"])
    assert out == "x" and matcher.matched == "y"


def test_unicode_stops() -> None:
    out, matcher = run(["。\n", "🛑"], ["こんにちは", "。", "\n次"])
    assert out == "こんにちは" and matcher.matched == "。\n"
    out, matcher = run(["🛑"], ["é", "🛑", "x"])
    assert out == "é" and matcher.matched == "🛑"
    out, matcher = run(["ünï"], list("aü ünïb"))
    assert out == "aü "


def test_no_stop_flush_returns_everything() -> None:
    out, matcher = run(["</s>"], ["a </", "b> </", "s"])
    assert out == "a </b> </s" and not matcher.stopped and matcher.matched is None
    out, _ = run([], ["any", "thing"])
    assert out == "anything"


def test_errors_and_lifecycle() -> None:
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])
    with pytest.raises(TypeError):
        StopMatcher("stop")
    with pytest.raises(TypeError):
        StopMatcher([b"bytes"])  # type: ignore[list-item]
    matcher = StopMatcher(["x", "x"])  # duplicates fine
    assert matcher.stops == ("x",)
    assert matcher.push("") == ("", False)
    assert matcher.push("ax") == ("a", True)
    with pytest.raises(RuntimeError):
        matcher.push("more")
    assert matcher.flush() == ""
    matcher = StopMatcher(["x"])
    assert matcher.flush() == ""
    with pytest.raises(RuntimeError):
        matcher.push("y")


def test_property_against_reference() -> None:
    rng = random.Random(1234)
    alphabet = "abc"
    for _ in range(1500):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        expected, expected_stop = reference(text, stops)
        for _ in range(4):
            deltas = random_split(rng, text)
            matcher = StopMatcher(stops)
            emitted = ""
            consumed = ""
            stopped = False
            for delta in deltas:
                out, stopped = matcher.push(delta)
                emitted += out
                consumed += delta
                # Never emits beyond the reference output: no stop string or part of one.
                assert expected.startswith(emitted)
                if stopped:
                    break
                # Everything is released except exactly what could still start a stop.
                assert emitted + matcher.held == consumed
                assert matcher.held == longest_held(consumed, stops)
            emitted += matcher.flush()
            assert emitted == expected, (text, stops, deltas)
            assert matcher.matched == expected_stop
            assert stopped == (expected_stop is not None)


def test_long_stops_keep_linear_state_and_match_correctly() -> None:
    """Sixteen 512-character stops: the matcher keeps one failure table per stop (linear in their total length,
    not every prefix), and a stream of near-misses ("aaa...a" against "aaa...ab") holds back exactly the part
    that may still become a stop, then stops on the first complete one."""
    stops = ["a" * 511 + chr(ord("b") + i) for i in range(16)]
    m = StopMatcher(stops)
    assert sum(len(f) for f in m._fail) == sum(len(s) for s in stops)
    out = []
    for _ in range(2000):
        text, stopped = m.push("a")
        out.append(text)
        assert not stopped
    assert len("".join(out)) == 2000 - 511 and m.held == "a" * 511
    text, stopped = m.push("cX")
    assert stopped and m.matched == stops[1] and text == ""
