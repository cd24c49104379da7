"""What an item of a unique array can still become: the look-ahead `scheduler.unique_items` needs to mask a
repeat without leaving the grammar a dead end.

An item space is built from an item schema of scalars (strings, numbers, booleans, null, or an enum / const of
them). For the bytes of an item written so far it answers whether every value the item could still become is
one the array already holds (`dead`: the token that wrote them is removed), and whether no new item at all is
left (`exhausted`: the comma of another item is removed). Values are compared as JSON Schema compares them: a
string's decoded text, a number's value (1 and 1.0 are one number), a literal's spelling (`true` is not 1).

Numbers are followed as the grammar writes them (`strict_schema`): no exponent once a number is bounded, a
multiple of ``multipleOf`` in its one spelling, at most 9 decimals in strict mode. The values a prefix reaches
are the magnitudes that start with its digits (``12`` reaches 12, 12.x and 120-129...), clipped to the bounds,
counted on the number's grid (integers, multiples, or 10^-9 steps); an unbounded side reaches infinitely many.
After a bare minus sign 0 is not counted (so `-` is removed once only 0 is left, which is still written `0`):
llguidance takes `-0` for some number schemas and not for others. Strict mode's 17-significant-digit cap is
not followed: a repeat only that cap forces (two equal 17-digit numbers) ends the request with an error, never
with a repeated item.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation, localcontext
from fractions import Fraction
from functools import reduce
from typing import Any, Protocol

from scheduler.grammar_scalars import GrammarScalars
from scheduler.pattern_items import PatternItems
from scheduler.strict_schema import FRACTION_DIGITS, MAX_INTEGER


class ItemOracle(Protocol):
    """Parts of item spaces asked of the grammar engine (`scheduler.pattern_items.PatternLanguage`); each
    raises ValueError where the engine refuses the item schema."""

    def strings(self, node: dict[str, Any], strict: bool) -> Any:
        """A pattern's or format's strings (None: plain strings after all, such as an unasserted format)."""

    def composed_strings(self, node: dict[str, Any], strict: bool) -> Any:
        """The strings of a composed schema."""

    def scalars(self, node: dict[str, Any], strict: bool) -> Any:
        """Numbers (and literals) whose language the counts here do not follow."""

_PATTERNED = ("pattern", "format")
Value = str | Decimal | bytes  # a string's text, a number's value, a literal's spelling (b"true", b"null")
LITERALS = {"boolean": (b"true", b"false"), "null": (b"null",)}
SCALAR_KINDS = frozenset({"string", "number", "integer", "boolean", "null"})
_NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?(?:e[-+]?[0-9]*)?)?")
_PRECISION = 80  # decimal digits for the bound arithmetic: 17-digit bounds times 10^9 grids fit exactly


def literal_value(spelling: bytes) -> bytes | None:
    return spelling if spelling in (b"true", b"false", b"null") else None


def number_value(spelling: bytes) -> Decimal | None:
    try:
        return Decimal(spelling.decode("ascii")).normalize()
    except (InvalidOperation, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class StringItems:
    """String items: open (with a longest length) or an enum (spelling with its quotes -> value)."""

    max_length: int | None = None
    values: Mapping[bytes, str] | None = None

    def dead(self, written: bytes, used: Collection[Value]) -> bool:
        """An enum item whose bytes so far (its opening quote included) can only become used values. An open
        string can always grow (its maxLength is checked where it must close)."""
        if self.values is None:
            return False
        return not any(spelled.startswith(written) and value not in used for spelled, value in self.values.items())

    def exhausted(self, used: Collection[Value]) -> bool:
        return self.values is not None and all(value in used for value in self.values.values())


@dataclass(frozen=True)
class _Interval:
    """Part of the number line; a None end is unbounded."""

    low: Decimal | None
    high: Decimal | None
    low_open: bool = False
    high_open: bool = False

    def clip(self, other: _Interval) -> _Interval:
        low, low_open = _tighter(self.low, self.low_open, other.low, other.low_open, max)
        high, high_open = _tighter(self.high, self.high_open, other.high, other.high_open, min)
        return _Interval(low, high, low_open, high_open)

    def holds(self, x: Decimal) -> bool:
        above = self.low is None or x > self.low or (x == self.low and not self.low_open)
        below = self.high is None or x < self.high or (x == self.high and not self.high_open)
        return above and below


def _tighter(a: Decimal | None, a_open: bool, b: Decimal | None, b_open: bool, pick) -> tuple[Decimal | None, bool]:
    if a is None:
        return b, b_open
    if b is None or a != b:
        chosen = a if b is None or pick(a, b) == a else b
        return chosen, (a_open if chosen is a else b_open)
    return a, a_open or b_open


@dataclass(frozen=True)
class NumberItems:
    """Number items: an interval on a grid (``step``; None: the continuum of an unbounded-precision number),
    or an enum (spelling -> value)."""

    bounds: _Interval = field(default_factory=lambda: _Interval(None, None))
    step: Decimal | None = None
    values: Mapping[bytes, Decimal] | None = None

    def reach(self, prefix: bytes, used: Collection[Value]) -> tuple[float, int]:
        """(how many values the item whose bytes so far are ``prefix`` can still become, math.inf when
        unbounded; how many of them ``used`` holds)."""
        if self.values is not None:
            reached = {v for spelled, v in self.values.items() if spelled.startswith(prefix)}
            return len(reached), len(reached & set(used))
        text = prefix.decode("latin-1").lower()
        if not _NUMBER_PREFIX.fullmatch(text):
            return math.inf, 0  # not a number's start: the grammar's to refuse
        with localcontext() as ctx:
            ctx.prec = _PRECISION
            return self._reach(text, used)

    def _reach(self, text: str, used: Collection[Value]) -> tuple[float, int]:
        if "e" in text:  # an exponent (unbounded numbers only): every value if the mantissa is not zero
            zero = set(text.split("e")[0].lstrip("-").replace(".", "")) <= {"0"}
            return (1, int(Decimal(0) in used)) if zero else (math.inf, 0)
        total, held = 0, 0
        edge = self.bounds.low if text.startswith("-") else self.bounds.high  # the bound on the prefix's side
        for part in _magnitudes(text, None if edge is None else abs(edge)):
            count, in_part = self._count(part.clip(self.bounds), used)
            total, held = total + count, held + in_part
        return total, held

    def dead(self, prefix: bytes, used: Collection[Value]) -> bool | None:
        """Whether every value ``prefix`` reaches is used; None where it reaches none (but for a bare `-`: 0 is
        still written `0`, so no negative value left is dead)."""
        if not _NUMBER_PREFIX.fullmatch(prefix.decode("latin-1").lower()):
            return None
        count, held = self.reach(prefix, used)
        if count == 0:
            return True if prefix == b"-" else None
        return count <= held

    def exhausted(self, used: Collection[Value]) -> bool:
        if self.values is not None:
            count, held = self.reach(b"", used)
        else:
            with localcontext() as ctx:
                ctx.prec = _PRECISION
                count, held = self._count(self.bounds, used)
        return held >= count

    def _count(self, part: _Interval, used: Collection[Value]) -> tuple[float, int]:
        held = sum(1 for u in used if isinstance(u, Decimal) and part.holds(u))
        if part.low is not None and part.high is not None and part.low >= part.high:
            point = part.low == part.high and not (part.low_open or part.high_open)
            return (1, held) if point else (0, 0)
        if self.step is None:  # the continuum: infinitely many
            return math.inf, held
        if part.low is None or part.high is None:
            return math.inf, held
        first = math.ceil(part.low / self.step)
        if part.low_open and first * self.step == part.low:
            first += 1
        last = math.floor(part.high / self.step)
        if part.high_open and last * self.step == part.high:
            last -= 1
        return max(0, last - first + 1), held


def _magnitudes(text: str, limit: Decimal | None) -> list[_Interval]:
    """The signed intervals holding every number whose spelling starts with ``text`` (without an exponent):
    exactly those up to the magnitude ``limit`` (the bound on the prefix's side; None: unbounded), then one
    unbounded interval that the bound clips away."""
    negative = text.startswith("-")
    body = text[1:] if negative else text
    spans: list[tuple[Decimal, Decimal | None]]
    if not body:
        spans = [(Decimal(0), None)]
    else:
        whole, dot, fraction = body.partition(".")
        start = Decimal(body.rstrip("."))
        if dot or whole == "0":  # only decimals may follow
            spans = [(start, start + Decimal(10) ** -len(fraction))]
        else:  # the number itself (and its decimals), then with one more digit, two more...
            spans, scale = [(start, start + 1)], 10
            while limit is not None and start * scale <= limit:
                spans.append((start * scale, (start + 1) * scale))
                scale *= 10
            spans.append((start * scale, None))
    if negative:  # after a bare "-", 0 is left out: it is still written "0" (and llguidance takes "-0" only for some)
        return [_Interval(None if b is None else -b, -a, low_open=True, high_open=not body) for a, b in spans]
    return [_Interval(a, b, high_open=True) for a, b in spans]


@dataclass(frozen=True)
class ItemSpace:
    """The items of one unique array, by kind, each kind a union of parts (the branches of an `anyOf` item
    schema, or of several unique schemas at one position); a kind with no part is one the items can not be."""

    strings: tuple[StringItems | PatternItems, ...] = ()
    numbers: tuple[NumberItems | GrammarScalars, ...] = ()  # the latter may hold literals too
    literals: frozenset[bytes] = frozenset()

    @property
    def max_length(self) -> int | None:
        """The length no open string item can grow past (None: some can grow without end)."""
        bounds = [part.max_length for part in self.strings if part.values is None]
        return max(bounds) if bounds and None not in bounds else None  # type: ignore[type-var]

    @property
    def enum_strings(self) -> bool:
        return any(part.values is not None for part in self.strings)

    @property
    def pattern_strings(self) -> bool:
        """Some string items are a pattern's or a format's (`scheduler.pattern_items`)."""
        return any(isinstance(part, PatternItems) for part in self.strings)

    def string_dead(self, written: bytes, used: Collection[Value]) -> bool:
        return bool(self.strings) and all(part.dead(written, used) for part in self.strings)

    def scalar_dead(self, prefix: bytes, used: Collection[Value]) -> bool:
        """A number or literal item whose bytes so far can only become used values: every part that reaches
        some value from them reaches only used ones. Bytes that reach none are the grammar's to refuse (False),
        but for a bare `-` with no negative value left: 0 is still written `0`."""
        reached = [lit for lit in self.literals if lit.startswith(prefix)]
        answers = [all(lit in used for lit in reached) if reached else None]
        answers += [part.dead(prefix, used) for part in self.numbers]
        known = [answer for answer in answers if answer is not None]
        return bool(known) and all(known)

    def exhausted(self, used: Collection[Value]) -> bool:
        parts = (*self.strings, *self.numbers)
        return all(part.exhausted(used) for part in parts) and all(lit in used for lit in self.literals)

    def union(self, other: ItemSpace) -> ItemSpace:
        """Items that may be of either space."""
        return ItemSpace(self.strings + other.strings, self.numbers + other.numbers, self.literals | other.literals)


def item_space(items: Any, strict: bool = True, resolve: Callable[[Any], Any] = lambda node: node,
               depth: int = 0, oracle: ItemOracle | None = None) -> ItemSpace | None:
    """The item space of a unique array's item schema (``resolve`` follows a `$ref`), or None when it is not one
    this module can follow exactly: objects or arrays, or a composition (other than an `anyOf` / `oneOf` alone,
    whose items are any branch's: the union) whose values are not all of one kind (strings, or numbers and
    literals). Strings under a `pattern` or `format`, numbers on a fractional `multipleOf` and composed items
    are followed only where ``oracle`` asks the grammar engine."""
    items = resolve(items)
    if depth > MAX_BRANCH_DEPTH or not isinstance(items, dict) or "$ref" in items:
        return None
    if any(k in items for k in ("allOf", "not", "if")) or _constrained_union(items):
        return _composed(items, strict, resolve, oracle)
    for key in ("anyOf", "oneOf"):
        if key in items:
            branches = items[key]
            if not isinstance(branches, list) or not branches:
                return None
            spaces = [item_space(branch, strict, resolve, depth + 1, oracle) for branch in branches]
            return None if None in spaces else reduce(ItemSpace.union, spaces)  # type: ignore[arg-type]
    kinds = items.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else None
    if "const" in items or "enum" in items:
        values = [items["const"]] if "const" in items else items["enum"]
        if not isinstance(values, list) or not values or set(items) - _ENUM_FILTERS:
            return None
        return _enum_space([v for v in values if _admits(items, v)], kinds)
    if not kinds or not kinds <= SCALAR_KINDS:
        return None
    strings: tuple[StringItems | PatternItems, ...] = ()
    if "string" in kinds:
        part = _string_part(items, strict, oracle)
        if part is None:
            return None
        strings = (part,)
    elif any(k in items for k in _PATTERNED):
        return None
    numbers: tuple[NumberItems | GrammarScalars, ...] = ()
    if kinds & {"number", "integer"}:
        number = _number_part(items, kinds, strict, oracle)
        if number is None:
            return None
        numbers = (number,)
    literals = frozenset(lit for kind in kinds for lit in LITERALS.get(kind, ()))
    return ItemSpace(strings, numbers, literals)


def _string_part(items: dict[str, Any], strict: bool,
                 oracle: ItemOracle | None) -> StringItems | PatternItems | None:
    """Open strings (with their longest length), or what ``oracle`` makes of a pattern or format (None: not
    followed)."""
    longest = items.get("maxLength")
    plain = StringItems(int(longest) if isinstance(longest, int | float) else None)
    if not any(k in items for k in _PATTERNED):
        return plain
    part = _asked(oracle, "strings", items, strict)
    if part is _REFUSED or part is _NOT_ASKED:
        return None
    return plain if part is None else part


def _number_part(items: dict[str, Any], kinds: set[str], strict: bool,
                 oracle: ItemOracle | None) -> NumberItems | GrammarScalars | None:
    """The numbers counted on their grid, or (a fractional `multipleOf` on a number) asked of ``oracle``."""
    number = _number_items(items, integer="number" not in kinds, strict=strict)
    if number is not None:
        return number
    schema = {"type": sorted(kinds & {"number", "integer"}), **{k: items[k] for k in _NUMBER_KEYWORDS if k in items}}
    part = _asked(oracle, "scalars", schema, strict)
    return None if part is _REFUSED or part is _NOT_ASKED else part


def _constrained_union(items: dict[str, Any]) -> bool:
    """An `anyOf` / `oneOf` beside other keywords (an exact rewrite of a `not` leaves `type` beside one): the
    branches are intersected with them."""
    return any(key in items and set(items) - {key} - _ANNOTATIONS for key in ("anyOf", "oneOf"))


def _composed(items: dict[str, Any], strict: bool, resolve: Callable[[Any], Any],
              oracle: ItemOracle | None) -> ItemSpace | None:
    """An item schema composed by `allOf`, `not`, `if` or a union beside other keywords, whose values are of one
    kind: strings, or numbers and literals (its `$ref`s inlined for the engine); its language is the engine's."""
    kinds = _declared_kinds(items, resolve)
    standalone = _inlined(items, resolve)
    if kinds is None or standalone is None or not kinds <= SCALAR_KINDS or "string" in kinds and len(kinds) > 1:
        return None
    if kinds == {"string"}:
        part = _asked(oracle, "composed_strings", standalone, strict)
        return None if part is _REFUSED or part is _NOT_ASKED else ItemSpace(strings=(part,))
    part = _asked(oracle, "scalars", standalone, strict)
    return None if part is _REFUSED or part is _NOT_ASKED else ItemSpace(numbers=(part,))


_REFUSED, _NOT_ASKED = object(), object()


def _asked(oracle: ItemOracle | None, what: str, node: dict[str, Any], strict: bool) -> Any:
    """``oracle``'s part for ``node`` (`_REFUSED` where the engine refuses it, `_NOT_ASKED` without one)."""
    if oracle is None:
        return _NOT_ASKED
    try:
        return getattr(oracle, what)(node, strict)
    except ValueError:  # the grammar engine refuses the item: its error names the keyword
        return _REFUSED


def _declared_kinds(items: dict[str, Any], resolve: Callable[[Any], Any], depth: int = 0) -> set[str] | None:
    """The JSON types an `allOf` item may be: those every member that declares a `type` admits (None: none
    declares one, or a member is not followed)."""
    declared: set[str] | None = None
    for node in [items, *items.get("allOf", [])] if depth <= MAX_BRANCH_DEPTH else []:
        node = resolve(node) if node is not items else node
        if not isinstance(node, dict):
            return None
        own = node.get("type")
        kinds = {own} if isinstance(own, str) else set(own) if isinstance(own, list) else None
        if kinds is not None and "number" in kinds:
            kinds.add("integer")
        if node is not items and "allOf" in node:
            inner = _declared_kinds(node, resolve, depth + 1)
            kinds = inner if kinds is None else kinds & inner if inner is not None else kinds
        if kinds is not None:
            declared = kinds if declared is None else declared & kinds
    if declared is not None and "integer" in declared and "number" in declared:
        return declared - {"integer"}  # integers are numbers
    return declared


def _inlined(node: Any, resolve: Callable[[Any], Any], depth: int = 0) -> Any:
    """A copy of ``node`` with every `$ref` replaced by what it points to (None: a cycle or a ref that does not
    resolve)."""
    if depth > MAX_BRANCH_DEPTH:
        return None
    if isinstance(node, list):
        out = [_inlined(sub, resolve, depth) for sub in node]
        return None if any(sub is None for sub in out) else out
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = resolve(node)
        return None if target is None or "$ref" in target else _inlined(target, resolve, depth + 1)
    out = {}
    for key, value in node.items():
        if key in ("$defs", "definitions"):
            continue
        inner = _inlined(value, resolve, depth + 1) if isinstance(value, dict | list) else value
        if inner is None:
            return None
        out[key] = inner
    return out


MAX_BRANCH_DEPTH = 8  # nested anyOf / oneOf levels followed (a $ref cycle through them is not)
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated"})
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# Keywords beside an enum whose effect on its values is followed here (any other: not lifted).
_ENUM_FILTERS = frozenset({"enum", "const", "type", "pattern", "minLength", "maxLength", "minimum", "maximum",
                           "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}) | _ANNOTATIONS


def _admits(items: dict[str, Any], value: Any) -> bool:
    """Whether an enum's ``value`` also meets the item schema's other keywords (the grammar admits only those)."""
    if isinstance(value, str):
        pattern = items.get("pattern")
        try:
            matches = not isinstance(pattern, str) or re.search(pattern, value) is not None
        except re.error:
            matches = True  # a pattern Python can not read: kept, the grammar decides
        return matches and items.get("minLength", 0) <= len(value) <= items.get("maxLength", math.inf)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    number = _number_items(items, integer=False, strict=False)
    step = items.get("multipleOf")
    gridded = isinstance(step, int | float) and step > 0
    on_grid = not gridded or (Fraction(str(value)) / Fraction(str(step))).denominator == 1
    return number is not None and number.bounds.holds(Decimal(str(value))) and on_grid


def _enum_space(values: list[Any], kinds: set[str] | None) -> ItemSpace | None:
    strings: dict[bytes, str] = {}
    numbers: dict[bytes, Decimal] = {}
    literals: set[bytes] = set()
    for value in values:
        kind = _kind(value)
        if kind is None:
            return None  # an object or array value
        if kinds is not None and kind not in kinds and not (kind == "integer" and "number" in kinds):
            continue  # the grammar admits only the values of the declared types
        spelled = json.dumps(value, ensure_ascii=False).encode()
        if kind == "string":
            strings[spelled] = value
        elif kind in ("number", "integer"):
            numbers[spelled] = Decimal(str(value)).normalize()
        else:
            literals.add(spelled)
    return ItemSpace((StringItems(values=strings),) if strings else (),
                     (NumberItems(values=numbers),) if numbers else (), frozenset(literals))


def _kind(value: Any) -> str | None:
    if value is None or isinstance(value, bool):
        return "null" if value is None else "boolean"
    if isinstance(value, int):
        return "integer"
    return "number" if isinstance(value, float) else "string" if isinstance(value, str) else None


def _number_items(items: dict[str, Any], integer: bool, strict: bool) -> NumberItems | None:
    def bound(key: str) -> Decimal | None:
        value = items.get(key)
        return Decimal(str(value)) if isinstance(value, int | float) and not isinstance(value, bool) else None

    low, high = bound("minimum"), bound("maximum")
    low_open = high_open = False
    for key, is_low in (("exclusiveMinimum", True), ("exclusiveMaximum", False)):
        value = items.get(key)
        if value is True:  # draft 4: the plain bound is exclusive
            low_open, high_open = (True, high_open) if is_low else (low_open, True)
        elif bound(key) is not None:
            edge = bound(key)
            if is_low and (low is None or edge >= low):
                low, low_open = edge, True
            elif not is_low and (high is None or edge <= high):
                high, high_open = edge, True
    if integer and strict:
        low = max(low, Decimal(-MAX_INTEGER)) if low is not None else Decimal(-MAX_INTEGER)
        high = min(high, Decimal(MAX_INTEGER)) if high is not None else Decimal(MAX_INTEGER)
    step = _step(items.get("multipleOf"), integer, strict)
    if step is False:
        return None
    return NumberItems(_Interval(low, high, low_open, high_open), step)


def _step(multiple: Any, integer: bool, strict: bool) -> Decimal | None | bool:
    """The grid the grammar writes numbers on; False when it is not followed: ``multiple`` not a positive number,
    or a fraction on a number (llguidance's multiples of 0.25 between -0.5 and 1 leave out -0.5, so its
    language is not the schema's and a look-ahead from the schema could lead it to a dead end)."""
    if multiple is None:
        return Decimal(1) if integer else (Decimal(10) ** -max(FRACTION_DIGITS) if strict else None)
    if isinstance(multiple, bool) or not isinstance(multiple, int | float) or multiple <= 0:
        return False
    ratio = Fraction(str(multiple))
    if integer:
        return Decimal(ratio.numerator)  # the integers that are multiples of p/q: multiples of p
    return Decimal(ratio.numerator) if ratio.denominator == 1 else False
