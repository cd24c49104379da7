"""Where a JSON schema holds other schemas: the keyword tables every schema pass walks by, and a walk over
every object subschema. Everything else in a schema is data or an annotation and is never walked into (a
property named ``not`` is a name, not a keyword)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
SCHEMA_ONE = (
    "additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not", "if", "then",
    "else", "unevaluatedItems", "unevaluatedProperties",
)  # fmt: skip
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def children(node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(keyword, subschema) for every schema directly inside ``node``."""
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from ((key, sub) for sub in node[key].values())
    for key in SCHEMA_ONE:
        if isinstance(node.get(key), dict):
            yield key, node[key]
    for key in SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from ((key, sub) for sub in node[key])
    if isinstance(node.get("dependencies"), dict):  # draft 7: a schema or a list of keys per trigger
        yield from (("dependencies", sub) for sub in node["dependencies"].values())


def iter_subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    """Every object subschema, the root included, each before its children, so a caller may rewrite a node
    before the walk reads what it holds (iterative: schemas can be deep)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node
        stack.extend(sub for _, sub in children(node))


# Keywords that neither admit nor forbid keys by themselves: a node holding only these leaves it to its branches.
PASS_THROUGH = frozenset({"anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "$schema", "$id", "$comment",
                          "title", "description", "default", "examples", "x-slotserve"})


def admits_undeclared_keys(node: dict[str, Any]) -> bool:
    """Whether an object under ``node`` may hold keys it does not declare (so a key could repeat): it may be an
    object, is not a mere wrapper of branches, and has pattern properties or no `additionalProperties: false`."""
    kinds = node.get("type")
    may_be_object = kinds is None or kinds == "object" or (isinstance(kinds, list) and "object" in kinds)
    if not may_be_object or (node and set(node) <= PASS_THROUGH):
        return False
    return bool(node.get("patternProperties")) or node.get("additionalProperties", True) is not False
