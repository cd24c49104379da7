"""Number and literal items of a unique array whose language only the grammar engine knows: numbers on a
fractional `multipleOf`, and items composed by `allOf` (docs/structured-output.md, "Unique items").

`scheduler.item_space` counts the values an item can still become from the schema, which is exact only where
llguidance writes the schema's language (its multiples of 0.25 between -3 and 1 leave out -0.5, and once an
`allOf` merges bounds, the strict narrowing's decimals and the `-0` it takes depend on the branches). Here the
look-ahead is llguidance's own byte grammar of the item: the bytes written so far are dead exactly when every
way on from them, in that grammar, spells a value the array holds. The search walks the grammar's next bytes,
only along spellings that could still be a used value (`may_spell`: every JSON spelling, exponents included);
the first byte that leaves them, or the first complete new value, proves the item alive. Each llguidance byte
mask holds only bytes with a way on, so leaving the used spellings is leaving for some new value.

The search is bounded (`MAX_STEPS` bytes tried, `MAX_SPELLING` long): past that the item is taken as dead, which
may remove a token that had a way on but never lets a repeat through.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from scheduler.pattern_items import PatternLanguage

MAX_STEPS = 512  # bytes tried per question before the item is taken as dead
MAX_SPELLING = 48  # bytes of one item followed at most (a used value spelled with trailing zeros)
_SPELLING = re.compile(rb"(-?)(0|[1-9][0-9]*)?(\.[0-9]*)?([eE][-+]?[0-9]*)?")
_LITERALS = (b"true", b"false", b"null")

UsedScalar = Decimal | bytes  # a number's value, a literal's spelling


@dataclass(frozen=True)
class GrammarScalars:
    """Number (and literal) items whose values are the grammar engine's (`schema`: the item schema as the
    grammar compiles it, JSON text)."""

    schema: str
    language: PatternLanguage = field(compare=False, repr=False)
    values = None  # not an enum

    def dead(self, written: bytes, used: Collection[Any]) -> bool | None:
        """Whether the item whose bytes so far are ``written`` can only become values in ``used``; None where
        the grammar refuses those bytes (no value of this part starts so)."""
        return self.language.scalar_dead(self.schema, used_scalars(used), written)

    def exhausted(self, used: Collection[Any]) -> bool:
        return self.dead(b"", used) is True


def used_scalars(used: Collection[Any]) -> frozenset[UsedScalar]:
    return frozenset(v for v in used if isinstance(v, Decimal | bytes))


def only_used_ahead(matcher: LLMatcher, written: bytes, used: frozenset[UsedScalar]) -> bool:
    """Whether every value the byte-level ``matcher`` (advanced over ``written``) can still complete is in
    ``used``. The matcher is walked and rolled back to where it was."""
    steps = [MAX_STEPS]
    return not _new_value_ahead(matcher, written, used, steps)


def _new_value_ahead(matcher: LLMatcher, written: bytes, used: frozenset[UsedScalar], steps: list[int]) -> bool:
    if matcher.is_accepting() and _value(written) not in used:
        return True
    if len(written) >= MAX_SPELLING:
        return False
    mask = np.frombuffer(matcher.compute_bitmask(), np.uint32)[:8]  # the 256 byte tokens (the end token after)
    for byte in np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist():
        longer = written + bytes([byte])
        if not any(may_spell(longer, value) for value in used):
            return True  # a way on exists (llguidance's mask), and no used value lies along it
        steps[0] -= 1
        if steps[0] < 0:
            return False
        matcher.consume_token(byte)
        found = _new_value_ahead(matcher, longer, used, steps)
        matcher.rollback(1)
        if found:
            return True
    return False


def _value(spelling: bytes) -> UsedScalar | None:
    if spelling in _LITERALS:
        return spelling
    try:
        return Decimal(spelling.decode("ascii")).normalize()
    except (ArithmeticError, ValueError):
        return None


def may_spell(written: bytes, value: UsedScalar) -> bool:
    """Whether some JSON spelling of ``value`` starts with ``written`` (trailing zeros, exponents and `-0`
    included)."""
    if isinstance(value, bytes):
        return value.startswith(written)
    match = _SPELLING.fullmatch(written)
    if match is None:
        return False
    minus, whole, fraction, exponent = match.groups()
    if (fraction or exponent) and not whole or exponent and fraction == b".":
        return False
    if value > 0 and minus or value < 0 and not minus and written:
        return False
    digits = (whole or b"").decode() + (fraction or b".")[1:].decode()
    significant = digits.lstrip("0")
    if exponent is None:  # more digits may follow, then an exponent that moves the point anywhere
        if value == 0:
            return not significant
        wanted = _significant(value)
        return wanted.startswith(significant) or wanted == significant.rstrip("0")
    mantissa = Decimal(digits[:len(whole)] + "." + (digits[len(whole):] or "0"))
    if mantissa == 0 or value == 0:
        return mantissa == value
    if _significant(value) != _significant(mantissa):
        return False
    return _exponent_may_be(exponent[1:], value.adjusted() - mantissa.adjusted())


def _significant(value: Decimal) -> str:
    """The digits of a non-zero number without leading or trailing zeros."""
    return "".join(map(str, value.normalize().as_tuple().digits))


def _exponent_may_be(written: bytes, shift: int) -> bool:
    """Whether an exponent whose bytes so far are ``written`` (after the `e`) may still be ``shift``."""
    sign = written[:1] if written[:1] in (b"+", b"-") else b""
    digits = written[len(sign):].decode().lstrip("0")
    if shift > 0 and sign == b"-" or shift < 0 and sign != b"-" and written:
        return False
    return (str(abs(shift)) if shift else "").startswith(digits)
