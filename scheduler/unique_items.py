"""`uniqueItems` over arrays of strings and numbers, enforced beside the grammar (docs/structured-output.md).

No grammar engine here enforces `uniqueItems` beyond small enums (`schema_rewrite` turns those into the enum
of their arrangements). For an array whose items are plain strings or numbers, the grammar is compiled
without the keyword and the host masks, beside the grammar's mask, every token that would complete an item
equal to one the array already holds (`scheduler.json_keys`, whose JSON lexer follows the document and asks
`SchemaNav` which arrays it is writing are unique ones). Equal means equal as JSON Schema compares: strings
decoded, numbers by value (1 and 1.0 are one number).

Only item spaces that can not run out, or whose remaining values are known, are lifted this way, so that
masking a completion never leaves the grammar with nothing valid to write:
* an enum of strings: an item that could only become a used value is removed at the token that commits to
  it, and so is the opening quote of another item once every value is used;
* strings with no `enum`, `const`, `pattern` or `format`: a string can always grow by one more character (at
  its `maxLength` it can not, so the token that would make it a used item of that length is removed);
* numbers with no `enum`, `const`, `multipleOf` or upper bound: a number can always grow by one more digit
  (0 and -0 can not, so they are removed at their first digit).
Any other `uniqueItems` stays for the backend to refuse, naming it. A JSON-schema response format only: in a tool call
the document is a function's arguments, and the functions' schemas are not followed. Should a repeat still be
the only way on (a used item spelled with escapes up to its maxLength), the request ends with an error rather
than a repeated item.
"""

from __future__ import annotations

import copy
import json
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from scheduler.grammar_spec import ConstraintSpec
from scheduler.schema_rewrite import rewrite
from scheduler.schema_walk import iter_subschemas

SCALAR_TYPES = frozenset({"string", "number", "integer"})
# Keywords that bound an item space (a string's by length or shape, a number's from above): not lifted.
_BOUNDING = ("enum", "const", "pattern", "format", "multipleOf", "maximum", "exclusiveMaximum")
_ARRAY_TUPLES = ("prefixItems", "additionalItems", "contains")
MAX_REF_DEPTH = 32  # $ref chains followed per lookup (a cycle of refs alone is a schema error)


def item_value(raw: str | bytes) -> str | Decimal | None:
    """A completed item's value for the uniqueness test: a string's decoded text, or a number's value."""
    if isinstance(raw, str):
        return raw
    try:
        return Decimal(raw.decode("ascii")).normalize()
    except (InvalidOperation, UnicodeDecodeError):
        return None


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


def string_enum(items: Any) -> list[str] | None:
    """The values of an item schema that is an enum of strings and nothing else that bounds it, else None."""
    if not isinstance(items, dict) or not isinstance(items.get("enum"), list) or not items["enum"]:
        return None
    if items.get("type", "string") != "string" or any(k in items for k in _BOUNDING if k != "enum"):
        return None
    values = items["enum"]
    return values if all(isinstance(v, str) for v in values) else None


def liftable(root: dict[str, Any], node: dict[str, Any]) -> bool:
    """Whether the host can enforce this node's `uniqueItems: true` exactly (see the module docstring)."""
    if node.get("uniqueItems") is not True or any(k in node for k in _ARRAY_TUPLES):
        return False
    items = _resolve(root, node.get("items"))
    if string_enum(items) is not None:
        return True
    if not isinstance(items, dict) or any(k in items for k in _BOUNDING):
        return False
    kinds = items.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    if not kinds or not kinds <= SCALAR_TYPES:
        return False
    composed = any(k in items for k in ("anyOf", "oneOf", "allOf", "not", "if"))
    return not composed


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


def unique_nav(spec: ConstraintSpec) -> SchemaNav | None:
    """The schemas to follow for a JSON-schema constraint whose grammar left out some `uniqueItems` (as
    `prepare_schema(..., lift_unique=True)` does); None when none was left out."""
    if spec.kind != "json_schema" or '"uniqueItems"' not in spec.value:
        return None
    schema = spec.schema
    if not isinstance(schema, dict):
        return None
    rewrite(schema)
    kept = lift(schema)
    return SchemaNav(kept) if kept is not None else None


class SchemaNav:
    """Which schemas a position in a JSON document is under, to tell unique arrays: a container's schemas
    are its parent's member (by key) or item (by index) schemas, with `$ref` followed and `allOf` / `anyOf`
    / `oneOf` flattened (any branch that declares uniqueness makes the array unique: on another branch that
    only removes documents, never admits one)."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root

    def top(self) -> tuple[dict[str, Any], ...]:
        return self._expand([self.root])

    def member(self, nodes: tuple[dict[str, Any], ...], key: str) -> tuple[dict[str, Any], ...]:
        found: list[Any] = []
        for node in nodes:
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
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

    def item_enum(self, nodes: tuple[dict[str, Any], ...]) -> dict[bytes, str] | None:
        """For a unique array of string enum items: each value's JSON spelling (quotes included) -> the value
        (every unique branch's values together); None when some unique branch's items are open."""
        out: dict[bytes, str] = {}
        for node in nodes:
            if node.get("uniqueItems") is not True:
                continue
            values = string_enum(_resolve(self.root, node.get("items")))
            if values is None:
                return None
            out.update({json.dumps(v, ensure_ascii=False).encode(): v for v in values})
        return out or None

    def item_max_length(self, nodes: tuple[dict[str, Any], ...]) -> int | None:
        """The smallest `maxLength` of a unique array's string items (None: unbounded)."""
        bounds = []
        for node in nodes:
            items = _resolve(self.root, node.get("items")) if node.get("uniqueItems") is True else None
            if isinstance(items, dict) and isinstance(items.get("maxLength"), int | float):
                bounds.append(int(items["maxLength"]))
        return min(bounds, default=None)

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
