"""What a unique array's item can still become (`scheduler.item_space`), checked against the grammar itself:
the item language is read off llguidance (every spelling it accepts, found by walking its prefixes), and for
every prefix and many sets of used values, `dead` and `exhausted` must say exactly what that language says."""

from __future__ import annotations

import json
import random
from decimal import Decimal

import pytest

from scheduler.grammar import ConstraintSpec, UnsupportedConstraintError
from scheduler.item_space import item_space, literal_value, number_value

ALPHABET = "-.0123456789truefalsn"  # what numbers and literals are spelled with
LONGEST = 8  # no item of these schemas is longer

ITEM_SCHEMAS = [
    {"type": "integer", "minimum": -3, "maximum": 12},
    {"type": "integer", "exclusiveMinimum": -2, "exclusiveMaximum": 9},
    {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 20},
    {"type": "integer", "maximum": 5, "minimum": -12},
    {"type": "number", "minimum": -4, "maximum": 15, "multipleOf": 2},
    {"type": "number", "exclusiveMinimum": -3, "maximum": 4, "multipleOf": 1},
    {"type": ["integer", "boolean", "null"], "minimum": 0, "maximum": 3},
    {"enum": [1, 2.5, 10, -1, True, None]},
    {"enum": [3, 4, 5, 13, 20], "maximum": 13},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "integer", "minimum": 3, "maximum": 12}]},
    {"anyOf": [{"type": "integer", "minimum": -5, "maximum": -1}, {"type": "null"}, {"enum": [7, 70]}]},
]


def language(compiler, tokenizer, items: dict, defs: dict | None = None) -> dict[str, object]:
    """Every item spelling the grammar of an array of ``items`` accepts -> its value for uniqueness."""
    compiled = compiler.compile(ConstraintSpec.json_schema({"type": "array", "items": items, "$defs": defs or {}}))

    def takes(text: str) -> bool:
        return compiler.matcher(compiled).consume_tokens(tokenizer.encode(text))

    found, stack = {}, [""]
    while stack:
        prefix = stack.pop()
        if prefix and takes(f"[{prefix}]"):
            found[prefix] = literal_value(prefix.encode()) or number_value(prefix.encode())
        stack.extend(prefix + c for c in ALPHABET if len(prefix) < LONGEST and takes(f"[{prefix}{c}"))
    return found


@pytest.mark.parametrize("items", ITEM_SCHEMAS, ids=[json.dumps(s) for s in ITEM_SCHEMAS])
def test_dead_and_exhausted_agree_with_the_grammars_own_item_language(compiler, tokenizer, items):
    spellings = language(compiler, tokenizer, items)
    values = set(spellings.values())
    assert len(values) >= 4, spellings  # the schema admits several items (within LONGEST characters)
    # After a bare "-", 0 does not count: it is still written "0" (llguidance takes "-0" for some schemas).
    assert_agrees(item_space(items), spellings, sets=30, zero_after_minus=False)


def assert_agrees(space, spellings: dict[str, object], sets: int, zero_after_minus: bool) -> None:
    """`exhausted` and `scalar_dead` say exactly what the item language (``spellings``) says, for every prefix
    of every spelling, with no value used, all used and ``sets`` random subsets used."""
    assert space is not None
    values = set(spellings.values())
    prefixes = {text[:n] for text in spellings for n in range(1, len(text) + 1)}
    rng = random.Random(sets)
    used_sets = [set(), set(values)] + [set(rng.sample(sorted(values, key=repr), rng.randrange(len(values))))
                                        for _ in range(sets)]
    for used in used_sets:
        assert space.exhausted(used) == (values <= used), used
        for prefix in prefixes:
            reached = {v for text, v in spellings.items()
                       if text.startswith(prefix) and (zero_after_minus or prefix != "-" or v != 0)}
            assert space.scalar_dead(prefix.encode(), used) == (reached <= used), (prefix, used)
    assert not space.scalar_dead(b"x", set())  # bytes no item starts with: the grammar's to refuse


def test_unbounded_numbers_reach_without_end_except_where_they_can_not_grow():
    integers, numbers = item_space({"type": "integer"}), item_space({"type": "number"})
    used = {Decimal(0), Decimal(7)}
    assert integers.scalar_dead(b"0", used) and integers.scalar_dead(b"-0", used)  # 0 can not grow
    assert not integers.scalar_dead(b"7", used)  # 70, 71...
    assert not numbers.scalar_dead(b"0", used)  # 0.5
    free = item_space({"type": "number"}, strict=False)  # exponents allowed: 0e5 is still 0
    assert free.scalar_dead(b"0e", used) and not free.scalar_dead(b"7e", used)
    strict = item_space({"type": "number", "minimum": 0})  # at most 9 decimals
    assert strict.scalar_dead(b"0.123456789", {Decimal("0.123456789")})
    assert not strict.scalar_dead(b"0.12345678", {Decimal("0.123456789")})


@pytest.mark.parametrize("items", [{"type": "string", "pattern": "^[ab]$"}, {"type": "string", "format": "date"},
                                   {"type": "object"}, {"anyOf": [{"type": "integer"}, {"type": "object"}]},
                                   {"anyOf": [{"type": "integer"}], "minimum": 3}, {"allOf": [{"type": "integer"}]},
                                   {"enum": [[1], [2]]}, {"type": "integer", "multipleOf": -1},
                                   {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 1},
                                   {"enum": ["a", "b"], "format": "email"}])
def test_item_spaces_not_followed_exactly_are_none(items):
    """Without the grammar engine to ask (no oracle), these are not followed."""
    assert item_space(items) is None


@pytest.mark.parametrize("items", [{"allOf": [{"type": ["string", "integer"]}, {"minimum": 1}]},  # mixed kinds
                                   {"allOf": [{"minimum": 1}]},  # no member declares a type
                                   {"allOf": [{"type": "object"}]}, {"not": {"type": "string"}},
                                   {"allOf": [{"$ref": "#/$defs/loop"}, {"type": "integer"}]}])
def test_composed_items_not_followed_stay_refused(compiler, items):
    """An `allOf` is followed where its values are of one kind the engine can be asked about: strings, or numbers
    and literals; a `$ref` cycle is never inlined."""
    schema = {"type": "array", "items": items, "uniqueItems": True,
              "$defs": {"loop": {"allOf": [{"$ref": "#/$defs/loop"}]}}}
    with pytest.raises(UnsupportedConstraintError):
        compiler.compile(ConstraintSpec.json_schema(schema))


# Items whose language is the grammar engine's own (`scheduler.grammar_scalars`): llguidance is asked.
ASKED_ITEMS = [
    {"type": "number", "multipleOf": 0.25, "minimum": -2, "maximum": 2},
    {"type": "number", "multipleOf": 0.5, "exclusiveMinimum": -1, "maximum": 3},
    {"type": "number", "multipleOf": 0.1, "minimum": 0, "maximum": 0.6},
    {"allOf": [{"type": "integer"}, {"minimum": -3, "maximum": 9}]},
    {"allOf": [{"type": "integer", "minimum": -3}, {"maximum": 5}, {"not": {"const": 0}}]},
    {"allOf": [{"type": "number", "minimum": 0}, {"maximum": 1}, {"multipleOf": 0.25}]},
    {"allOf": [{"type": ["boolean", "null", "integer"]}, {"minimum": 0, "maximum": 2}]},
    {"allOf": [{"$ref": "#/$defs/small"}, {"minimum": 1}]},
    {"type": "integer", "minimum": 0, "maximum": 9, "anyOf": [{"maximum": 2}, {"minimum": 7}]},
]


@pytest.mark.parametrize("items", ASKED_ITEMS, ids=[json.dumps(s) for s in ASKED_ITEMS])
def test_items_asked_of_the_grammar_are_dead_exactly_where_its_language_says(compiler, tokenizer, items):
    """Numbers on a fractional grid and `allOf` items: the same agreement with the grammar's item language as
    the counted items above, for every prefix of every spelling (a bare `-` included: the engine's answer is its
    own, `-0` where it takes it) and many used sets."""
    defs = {"small": {"type": "integer", "maximum": 6}}
    spellings = language(compiler, tokenizer, items, defs)
    values = set(spellings.values())
    assert len(values) >= 4, spellings
    schema = {"type": "array", "items": items, "uniqueItems": True, "$defs": defs}
    nav = compiler.compile(ConstraintSpec.json_schema(schema)).nav
    assert_agrees(nav.item_space(nav.top()), spellings, sets=20, zero_after_minus=True)


@pytest.mark.parametrize(("written", "value", "expected"), [
    (b"", "5", True), (b"-", "5", False), (b"-", "0", True), (b"-0", "0", True), (b"0.0", "0", True),
    (b"1", "10", True), (b"10", "1", True), (b"1.0", "1", True), (b"1.01", "1", False), (b"12", "1.2", True),
    (b"2", "1", False), (b"0.5", "0.5", True), (b"0.50", "0.5", True), (b"0.05", "0.5", True),
    (b"1e", "100", True), (b"1e2", "100", True), (b"1e3", "100", False), (b"1e-", "100", False),
    (b"1e+02", "100", True), (b"10e1", "100", True), (b"1e-1", "0.1", True), (b"1e1", "0.1", False),
    (b"0e5", "0", True), (b"0e5", "1", False), (b"01", "1", False), (b"1.e", "1", False), (b"t", "1", False),
])
def test_may_spell_knows_every_json_spelling_of_a_number(written, value, expected):
    from scheduler.grammar_scalars import may_spell

    assert may_spell(written, Decimal(value)) is expected


def test_may_spell_is_never_too_short_against_every_short_spelling():
    """Brute force: every JSON number spelled in up to 5 characters; for each of its prefixes, `may_spell` must
    say yes to its value (an over-approximation is allowed, a miss is not)."""
    import itertools

    from scheduler.grammar_scalars import may_spell

    for length in range(1, 6):
        for chars in itertools.product("-0159.e", repeat=length):
            text = "".join(chars)
            try:
                json.loads(text)
                value = Decimal(text).normalize()
            except (ValueError, ArithmeticError):
                continue
            for n in range(len(text) + 1):
                assert may_spell(text[:n].encode(), value), (text, n)


def test_a_union_of_item_schemas_follows_every_branch():
    """`oneOf` [a non-empty string, null]: a string item never runs out and null is one value; a `$ref` cycle
    through branches is not followed."""
    space = item_space({"oneOf": [{"type": "string", "minLength": 1, "maxLength": 3}, {"type": "null"}]})
    assert space is not None and space.max_length == 3
    assert space.scalar_dead(b"n", {b"null"}) and not space.scalar_dead(b"n", {"x"})
    assert not space.string_dead(b'"ab', {"ab"}) and not space.exhausted({"ab", b"null"})
    defs = {"loop": {"anyOf": [{"$ref": "#/loop"}, {"type": "null"}]}}
    assert item_space({"$ref": "#/loop"}, resolve=lambda n: defs["loop"] if n == {"$ref": "#/loop"} else n) is None


# Item schemas whose values are a pattern's or a format's, each with the characters its values are spelled with.
PATTERN_ITEMS = [
    ({"type": "string", "pattern": "^(x|xy|xyz|z)$"}, "xyz"),
    ({"type": "string", "pattern": "^[ab]{1,2}$"}, "ab"),
    ({"type": "string", "pattern": "^a[bc]*$", "maxLength": 3}, "abc"),
    ({"type": "string", "pattern": "b"}, "ab"),  # unanchored: any string holding a "b"
    ({"type": "string", "format": "date", "pattern": "^2021-02-2"}, "0123456789-"),
    ({"type": "string", "format": "ipv4", "pattern": "^10\\.0\\.0\\.25"}, "0123456789."),
]


def string_language(compiler, tokenizer, items: dict, alphabet: str, longest: int) -> set[str]:
    """Every string item the grammar of an array of ``items`` accepts, up to ``longest`` characters."""
    compiled = compiler.compile(ConstraintSpec.json_schema({"type": "array", "items": items}))

    def takes(text: str) -> bool:
        return compiler.matcher(compiled).consume_tokens(tokenizer.encode(text))

    found, stack = set(), [""]
    while stack:
        prefix = stack.pop()
        if takes(f'["{prefix}"]'):
            found.add(prefix)
        stack.extend(prefix + c for c in alphabet if len(prefix) < longest and takes(f'["{prefix}{c}'))
    return found


@pytest.mark.parametrize(("items", "alphabet"), PATTERN_ITEMS, ids=[json.dumps(s) for s, _ in PATTERN_ITEMS])
def test_pattern_items_are_dead_exactly_where_the_grammars_own_language_says(compiler, tokenizer, items, alphabet):
    """Pattern and format items (`scheduler.pattern_items`, asked of llguidance itself): for every prefix of every
    value (within the length walked) and many sets of used values, `dead` says exactly whether every value the
    prefix reaches is used, `exhausted` whether every value is, and the mask over the model's tokens keeps a
    one-character token only where the prefix it makes is not dead (it may leave out more: llguidance's mask
    where the grammar forces its next bytes)."""
    longest = 12 if "format" in items else 4
    values = string_language(compiler, tokenizer, items, alphabet, longest)
    assert 3 <= len(values) <= 40, values
    schema = {"type": "array", "items": items, "uniqueItems": True}
    nav = compiler.compile(ConstraintSpec.json_schema(schema)).nav
    space = nav.item_space(nav.top())
    [part] = space.strings
    bounded = "pattern" in items and items["pattern"] != "b"  # "b" reaches past what is walked
    prefixes = sorted({v[:n] for v in values for n in range(len(v) + 1)})
    rng = random.Random(1)
    used_sets = [set(), set(values)] + [set(rng.sample(sorted(values), rng.randrange(len(values))))
                                        for _ in range(12)]
    singles = {c: tokenizer.encode(c)[0] for c in alphabet}
    for used in used_sets:
        if bounded:
            assert space.exhausted(used) == (values <= used), used
        for prefix in prefixes:
            reached = {v for v in values if v.startswith(prefix)}
            dead = space.string_dead(f'"{prefix}'.encode(), used)
            assert dead == (reached <= used) if bounded else not dead, (prefix, used)  # "b" reaches without end
            mask = part.mask(f'"{prefix}'.encode(), used)
            for c, token in singles.items():
                if any(v.startswith(prefix + c) for v in values) and mask[token >> 5] >> (token & 31) & 1:
                    assert not space.string_dead(f'"{prefix}{c}'.encode(), used), (prefix, c, used)
