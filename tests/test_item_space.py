"""What a unique array's item can still become (`scheduler.item_space`), checked against the grammar itself:
the item language is read off llguidance (every spelling it accepts, found by walking its prefixes), and for
every prefix and many sets of used values, `dead` and `exhausted` must say exactly what that language says."""

from __future__ import annotations

import json
import random
from decimal import Decimal

import pytest

from scheduler.grammar import ConstraintSpec
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


def language(compiler, tokenizer, items: dict) -> dict[str, object]:
    """Every item spelling the grammar of an array of ``items`` accepts -> its value for uniqueness."""
    compiled = compiler.compile(ConstraintSpec.json_schema({"type": "array", "items": items}))

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
    space = item_space(items)
    assert space is not None
    prefixes = {text[:n] for text in spellings for n in range(1, len(text) + 1)}
    rng = random.Random(0)
    used_sets = [set(), set(values)] + [set(rng.sample(sorted(values, key=repr), rng.randrange(len(values))))
                                        for _ in range(30)]
    for used in used_sets:
        assert space.exhausted(used) == (values <= used), used
        for prefix in prefixes:
            # After a bare "-", 0 does not count: it is still written "0" (llguidance takes "-0" for some schemas).
            reached = {v for text, v in spellings.items() if text.startswith(prefix) and (prefix != "-" or v != 0)}
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
    assert item_space(items) is None


def test_a_union_of_item_schemas_follows_every_branch():
    """`oneOf` [a non-empty string, null]: a string item never runs out and null is one value; a `$ref` cycle
    through branches is not followed."""
    space = item_space({"oneOf": [{"type": "string", "minLength": 1, "maxLength": 3}, {"type": "null"}]})
    assert space is not None and space.max_length == 3
    assert space.scalar_dead(b"n", {b"null"}) and not space.scalar_dead(b"n", {"x"})
    assert not space.string_dead(b'"ab', {"ab"}) and not space.exhausted({"ab", b"null"})
    defs = {"loop": {"anyOf": [{"$ref": "#/loop"}, {"type": "null"}]}}
    assert item_space({"$ref": "#/loop"}, resolve=lambda n: defs["loop"] if n == {"$ref": "#/loop"} else n) is None
