"""Stop strings over streamed text: emit text as early as possible, but never a stop string or any part of one.

A stop string can arrive split over many tokens' text deltas ("<end" + "_of" + "_turn>"), so text that could
still turn out to be the start of a stop is held back until it either completes a stop (and is dropped) or
can no longer start one (and is released).

Which occurrence stops the stream: the one that *ends* first; among occurrences ending at the same place,
the one that starts first (i.e. the longest). Output is the text before it, and generation stops there.
The matcher must report a stop as soon as one is complete (the engine then frees the slot), so it cannot
wait to see whether a longer stop that started earlier would also complete: with stops ["abcd", "bc"],
"abc" stops at "bc" and emits "a". Within the text actually produced (up to the end of the match), this
is also the earliest-starting complete occurrence, which is the OpenAI/vLLM rule "truncate before the first
stop string"; unlike vLLM's per-token check, the result depends only on the concatenated text, never on how
it was split into deltas. Ties on the end go to the longer stop: with stops ["b", "ab"], "ab" stops with
matched == "ab" and emits "" (either way the emitted text is what precedes the earliest start).

Strings are compared as Python str (code points): the detokenizer is expected to hold back incomplete UTF-8
byte sequences itself, so a delta never ends inside a character.

Cost: one Knuth-Morris-Pratt automaton per stop string, carried across pushes (its state is the length of
the longest prefix of that stop the text now ends with), so each pushed character costs amortized O(1) per
stop and memory is linear in the stop strings' total length; the server bounds their count and length.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Incremental stop-string matcher for one generation stream."""

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            # Sequence[str] accepts a str too, which would make every character a stop.
            raise TypeError("stops must be a sequence of strings, not a single string")
        unique: dict[str, None] = {}
        for stop in stops:
            if not isinstance(stop, str):
                raise TypeError(f"stop strings must be str, got {type(stop).__name__}")
            if not stop:
                raise ValueError("empty stop string")
            unique[stop] = None
        self._stops: tuple[str, ...] = tuple(unique)
        self._fail = [_failure(stop) for stop in self._stops]
        self._state = [0] * len(self._stops)  # per stop: how much of it the text seen so far ends with
        self._held = ""
        self._matched: str | None = None
        self._finished = False

    @property
    def stops(self) -> tuple[str, ...]:
        """The distinct stop strings, in first-given order."""
        return self._stops

    @property
    def stopped(self) -> bool:
        return self._matched is not None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the stream, or None."""
        return self._matched

    @property
    def held(self) -> str:
        """Text received but not yet emitted because it may be the start of a stop string."""
        return self._held

    def push(self, delta: str) -> tuple[str, bool]:
        """Feed the next text delta. Returns (text now safe to emit, stopped). Once stopped (or flushed), further
        pushes raise RuntimeError."""
        if self._finished:
            state = f"stopped on {self._matched!r}" if self.stopped else "flushed"
            raise RuntimeError(f"push after the stream ended ({state})")
        pending = self._held + delta
        base = len(self._held)
        for i, char in enumerate(delta):
            done = None
            for j, stop in enumerate(self._stops):
                state, fail = self._state[j], self._fail[j]
                while state and stop[state] != char:
                    state = fail[state - 1]
                if stop[state] == char:
                    state += 1
                self._state[j] = state
                if state == len(stop) and (done is None or len(stop) > len(done)):
                    done = stop  # the first stop to end here; the longest among those ending together
            if done is not None:
                self._matched = done
                self._finished = True
                self._held = ""
                return pending[:base + i + 1 - len(done)], True
        # Hold back what may still grow into a stop: the longest prefix of any stop that the text ends with.
        cut = len(pending) - max(self._state, default=0)
        self._held = pending[cut:]
        return pending[:cut], False

    def flush(self) -> str:
        """End of generation without a stop: release the held-back text. Returns "" if the stream stopped
        (what was held followed the stop's start) or was already flushed."""
        if self._finished:
            return ""
        self._finished = True
        out, self._held = self._held, ""
        return out


def _failure(pattern: str) -> list[int]:
    """KMP failure function: for each prefix pattern[:i + 1], the length of its longest proper prefix that is
    also its suffix."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail
