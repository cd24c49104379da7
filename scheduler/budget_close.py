"""Documents that close within max_tokens: a constrained output that would be cut by its token budget is
steered, near the end, along a closing path of its grammar, so the client gets a complete, valid document
instead of a truncated one (docs/structured-output.md, "Closing within the budget").

Per constrained sequence (`BudgetClose`), unless it is writing free text (tool choice auto), the scheduler
asks `GrammarMatcher.closing_path` how many tokens would end it from the current state: from FIRST_MEASURE
tokens before the budget on, every RECHECK_TOKENS tokens, and at every step once the budget left comes
within RECHECK_TOKENS of that length. In the WIND_DOWN tokens before the closing point no token may start
another member or item. When the tokens left are at most the path's length + CLOSE_SLACK (and at least its
length), the sequence closes: from then on its mask allows only the path's next token. The
path is a valid ending by construction (each step is one the grammar allows), so the document validates.
If a path does not fit any more (one sampled token raised the closing length by more than the slack, or a
document needs more than FIRST_MEASURE tokens to close), the sequence runs to max_tokens as before:
`length`. The grammar's mask is filled in any case; the closing rule only narrows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.grammar_backends import GrammarMatcher

CLOSE_SLACK = 3  # close this many tokens before the budget would stop fitting the path, for what a token adds
FIRST_MEASURE = 96  # the closing length is first measured when this many tokens are left (most outputs end
                    # before: they pay nothing)
RECHECK_TOKENS = 16  # how stale a measured closing length may get while the budget is far from it
WIND_DOWN = 12  # tokens before the closing point from which no new member or item may start
PATH_LIMIT = 512  # longest closing path searched for (a longer ending never fits a sensible budget)

__all__ = ["BudgetClose", "CLOSE_SLACK", "RECHECK_TOKENS"]


@dataclass
class BudgetClose:
    """One constrained sequence's closing state."""

    path: list[int] | None = None  # a closing path from the grammar state after `measured_at` tokens
    measured_at: int = -1  # generated tokens when `path` was measured (-1: never)
    closing: bool = False  # the sequence follows `path` to its end

    def narrow(self, matcher: GrammarMatcher, generated: int, max_tokens: int, row_mask: np.ndarray) -> None:
        """Narrow the row's grammar mask ([ceil(V/32)] uint32, in place) for ``generated`` tokens out of
        ``max_tokens``: only the closing path's next token once the sequence closes; in the WIND_DOWN tokens
        before that, no token that would start another member or item (`KeyTracker.growth`), the path's
        next token always allowed, the mask never left empty."""
        token = self.forced_token(matcher, generated, max_tokens)
        if token is not None:
            row_mask[:] = 0
            row_mask[token >> 5] = np.uint32(1 << (token & 31))
            return
        left = max_tokens - generated
        if self.path and matcher.keys is not None and left <= len(self.path) + CLOSE_SLACK + WIND_DOWN:
            growth = matcher.keys.growth()
            if growth is None:
                return
            kept = row_mask.copy()
            n = min(len(growth), len(kept))
            kept[:n] &= ~growth[:n]
            first = self.path[0]
            kept[first >> 5] |= row_mask[first >> 5] & np.uint32(1 << (first & 31))
            if kept.any():
                row_mask[:] = kept

    def forced_token(self, matcher: GrammarMatcher, generated: int, max_tokens: int) -> int | None:
        """The only token the sequence may take next to end its document within ``max_tokens`` (``generated``
        so far), or None: sample as usual."""
        if self.closing:
            self._advance(generated)
            return self.path[0] if self.path else None
        left = max_tokens - generated
        if left > FIRST_MEASURE:
            return None  # checked first: it costs nothing, and most steps of most outputs stop here
        if matcher.is_accepting() and matcher.keys is not None and not matcher.keys.armed:
            return None  # free text (before any tool call) may end anywhere: nothing to close
        stale = generated - self.measured_at >= RECHECK_TOKENS or self.measured_at < 0
        near = self.path is not None and left <= len(self.path) + CLOSE_SLACK + RECHECK_TOKENS
        if stale or near:
            self.path, self.measured_at = matcher.closing_path(PATH_LIMIT), generated
        if self.path is not None and len(self.path) <= left <= len(self.path) + CLOSE_SLACK:
            self._advance(generated)
            self.closing = True
            return self.path[0]
        return None

    def _advance(self, generated: int) -> None:
        """Drop the path's tokens taken since it was measured (each one was the forced token)."""
        if self.path is not None and generated > self.measured_at:
            self.path = self.path[generated - self.measured_at:]
            self.measured_at = generated
