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

import itertools
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache, reduce

import numpy as np

from scheduler.item_space import ItemSpace, Value, literal_value, number_value
from scheduler.pattern_items import PatternItems
from scheduler.unique_items import SchemaNav

QUOTE, BACKSLASH = 0x22, 0x5C
OPEN_OBJECT, OPEN_ARRAY, CLOSERS, COMMA = 0x7B, 0x5B, (0x7D, 0x5D), 0x2C
JSON_SPACE = frozenset(b" \t\n\r")
# What a number or a literal item is spelled with; a token of only these (and of what may end an item) is one
# that could write such an item.
SCALAR_BYTES = frozenset(b"-+.0123456789eEtrufalsn")
_VERSIONS = itertools.count(1)  # `_Lexer.version`s: unique across lexers, so a cache never mistakes one for another

__all__ = ["KeyTracker", "QuoteTokens", "quote_tokens"]


@dataclass(frozen=True)
class QuoteTokens:
    """Token ids [Q] whose bytes hold a quote, the texts each could close a string on, and the tokenizer's
    bytes of any token."""

    ids: np.ndarray
    # Decoded text between any two quotes of a token -> the tokens holding it so: only those can close a
    # string they also open on a given key or item.
    enclosing: dict[str, list[int]]
    # The decoded text a token adds to a string before the unescaped quote that closes it (read from a string
    # not inside an escape) -> the tokens: those may close a string on a given key or item.
    closes_with: dict[str, list[int]]
    # Bitmask words [ceil(V/32)] of the tokens that would grow a document by a member or an item: outside a
    # string those holding `,`, `{` or `[`; inside one those that close it and then hold one of them.
    growth_outside: np.ndarray
    growth_inside: np.ndarray
    # ids [n] that may write or end a number or literal item: those holding `,` or `]`, and those of only
    # SCALAR_BYTES, JSON whitespace and `}`
    scalar_tokens: np.ndarray
    quoted_scalar_ends: np.ndarray  # ids holding a quote and then `,` or `]` (ending a string, then an item)
    token_bytes: Callable[[int], bytes] = field(compare=False)
    by_bytes: dict[bytes, list[int]] = field(default_factory=dict, compare=False)  # every token id by its bytes

    def enclosing_any(self, texts: Iterable[str]) -> set[int]:
        """The ids of the tokens that hold one of ``texts`` between two of their quotes."""
        return {i for text in texts for i in self.enclosing.get(text, ())}

    def closing_on(self, written: bytes, texts: Iterable[str]) -> set[int]:
        """The ids of the tokens that close a string whose bytes so far are ``written`` on one of ``texts``
        (compared decoded, so escape spellings count); every quote token while ``written`` ends inside an
        escape (then a token's first byte belongs to it) or on half a surrogate pair (the other half joins it)."""
        if not closes_exactly(written):
            return set(self.ids.tolist())
        start = _decoded(written)
        found: set[int] = set()
        for text in texts:
            if text.startswith(start):
                found.update(self.closes_with.get(text[len(start):], ()))
        return found


def closes_exactly(written: bytes) -> bool:
    """Whether a string whose bytes so far are ``written`` is whole text, so that a token's bytes before its
    quote add exactly `QuoteTokens.closes_with`'s text: not inside an escape, not on half a surrogate pair."""
    start = _decoded(written)
    return start is not None and not (start and "\ud800" <= start[-1] <= "\udbff")


def quote_tokens(tokenizer) -> QuoteTokens:
    """Every non-special token of ``tokenizer`` whose bytes contain a quote, and the growth bitmasks."""
    special = tokenizer.special_ids
    pieces = [b"" if i in special else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    found = [(i, piece) for i, piece in enumerate(pieces) if b'"' in piece]
    growth = re.compile(rb"[,{\[]")
    outside = [i for i, piece in enumerate(pieces) if growth.search(piece)]
    inside = [i for i, piece in found if growth.search(piece, piece.index(b'"'))]
    item_end = re.compile(rb"[\],]")
    writing = SCALAR_BYTES | JSON_SPACE | {CLOSERS[0]}
    by_bytes: dict[bytes, list[int]] = {}
    for i, piece in enumerate(pieces):
        by_bytes.setdefault(piece, []).append(i)
    enclosing: dict[str, list[int]] = {}
    closes_with: dict[str, list[int]] = {}
    for i, piece in found:
        for text in _enclosed(piece):
            enclosing.setdefault(text, []).append(i)
        added = _closing_text(piece)
        if added is not None:
            closes_with.setdefault(added, []).append(i)
    scalars = [i for i, piece in enumerate(pieces)
               if piece and (item_end.search(piece) or set(piece) <= writing)]
    quoted_ends = [i for i, piece in found if item_end.search(piece, piece.index(b'"'))]
    return QuoteTokens(np.array([i for i, _ in found], np.int64), enclosing, closes_with,
                       _bits(outside, len(pieces)),
                       _bits(inside, len(pieces)), np.array(scalars, np.int64), np.array(quoted_ends, np.int64),
                       tokenizer.token_bytes, by_bytes)


def _closing_text(piece: bytes) -> str | None:
    """What ``piece`` adds to a JSON string (entered outside an escape) before the unescaped quote that closes
    it, decoded; None when no quote of it closes one, or what precedes that quote is not whole JSON text."""
    escape = False
    for at, b in enumerate(piece):
        if escape:
            escape = False
        elif b == BACKSLASH:
            escape = True
        elif b == QUOTE:
            return _decoded(piece[:at])
    return None


def _enclosed(piece: bytes) -> set[str]:
    """The decoded texts between any two quotes of ``piece`` (any pair: an escaped quote may lie between)."""
    at = [i for i, b in enumerate(piece) if b == QUOTE]
    texts = (_decoded(piece[a + 1:b]) for n, a in enumerate(at) for b in at[n + 1:])
    return {text for text in texts if text is not None}


def _set_bits(words: np.ndarray) -> np.ndarray:
    """The token ids whose bits are set in a mask row ([ceil(V/32)] uint32)."""
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")).astype(np.int64)


def _allowed(ids: np.ndarray, row_mask: np.ndarray) -> np.ndarray:
    """The ids whose bits are set in a mask row ([ceil(V/32)] uint32)."""
    return ids[(row_mask[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1 == 1]


def _fit(words: np.ndarray, n: int) -> np.ndarray:
    """Bitmask words cut or zero-padded to ``n`` (a tokenizer's vocabulary vs the model's padded logits)."""
    return words[:n] if len(words) >= n else np.concatenate([words, np.zeros(n - len(words), words.dtype)])


def _bits(ids: list[int], vocab_size: int) -> np.ndarray:
    words = np.zeros((vocab_size + 31) // 32, np.uint32)
    index = np.asarray(ids, np.int64)
    np.bitwise_or.at(words, index >> 5, np.uint32(1) << (index & 31).astype(np.uint32))
    return words


@lru_cache(maxsize=4096)
def _spelled(text: str) -> bytes:
    """A string's bytes between its quotes as JSON writes it plainly (escaping only what must be)."""
    return json.dumps(text, ensure_ascii=False)[1:-1].encode()


@lru_cache(maxsize=4096)
def _decoded(raw: bytes) -> str | None:
    """A JSON string's value from its bytes between the quotes, or None when they are not a whole string."""
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return None


@dataclass
class _Frame:
    """An open container: an object's keys so far (`keys`, None for an array); for an array whose items must
    be unique (`scheduler.unique_items`), the items so far and what its items can be; the schemas it is under
    when they are followed."""

    keys: set[str] | None
    items: set[Value] | None = None
    nodes: tuple = ()
    index: int = 0  # an array's items begun before the current one
    space: ItemSpace | None = None
    values: dict[str, str] | None = None  # an object's discriminating members so far (`SchemaNav.member`)
    closed: bool = False  # an object whose schema admits only declared keys (the grammar writes each once)

    def copy(self) -> _Frame:
        return _Frame(None if self.keys is None else set(self.keys),
                      None if self.items is None else set(self.items), self.nodes, self.index, self.space,
                      None if self.values is None else dict(self.values), self.closed)

    @property
    def max_length(self) -> int | None:
        """The length a unique array's string items can not grow past (None: unbounded)."""
        return self.space.max_length if self.space is not None else None

    @property
    def enum_strings(self) -> bool:
        """Some of the array's string items are an enum's values."""
        return self.space is not None and self.space.enum_strings


@dataclass
class _Lexer:
    """Where a JSON text stands, byte by byte: the open containers, whether it is inside a string and whether
    that string is a key (or an item of a unique array), the string's or number's bytes so far. `fork` is
    cheap: the forks share frames until one changes one (copy on write). With `schema` (unique arrays to
    enforce) each container is told its schemas."""

    frames: list[_Frame] = field(default_factory=list)
    owned: list[bool] = field(default_factory=list)  # frames[i] may be changed in place
    in_string: bool = False
    escape: bool = False
    is_key: bool = False
    is_item: bool = False  # the string is an item of a unique array
    is_value: bool = False  # the string is the value of a discriminating member (`SchemaNav.discriminators`)
    expect_key: bool = False
    key: bytearray = field(default_factory=bytearray)  # a key's or a unique item's bytes so far
    scalar: bytearray = field(default_factory=bytearray)  # a unique array's number or literal item so far
    last_key: str | None = None
    schema: SchemaNav | None = None
    version: int = 0  # changes whenever the used keys or items of the open containers may have changed

    def fork(self) -> _Lexer:
        return _Lexer(list(self.frames), [False] * len(self.frames), self.in_string, self.escape, self.is_key,
                      self.is_item, self.is_value, self.expect_key, bytearray(self.key), bytearray(self.scalar),
                      self.last_key, self.schema, self.version)

    def repeats_in(self, data: bytes) -> bool:
        """Advance over ``data``; True when it closed a key on one its object already had, or completed an item
        its unique array already had."""
        return any([self.step(b) for b in data])

    def step(self, b: int) -> bool:
        """Advance one byte; True when it closed a key its object already had (or a repeated unique item)."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif b == BACKSLASH:
                self.escape = True
            elif b == QUOTE:
                self.in_string = False
                if self.is_item:
                    return self._add_item(_decoded(bytes(self.key)))
                if self.is_value:
                    self._add_value()
                return self.is_key and self._add_key()
            if self.is_key or self.is_item or self.is_value:
                self.key.append(b)
            return self.is_item and (self._full_repeat() or self._dead_value())
        if self.scalar and b not in SCALAR_BYTES:
            spelled = bytes(self.scalar)
            self.scalar.clear()
            repeated = self._add_item(literal_value(spelled) or number_value(spelled))
            return self._structural(b) or repeated
        return self._structural(b)

    def _structural(self, b: int) -> bool:
        top = self.frames[-1] if self.frames else None
        if b == QUOTE:
            top_is_object = top is not None and top.keys is not None
            self.is_key = top_is_object and self.expect_key
            self.is_item = top is not None and top.items is not None
            self.is_value = (top_is_object and not self.is_key and self.schema is not None
                             and self.last_key in self.schema.discriminators)
            self.in_string, self.expect_key = True, False
            self.key.clear()
            return self.is_item and self._dead_value()
        elif b in (OPEN_OBJECT, OPEN_ARRAY):
            self._open(b)
        elif b in CLOSERS:
            if self.frames:
                self.frames.pop()
                self.owned.pop()
                self.version = next(_VERSIONS)
            self.expect_key = False
        elif b == COMMA:
            self.expect_key = top is not None and top.keys is not None
            if top is not None and top.keys is None and self.schema is not None:
                self._mine().index += 1
            # Another item of a unique array with no new value left could only repeat one.
            return top is not None and top.space is not None and top.space.exhausted(top.items)
        elif b in SCALAR_BYTES and top is not None and top.items is not None:
            self.scalar.append(b)
            # A number or literal that can only become used values (0 once 0 is used: it can not grow).
            return top.space is not None and top.space.scalar_dead(bytes(self.scalar), top.items)
        return False

    def _open(self, b: int) -> None:
        nodes: tuple = ()
        if self.schema is not None:
            parent = self.frames[-1] if self.frames else None
            if parent is None:
                nodes = self.schema.top()
            elif parent.keys is not None:
                nodes = (self.schema.member(parent.nodes, self.last_key, parent.values)
                         if self.last_key is not None else ())
            else:
                nodes = self.schema.item(parent.nodes, parent.index)
        unique = b == OPEN_ARRAY and self.schema is not None and self.schema.unique(nodes)
        space = self.schema.item_space(nodes) if unique else None
        closed = b == OPEN_OBJECT and self.schema is not None and not self.schema.keys_may_repeat(nodes)
        self.frames.append(_Frame(set() if b == OPEN_OBJECT else None, set() if unique else None, nodes,
                                  space=space, closed=closed))
        self.owned.append(True)
        self.expect_key = b == OPEN_OBJECT

    def _mine(self) -> _Frame:
        """The top frame, copied first if a fork shares it."""
        if not self.owned[-1]:
            self.frames[-1], self.owned[-1] = self.frames[-1].copy(), True
        return self.frames[-1]

    def _add_key(self) -> bool:
        if not self.frames or self.frames[-1].keys is None:
            return False
        name = _decoded(bytes(self.key))
        if name is None:
            return False
        self.last_key = name
        if self.frames[-1].closed:
            return False  # its keys are declared ones: the grammar writes each at most once
        if name in self.frames[-1].keys:
            return True
        self._mine().keys.add(name)
        self.version = next(_VERSIONS)
        return False

    def _add_value(self) -> None:
        value = _decoded(bytes(self.key))
        if value is not None and self.frames and self.last_key is not None:
            frame = self._mine()
            frame.values = {**(frame.values or {}), self.last_key: value}

    def _dead_value(self) -> bool:
        """A string item of a unique array that can no longer become a value the array lacks."""
        top = self.frames[-1]
        return top.space is not None and top.space.string_dead(b'"' + bytes(self.key), top.items)

    def _full_repeat(self) -> bool:
        """A unique array's string item at its maxLength (it can only close now) equal to one the array holds."""
        top = self.frames[-1]
        if top.max_length is None or len(self.key) < top.max_length:  # fewer bytes than characters: not yet
            return False
        text = _decoded(bytes(self.key))
        return text is not None and len(text) == top.max_length and text in top.items

    def _add_item(self, value: Value | None) -> bool:
        if value is None or not self.frames or self.frames[-1].items is None:
            return False
        if value in self.frames[-1].items:
            return True
        self._mine().items.add(value)
        self.version = next(_VERSIONS)
        return False

    def in_unique_array(self) -> bool:
        return any(frame.items is not None for frame in self.frames)


@dataclass
class KeyTracker:
    """One output's JSON lexer and its tokenizer's quote tokens. With `restart_at` (a tool-call marker) each
    occurrence starts a new document; `armed` False skips the output until the first one (free text before a
    call is not JSON)."""

    quotes: QuoteTokens
    restart_at: bytes = b""
    armed: bool = True
    schema: SchemaNav | None = None  # unique arrays to enforce (`scheduler.unique_items`)
    call_schema: SchemaNav | None = None  # those of each call after `restart_at` (a function's arguments)
    checks: bool = True  # False: nothing can repeat (closed objects only); the lexer still serves closing paths
    lexer: _Lexer = field(default_factory=_Lexer)
    _tail: bytes = b""  # the last bytes seen, to find `restart_at` across token boundaries
    _cached_version: int = -1  # `_enclosing`'s answer, for the lexer's used values of this version
    _cached: tuple[bool, np.ndarray] = (False, np.zeros(0, np.int64))

    def __post_init__(self) -> None:
        self.lexer.schema = self.schema

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
                self.lexer, self.armed = _Lexer(schema=self.call_schema), True
                data = seen[at + len(self.restart_at):]
        if self.armed:
            self.lexer.repeats_in(data)

    def drop_repeats(self, row_mask: np.ndarray) -> int:
        """Clear from ``row_mask`` ([ceil(V/32)] uint32, the grammar's) the tokens that would close a key on one
        its object already has or complete an item its unique array holds; how many were cleared. Where that
        would leave no token, a repeated key is let through (the schemas where that could matter are refused)
        but a repeated item is not: the row is left with no token, which ends the request with an error."""
        repeats = self.repeating(row_mask)
        if not repeats:
            return 0
        ids = np.asarray(repeats, np.int64)
        words = np.unique(ids >> 5)
        before = row_mask[words]  # cleared in place; put back if that left no token where a key may repeat
        np.bitwise_and.at(row_mask, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        if not row_mask.any() and not self.lexer.in_unique_array():
            row_mask[words] = before
            return 0
        return len(repeats)

    def repeating(self, row_mask: np.ndarray) -> list[int]:
        """The allowed tokens (bits of ``row_mask``, [ceil(V/32)] uint32) that would close a key on one its
        object already has, or complete an item its unique array already has."""
        lexer, quotes = self.lexer, self.quotes
        if not self.armed or not self.checks:
            return []
        any_key, enclosing = self._enclosing()
        unique = lexer.in_unique_array()
        if not any_key and not unique:
            return []  # no object has a key yet and no unique array is open: nothing can repeat
        # A token repeats a key or a string item if it closes the string being written on one, or holds one
        # between two of its quotes (it opens and closes it); a number or literal item by any byte of it.
        candidates, certain = [enclosing], set()
        if lexer.in_string:
            certain, doubtful = self._closing_current()
            candidates.append(np.fromiter(doubtful, np.int64, len(doubtful)))
        if unique:  # a token writing or ending a number or literal item (after closing this string, with a quote)
            space = lexer.frames[-1].space
            if space is not None and (space.enum_strings or space.pattern_strings):
                # Any token may commit an enum or pattern item to used values, or start one; inside an item of
                # patterns only, the tokens their masks keep need no check.
                doubtful = self._doubtful_in_patterns(row_mask)
                if doubtful is not None:
                    candidates = [doubtful, quotes.ids]
                else:
                    candidates = [_set_bits(row_mask)] if lexer.in_string else [quotes.scalar_tokens, quotes.ids]
            else:
                candidates.append(quotes.quoted_scalar_ends if lexer.in_string else quotes.scalar_tokens)
        # Only the tokens the grammar allows are checked: filtered per list first (a gather), merged after.
        allowed = {token for ids in candidates if len(ids) for token in _allowed(ids, row_mask).tolist()}
        found = _allowed(np.fromiter(certain, np.int64, len(certain)), row_mask).tolist() if certain else []
        return found + [token for token in allowed - certain if lexer.fork().repeats_in(quotes.token_bytes(token))]

    def _enclosing(self) -> tuple[bool, np.ndarray]:
        """(whether any open object has a key; the ids of the tokens holding a used key or string item between
        two of their quotes), kept until the lexer's used values change."""
        lexer = self.lexer
        if self._cached_version != lexer.version:
            keys = [key for frame in lexer.frames if frame.keys for key in frame.keys]
            items = [v for frame in lexer.frames if frame.items for v in frame.items if isinstance(v, str)]
            found = self.quotes.enclosing_any(keys + items)
            self._cached = bool(keys), np.fromiter(found, np.int64, len(found))
            self._cached_version = lexer.version
        return self._cached

    def _doubtful_in_patterns(self, row_mask: np.ndarray) -> np.ndarray | None:
        """Inside a unique array's item whose string parts are all patterns (`scheduler.pattern_items`): the
        allowed tokens that no part's mask keeps (a kept token leaves a new value reachable; the others are
        checked one by one: llguidance's mask where a grammar forces its next bytes holds only some of the
        tokens that spell them); None elsewhere."""
        lexer = self.lexer
        top = lexer.frames[-1]
        space = top.space
        if not (lexer.in_string and lexer.is_item) or space is None or space.enum_strings:
            return None
        parts = [part for part in space.strings if isinstance(part, PatternItems)]
        if len(parts) != len(space.strings):
            return None  # open strings beside them: their own checks need the forks
        written = b'"' + bytes(lexer.key)
        keep = reduce(np.bitwise_or, (_fit(part.mask(written, top.items), len(row_mask)) for part in parts))
        return _set_bits(row_mask & ~keep)

    def _closing_current(self) -> tuple[set[int], set[int]]:
        """The tokens that would end the key or unique item being written on a used one: (those that certainly
        do: closing it on one, their bytes before the quote completing it; those to check one by one: the
        closers while it ends inside an escape, and those filling a string item to its maxLength on one)."""
        lexer = self.lexer
        top = lexer.frames[-1] if lexer.frames else None
        if top is None or not (lexer.is_key or lexer.is_item):
            return set(), set()
        used = top.keys if lexer.is_key else [v for v in top.items if isinstance(v, str)]
        if not used:
            return set(), set()
        written = bytes(lexer.key)
        closers = self.quotes.closing_on(written, used)
        certain, doubtful = (closers, set()) if closes_exactly(written) else (set(), closers)
        if lexer.is_item and top.max_length is not None:
            for item in used:
                spelled = _spelled(item)
                if len(item) == top.max_length and spelled.startswith(written) and len(spelled) > len(written):
                    doubtful.update(self.quotes.by_bytes.get(spelled[len(written):], ()))
        return certain, doubtful

    def growth(self) -> np.ndarray | None:
        """Bitmask words of the tokens that would add a member or an item from where the document stands
        (`QuoteTokens.growth_*`); None where nothing is tracked."""
        if not self.armed:
            return None
        return self.quotes.growth_inside if self.lexer.in_string else self.quotes.growth_outside

    def path_lexer(self) -> _Lexer | None:
        """A fork of the lexer for a closing path to check its tokens against (None: nothing is tracked)."""
        return self.lexer.fork() if self.armed else None
