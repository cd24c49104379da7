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

Cost: each push scans the held-back text plus the delta once per distinct stop (str.find, in C), and tries
at most (longest stop - 1) suffixes against a set of stop prefixes: O(total length x number of stops +
pushes x longest stop^2) overall.
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
        # Every proper prefix of every stop: the text that may still grow into a stop and must be held back.
        self._prefixes: frozenset[str] = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
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
        # The held text contains no complete stop and every earlier start was ruled out when it was released,
        # so any occurrence found in `pending` is new, and the first one per stop is the first to end.
        best_end = best_start = -1
        best_stop: str | None = None
        for stop in self._stops:
            start = pending.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best_stop is None or end < best_end or (end == best_end and start < best_start):
                best_end, best_start, best_stop = end, start, stop
        if best_stop is not None:
            self._matched = best_stop
            self._finished = True
            self._held = ""
            return pending[:best_start], True
        # Hold back the longest suffix that is a proper prefix of some stop; everything before it is safe.
        hold = 0
        for k in range(min(len(pending), self._max_hold), 0, -1):
            if pending[-k:] in self._prefixes:
                hold = k
                break
        cut = len(pending) - hold
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
