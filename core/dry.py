"""The DRY ("don't repeat yourself") repetition penalty: its parameters and the host-side bookkeeping.

DRY follows llama.cpp's sampler (`llama_sampler_dry`, parameters `dry_multiplier`, `dry_base`,
`dry_allowed_length`, `dry_penalty_last_n`, `dry_sequence_breakers`). Over the last `penalty_last_n`
tokens of prompt + output, for each earlier position j whose tokens end with the same run as the whole
sequence does (a run of n >= allowed_length tokens), the token that followed j would extend the repeat to
n + 1: its logit is lowered by multiplier * base ** (n - allowed_length). The largest n per token counts;
the exponent is capped so the power stays finite. A sequence breaker (text such as a newline or a quote)
stops a run: no run reaches back past the most recent breaker, and a token that is itself a breaker is
never penalised. The penalty is applied on device (core.sampling); this module holds what the host does:
which tokens are breakers, how far back the most recent breaker lies (a multi-token breaker needs the
token ids that follow its first one, which the host has) and the match lengths of a prompt.

Differences from llama.cpp, by intent: a penalty that would overflow float32 is clamped to the largest
finite float (llama.cpp's logit becomes -inf, which under a grammar mask could leave no token); a control
token's text counts as empty (llama.cpp renders it, e.g. "<start_of_turn>", which holds none of the default
breakers); an overlap that would split a UTF-8 character of a multi-token breaker is not listed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

DEFAULT_BASE = 1.75
DEFAULT_ALLOWED_LENGTH = 2
DEFAULT_PENALTY_LAST_N = 64  # llama.cpp's server default; -1 = the whole context, 0 = off
DEFAULT_BREAKERS = ("\n", ":", '"', "*")
MAX_BREAKERS = 16
MAX_BREAKER_CHARS = 40  # llama.cpp truncates longer ones; we refuse them
MAX_TAIL_TOKENS = 20  # a multi-token breaker's tokens after its first, as llama.cpp clamps them
FLOAT_MAX_LOG = 88.7228391  # log of the largest float32, as llama.cpp caps the exponent with it


def check_counts(allowed_length: int, penalty_last_n: int, breakers: Sequence[str]) -> tuple[str, ...]:
    """Validate DRY's integer parameters and breakers (ValueError naming the field; the multiplier and base are
    plain real ranges, checked with the other sampling knobs); returns the breakers as a tuple."""
    if not 0 <= allowed_length < 2**31:
        raise ValueError(f"dry_allowed_length must be in [0, 2**31), got {allowed_length!r}")
    if not -1 <= penalty_last_n < 2**31:
        raise ValueError(f"dry_penalty_last_n must be in [-1, 2**31) (-1: the whole context, 0: off), "
                         f"got {penalty_last_n!r}")
    if isinstance(breakers, (str, bytes)) or not all(isinstance(b, str) for b in breakers):
        raise ValueError("dry_sequence_breakers must be a list of strings")
    out = tuple(breakers)
    if not out or len(out) > MAX_BREAKERS:
        raise ValueError(f"dry_sequence_breakers must hold 1 to {MAX_BREAKERS} strings, got {len(out)}")
    for b in out:
        if not b or len(b) > MAX_BREAKER_CHARS:
            raise ValueError(f"each dry_sequence_breakers entry must be 1 to {MAX_BREAKER_CHARS} characters, "
                             f"got {b!r}")
    return out


def max_exponent(base: float) -> int:
    """The cap on n - allowed_length, computed in float32 as llama.cpp does; 0 = no cap (base ~ 1)."""
    if base <= 1.000001:
        return 0
    return int(np.float32(FLOAT_MAX_LOG) / np.log(np.float32(base)))


@dataclass(frozen=True)
class BreakerTable:
    """Sequence breakers as token ids: `single` breaks on its own (its text contains a breaker); a key of
    `tails` starts a breaker when the listed ids follow it (its text ends with the start of one)."""

    single: np.ndarray  # int32 [n] sorted ids
    tails: dict[int, tuple[tuple[int, ...], ...]]

    def heads(self) -> dict[int, tuple[tuple[int, ...], ...]]:
        """Every breaker's first token -> the tails that complete it (() for a single-token breaker)."""
        out: dict[int, tuple[tuple[int, ...], ...]] = dict(self.tails)
        for tok in self.single.tolist():
            out[tok] = ((),) + out.get(tok, ())
        return out


class BreakerTables:
    """BreakerTable per breaker list, for one vocabulary (cached: a table reads every token's text once)."""

    def __init__(self, token_bytes: Callable[[int], bytes], vocab_size: int,
                 encode: Callable[[str], list[int]]) -> None:
        self._words = [token_bytes(i) for i in range(vocab_size)]
        self._encode = encode
        self.table = lru_cache(maxsize=32)(self._build)

    def _build(self, breakers: tuple[str, ...]) -> BreakerTable:
        single: set[int] = set()
        tails: dict[int, set[tuple[int, ...]]] = {}
        for text in breakers:
            key = text.encode("utf-8")
            rests = {k: self._tail(key[k:]) for k in range(1, len(key))}
            for tok, word in enumerate(self._words):
                if not word:
                    continue
                if key in word:
                    single.add(tok)
                    continue
                for k, rest in rests.items():
                    if rest is not None and word.endswith(key[:k]):
                        tails.setdefault(tok, set()).add(rest)
        return BreakerTable(np.array(sorted(single), np.int32),
                            {tok: tuple(sorted(ts)) for tok, ts in tails.items() if tok not in single})

    def _tail(self, rest: bytes) -> tuple[int, ...] | None:
        try:
            text = rest.decode("utf-8")
        except UnicodeDecodeError:
            return None  # the overlap splits a character
        return tuple(self._encode(text)[:MAX_TAIL_TOKENS])


class RepeatLimit:
    """How many trailing tokens a repeat may span: llama.cpp's `rep_limit`, kept as tokens arrive.

    Scanning back from the end over the last `window` tokens, the first token that starts a breaker whose
    remaining tokens follow it in full (the longest such breaker) limits a repeat to the tokens after that
    breaker; with none, the limit is the window. Heads more than MAX_TAIL_TOKENS back never change their
    verdict, so the most recent of them is kept and only the last MAX_TAIL_TOKENS + 1 are rescanned.
    """

    def __init__(self, table: BreakerTable, penalty_last_n: int, tokens: Sequence[int]) -> None:
        self.table = table
        self._heads = table.heads()
        self._last_n = penalty_last_n  # -1: no bound
        self.tokens: list[int] = list(tokens)
        self._stable: tuple[int, int] | None = None  # (position, tail length) of the latest settled head
        n = len(self.tokens)
        oldest = 0 if penalty_last_n < 0 else max(0, n - penalty_last_n)
        for p in range(n - 2 - MAX_TAIL_TOKENS, oldest - 1, -1):
            found = self._match(p, n)
            if found is not None:
                self._stable = (p, found)
                break

    def push(self, token: int) -> None:
        self.tokens.append(token)
        n = len(self.tokens)
        p = n - 2 - MAX_TAIL_TOKENS  # the position whose verdict has just settled
        if p >= 0:
            found = self._match(p, n)
            if found is not None:
                self._stable = (p, found)

    def _match(self, p: int, n: int) -> int | None:
        """The longest tail of a breaker starting at p that fits before n and matches, or None."""
        best = None
        for tail in self._heads.get(self.tokens[p], ()):
            end = p + 1 + len(tail)
            if end <= n and (best is None or len(tail) > best) and tuple(self.tokens[p + 1:end]) == tail:
                best = len(tail)
        return best

    @property
    def limit(self) -> int:
        n = len(self.tokens)
        span = n if self._last_n < 0 else min(n, self._last_n)
        for i in range(min(span, MAX_TAIL_TOKENS + 1)):
            found = self._match(n - 1 - i, n)
            if found is not None:
                return i - found
        if self._stable is not None:
            i = n - 1 - self._stable[0]
            if i < span:
                return i - self._stable[1]
        return span


def prompt_matches(tokens: Sequence[int], window: int, size: int) -> np.ndarray:
    """int32 [size]: for each position j < n - 1, how many tokens ending at j equal the last ones of
    `tokens` (n of them), counting only the last `window` tokens (-1: all); 0 elsewhere.

    The Z-function of the reversed window, so linear in its length.
    """
    n = len(tokens)
    start = 0 if window < 0 else max(0, n - window)
    rev = list(reversed(tokens[start:]))
    m = len(rev)
    z = [0] * m
    lo = hi = 0  # rev[lo:hi] matches a prefix of rev
    for k in range(1, m):
        length = min(hi - k, z[k - lo]) if k < hi else 0
        while k + length < m and rev[length] == rev[k + length]:
            length += 1
        z[k] = length
        if k + length > hi:
            lo, hi = k, k + length
    out = np.zeros(size, np.int32)
    for k in range(1, m):  # reverse offset k is position n - 1 - k
        out[n - 1 - k] = z[k]
    return out
