"""`uniqueItems` over arrays of scalars, enforced beside the grammar (docs/structured-output.md).

No grammar engine here enforces `uniqueItems` beyond small enums (`schema_rewrite` turns those into the enum
of their arrangements). For an array whose items are scalars (strings, numbers, booleans, null, enums of them),
the grammar is compiled without the keyword and the host masks, beside the grammar's mask, every token after
which an item could only become one the array already holds (`scheduler.json_keys`, whose JSON lexer follows
the document and asks `SchemaNav` which arrays it is writing are unique ones, and `scheduler.item_space` what
their items can still become). Equal means equal as JSON Schema compares: strings decoded, numbers by value (1
and 1.0 are one number), `true` is not 1.

The look-ahead is what keeps the grammar from a dead end: a token is removed where the item's remaining values
are all used (the `5` of an integer up to 5 once 5 is used), not only where it closes the item, and once no new
item is left the comma of another is removed. Strings under a `pattern` or a `format` are asked of the grammar
engine (`scheduler.pattern_items`), and so are numbers on a fractional `multipleOf` and items composed by
`allOf` (`scheduler.grammar_scalars`). Item spaces that can not be followed exactly stay for the backend to
refuse, naming `uniqueItems`: items composed by `not` or `if`, an `allOf` mixing strings with other kinds,
objects and arrays. In a tool call the document is `{"name": ..., "arguments": ...}`: `call_nav` follows it
as one branch per function, told apart by the name (`SchemaNav.discriminators`).
Should a repeat still be the only way on (an item spelled with escapes up to its maxLength), the request ends
with an error rather than a repeated item.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from functools import reduce
from typing import Any

from scheduler.grammar_spec import ConstraintSpec
from scheduler.item_space import ItemSpace, item_space
from scheduler.pattern_items import PatternLanguage
from scheduler.schema_rewrite import rewrite
from scheduler.schema_walk import admits_undeclared_keys, iter_subschemas
from scheduler.strict_schema import tighten, wants_strict

_ARRAY_TUPLES = ("prefixItems", "additionalItems", "contains")
MAX_REF_DEPTH = 32  # $ref chains followed per lookup (a cycle of refs alone is a schema error)


def _resolve(root: dict[str, Any], node: Any) -> Any:
    """Follow local `$ref`s ("#/a/b") from ``node``; a ref that does not resolve gives None."""
    for _ in range(MAX_REF_DEPTH):
        if not isinstance(node, dict) or not isinstance(node.get("$ref"), str):
            return node
        ref = node["$ref"]
        if not ref.startswith("#"):
            return None
        target: Any = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        node = target
    return None


def liftable(root: dict[str, Any], node: dict[str, Any]) -> bool:
    """Whether the host can enforce this node's `uniqueItems: true` exactly (see the module docstring). Pattern
    and format strings count: `SchemaNav` follows them with the grammar engine (an item schema the engine
    refuses is refused by the grammar itself)."""
    if node.get("uniqueItems") is not True or any(k in node for k in _ARRAY_TUPLES):
        return False
    space = item_space(node.get("items"), resolve=lambda sub: _resolve(root, sub), oracle=_AssumedFollowed())
    return space is not None


class _AssumedFollowed:
    """An item-oracle stand-in for `liftable`: whether an item space exists, not what it is (an item schema the
    engine refuses is refused by the grammar itself)."""

    def strings(self, node: dict[str, Any], strict: bool) -> None:
        return None  # as if plain strings

    def composed_strings(self, node: dict[str, Any], strict: bool) -> object:
        return node

    def scalars(self, node: dict[str, Any], strict: bool) -> object:
        return node


def lift(schema: dict[str, Any]) -> dict[str, Any] | None:
    """Drop every liftable `uniqueItems` from ``schema`` (in place: the grammar is compiled without them) and
    return a copy that keeps them, for `SchemaNav`; None when there was none."""
    nodes = [node for node in iter_subschemas(schema) if liftable(schema, node)]
    if not nodes:
        return None
    kept = copy.deepcopy(schema)
    for node in nodes:
        del node["uniqueItems"]
    return kept


def document_nav(spec: ConstraintSpec, patterns: PatternLanguage) -> SchemaNav | None:
    """The schemas the host follows a JSON-schema constraint's document (or a tool-or-answer union's answer) by:
    which arrays it keeps unique (the `uniqueItems` the grammar left out, as `prepare_schema(...,
    lift_unique=True)` does; pattern and format items asked of ``patterns``) and which objects may repeat a
    key. None for other constraints."""
    if spec.kind == "json_schema":
        schema = spec.schema
    elif spec.kind == "tools" and spec.tool_mode == "auto" and spec.answer_schema is not None:
        schema = spec.answer_schema
    else:
        return None
    root, strict = _grammar_view(schema)
    return SchemaNav(root, patterns, strict)


def call_nav(spec: ConstraintSpec, patterns: PatternLanguage) -> SchemaNav | None:
    """The schemas the host follows a tool call (`{"name": ..., "arguments": ...}`) by: one branch per function,
    told apart by its name, whose arguments are its parameters as the grammar has them. None but for tools."""
    if spec.kind != "tools":
        return None
    branches, strict = [], True
    for fn in spec.functions:
        root, fn_strict = _grammar_view(fn["parameters"])
        strict = strict and fn_strict
        branches.append({"type": "object", "additionalProperties": False,
                         "properties": {"name": {"const": fn["name"]}, "arguments": root}})
    return SchemaNav({"anyOf": branches}, patterns, strict)


def _grammar_view(schema: Any) -> tuple[dict[str, Any], bool]:
    """(a copy of ``schema`` as the grammar has it: rewritten, objects closed by the strict narrowing, but with the
    `uniqueItems` the grammar leaves out kept; whether the schema takes the strict narrowing)."""
    if not isinstance(schema, dict):
        return {}, True  # `true` (anything), or a schema the grammar refused
    schema = copy.deepcopy(schema)
    strict = wants_strict(schema)
    rewrite(schema)
    kept = lift(schema)
    root = kept if kept is not None else schema
    if strict:
        tighten(root, numbers=False)
    return root, strict


class SchemaNav:
    """Which schemas a position in a JSON document is under, to tell unique arrays: a container's schemas
    are its parent's member (by key) or item (by index) schemas, with `$ref` followed and `allOf` / `anyOf`
    / `oneOf` flattened (any branch that declares uniqueness makes the array unique: on another branch that
    only removes documents, never admits one)."""

    def __init__(self, root: dict[str, Any], patterns: PatternLanguage, strict: bool = True) -> None:
        self.root = root
        self.patterns = patterns
        self.strict = strict  # numbers are written as `strict_schema` bounds them
        # Members whose string values tell branches apart (a `const` in some `properties`): the lexer records
        # them, and a branch whose const another value contradicts is left out below them.
        self.discriminators = frozenset(
            key for node in iter_subschemas(root) if isinstance(node.get("properties"), dict)
            for key, sub in node["properties"].items() if isinstance(sub, dict) and isinstance(sub.get("const"), str))

    def top(self) -> tuple[dict[str, Any], ...]:
        return self._expand([self.root])

    def member(self, nodes: tuple[dict[str, Any], ...], key: str,
               values: Mapping[str, str] | None = None) -> tuple[dict[str, Any], ...]:
        """The schemas of member ``key`` of an object under ``nodes`` whose recorded discriminator ``values``
        are those (a node whose property const differs from one is not the object's)."""
        found: list[Any] = []
        for node in nodes:
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            if values and any(isinstance(props.get(k), dict) and props[k].get("const", v) != v
                              for k, v in values.items()):
                continue
            if key in props:
                found.append(props[key])
                continue
            patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
            matched = [sub for pattern, sub in patterns.items() if _searches(pattern, key)]
            found.extend(matched)
            if not matched and isinstance(node.get("additionalProperties"), dict):
                found.append(node["additionalProperties"])
        return self._expand(found)

    def item(self, nodes: tuple[dict[str, Any], ...], index: int) -> tuple[dict[str, Any], ...]:
        found: list[Any] = []
        for node in nodes:
            prefix = node.get("prefixItems")
            if isinstance(prefix, list) and index < len(prefix):
                found.append(prefix[index])
            elif isinstance(node.get("items"), dict):
                found.append(node["items"])
            elif isinstance(node.get("items"), list) and index < len(node["items"]):  # draft 7 tuples
                found.append(node["items"][index])
        return self._expand(found)

    @staticmethod
    def unique(nodes: tuple[dict[str, Any], ...]) -> bool:
        return any(node.get("uniqueItems") is True for node in nodes)

    @staticmethod
    def keys_may_repeat(nodes: tuple[dict[str, Any], ...]) -> bool:
        """Whether an object under ``nodes`` may hold undeclared keys (unknown schemas: it may)."""
        return not nodes or any(admits_undeclared_keys(node) for node in nodes)

    def item_space(self, nodes: tuple[dict[str, Any], ...]) -> ItemSpace | None:
        """What the items of a unique array under ``nodes`` can be (every unique branch's together)."""
        spaces = [item_space(node.get("items"), self.strict, lambda sub: _resolve(self.root, sub),
                             oracle=self.patterns)
                  for node in nodes if node.get("uniqueItems") is True]
        known = [space for space in spaces if space is not None]
        return reduce(ItemSpace.union, known) if known else None

    def _expand(self, nodes: list[Any]) -> tuple[dict[str, Any], ...]:
        out: list[dict[str, Any]] = []
        seen: set[int] = set()
        stack = list(reversed(nodes))
        while stack:
            node = _resolve(self.root, stack.pop())
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            out.append(node)
            for key in ("allOf", "anyOf", "oneOf"):
                if isinstance(node.get(key), list):
                    stack.extend(reversed(node[key]))
        return tuple(out)


def _searches(pattern: str, key: str) -> bool:
    try:
        return re.search(pattern, key) is not None
    except re.error:
        return False
