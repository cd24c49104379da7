"""No repeated keys in a generated JSON object: the host masks the token that would close a key already used in
the object being written (docs/structured-output.md, "No repeated keys").

A grammar engine enforces each declared property at most once, but an open object (`additionalProperties`,
`patternProperties`, `json_object` mode) admits any key again, and a small model repeats one
(`"p":"44","p":"45",...`). `KeyTracker` follows the bytes of the document as its tokens are accepted (a
JSON lexer: open objects and arrays, whether a string is a key, the key's bytes so far, the keys each open
object already has) and, while a key is being written, removes from the row's mask every allowed token that
would close the key on one of those keys (compared decoded, so an escape spelling of a used key is caught
too). The grammar's own mask still decides everything else. If every allowed token would repeat a key (a
grammar whose keys are a finite set, all used), the mask is left as it is rather than leave none.

`quote_tokens` lists the tokens that hold a quote byte (only those can close a key); it is built once per
tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

QUOTE, BACKSLASH = 0x22, 0x5C
OPEN_OBJECT, OPEN_ARRAY, CLOSERS, COMMA = 0x7B, 0x5B, (0x7D, 0x5D), 0x2C

__all__ = ["KeyTracker", "QuoteTokens", "quote_tokens"]


@dataclass(frozen=True)
class QuoteTokens:
    """Token ids [Q] whose bytes hold a quote, those bytes, how many quotes each holds ([Q]), and the
    tokenizer's bytes of any token."""

    ids: np.ndarray
    pieces: tuple[bytes, ...]
    quotes: np.ndarray
    index: dict[int, int]  # token id -> its position in `ids`
    # Bitmask words [ceil(V/32)] of the tokens that would grow a document by a member or an item: outside a
    # string those holding `,`, `{` or `[`; inside one those that close it and then hold one of them.
    growth_outside: np.ndarray
    growth_inside: np.ndarray
    token_bytes: Callable[[int], bytes] = field(compare=False)
    _at_least: dict[int, np.ndarray] = field(default_factory=dict, compare=False)

    def with_at_least(self, n: int) -> np.ndarray:
        """The ids of the tokens holding at least ``n`` quotes (2 or 3: kept, they are asked for every step)."""
        found = self._at_least.get(n)
        if found is None:
            found = self._at_least[n] = self.ids[self.quotes >= n]
        return found


def quote_tokens(tokenizer) -> QuoteTokens:
    """Every non-special token of ``tokenizer`` whose bytes contain a quote, and the growth bitmasks."""
    special = tokenizer.special_ids
    pieces = [b"" if i in special else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    found = [(i, piece) for i, piece in enumerate(pieces) if b'"' in piece]
    growth = re.compile(rb"[,{\[]")
    outside = [i for i, piece in enumerate(pieces) if growth.search(piece)]
    inside = [i for i, piece in found if growth.search(piece, piece.index(b'"'))]
    return QuoteTokens(np.array([i for i, _ in found], np.int64), tuple(p for _, p in found),
                       np.array([p.count(b'"') for _, p in found], np.int64),
                       {i: n for n, (i, _) in enumerate(found)}, _bits(outside, len(pieces)),
                       _bits(inside, len(pieces)), tokenizer.token_bytes)


def _bits(ids: list[int], vocab_size: int) -> np.ndarray:
    words = np.zeros((vocab_size + 31) // 32, np.uint32)
    index = np.asarray(ids, np.int64)
    np.bitwise_or.at(words, index >> 5, np.uint32(1) << (index & 31).astype(np.uint32))
    return words


def _decoded(raw: bytes) -> str | None:
    """A JSON string's value from its bytes between the quotes, or None when they are not a whole string."""
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return None


@dataclass
class _Lexer:
    """Where a JSON text stands, byte by byte: the open containers (an object's keys so far, or None for an
    array), whether it is inside a string and whether that string is a key, the key's bytes so far. `fork` is
    cheap: the forks share the objects' key sets until one adds a key (copy on write)."""

    frames: list[set[str] | None] = field(default_factory=list)
    owned: list[bool] = field(default_factory=list)  # frames[i] may be changed in place
    in_string: bool = False
    escape: bool = False
    is_key: bool = False
    expect_key: bool = False
    key: bytearray = field(default_factory=bytearray)

    def fork(self) -> _Lexer:
        return _Lexer(list(self.frames), [False] * len(self.frames), self.in_string, self.escape, self.is_key,
                      self.expect_key, bytearray(self.key))

    def repeats_in(self, data: bytes) -> bool:
        """Advance over ``data``; True when it closed a key on one its object already had."""
        return any([self.step(b) for b in data])

    def step(self, b: int) -> bool:
        """Advance one byte; True when it closed a key its object already had."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif b == BACKSLASH:
                self.escape = True
            elif b == QUOTE:
                self.in_string = False
                return self.is_key and self._add_key()
            if self.is_key:
                self.key.append(b)
            return False
        if b == QUOTE:
            top_is_object = bool(self.frames) and self.frames[-1] is not None
            self.in_string, self.is_key, self.expect_key = True, top_is_object and self.expect_key, False
            self.key.clear()
        elif b in (OPEN_OBJECT, OPEN_ARRAY):
            self.frames.append(set() if b == OPEN_OBJECT else None)
            self.owned.append(True)
            self.expect_key = b == OPEN_OBJECT
        elif b in CLOSERS:
            if self.frames:
                self.frames.pop()
                self.owned.pop()
            self.expect_key = False
        elif b == COMMA:
            self.expect_key = bool(self.frames) and self.frames[-1] is not None
        return False

    def _add_key(self) -> bool:
        if not self.frames or self.frames[-1] is None:
            return False
        name = _decoded(bytes(self.key))
        if name is None:
            return False
        if name in self.frames[-1]:
            return True
        if not self.owned[-1]:
            self.frames[-1], self.owned[-1] = set(self.frames[-1]), True
        self.frames[-1].add(name)
        return False


@dataclass
class KeyTracker:
    """One output's JSON lexer and its tokenizer's quote tokens. With `restart_at` (a tool-call marker) each
    occurrence starts a new document; `armed` False skips the output until the first one (free text before a
    call is not JSON)."""

    quotes: QuoteTokens
    restart_at: bytes = b""
    armed: bool = True
    lexer: _Lexer = field(default_factory=_Lexer)
    _tail: bytes = b""  # the last bytes seen, to find `restart_at` across token boundaries

    def feed_token(self, token: int) -> None:
        """Advance over an accepted (non-stop) token."""
        self.feed(self.quotes.token_bytes(token))

    def feed(self, data: bytes) -> None:
        """Advance over the bytes of accepted output."""
        if self.restart_at:
            seen = self._tail + data
            at = seen.rfind(self.restart_at)
            self._tail = seen[-len(self.restart_at):]
            if at >= 0:  # a new call: a new document from here
                self.lexer, self.armed = _Lexer(), True
                data = seen[at + len(self.restart_at):]
        if self.armed:
            self.lexer.repeats_in(data)

    def drop_repeats(self, row_mask: np.ndarray) -> int:
        """Clear from ``row_mask`` ([ceil(V/32)] uint32, the grammar's) the tokens that would close a key on one
        its object already has, unless that would leave no token; how many were cleared."""
        repeats = self.repeating(row_mask)
        if not repeats:
            return 0
        ids = np.asarray(repeats, np.int64)
        kept = row_mask.copy()
        np.bitwise_and.at(kept, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        if not kept.any():
            return 0
        row_mask[:] = kept
        return len(repeats)

    def repeating(self, row_mask: np.ndarray) -> list[int]:
        """The allowed tokens (bits of ``row_mask``, [ceil(V/32)] uint32) that would close a key on one its
        object already has."""
        lexer, quotes = self.lexer, self.quotes
        if not self.armed or not any(lexer.frames):
            return []  # no object has a key yet: nothing can repeat
        # A token can close a key on a used one if it closes the key being written (one quote: only when a used
        # key starts like it), or opens and closes one (two quotes), or ends the string it is in first (three).
        needed = 1 if self._key_may_repeat() else 3 if lexer.in_string and not lexer.is_key else 2
        candidates = quotes.with_at_least(needed) if needed > 1 else quotes.ids
        allowed = candidates[(row_mask[candidates >> 5] >> (candidates & 31).astype(np.uint32)) & 1 == 1]
        return [int(token) for token in allowed if lexer.fork().repeats_in(quotes.pieces[quotes.index[token]])]

    def _key_may_repeat(self) -> bool:
        """Inside a key that a used key of its object starts with (as far as its bytes decode): any quote
        token may close it on that key; otherwise only a token holding several quotes can close a key."""
        lexer = self.lexer
        if not (lexer.in_string and lexer.is_key and lexer.frames and lexer.frames[-1]):
            return False
        prefix = _decoded(bytes(lexer.key))
        return prefix is None or any(name.startswith(prefix) for name in lexer.frames[-1])

    def growth(self) -> np.ndarray | None:
        """Bitmask words of the tokens that would add a member or an item from where the document stands
        (`QuoteTokens.growth_*`); None where nothing is tracked."""
        if not self.armed:
            return None
        return self.quotes.growth_inside if self.lexer.in_string else self.quotes.growth_outside

    def path_lexer(self) -> _Lexer | None:
        """A fork of the lexer for a closing path to check its tokens against (None: nothing is tracked)."""
        return self.lexer.fork() if self.armed else None
