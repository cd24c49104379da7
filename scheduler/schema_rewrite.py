"""Exact rewrites of JSON-schema keywords the grammar backends refuse into ones they enforce: each rewritten
schema admits exactly the documents the original admits (nothing is approximated; what cannot be rewritten
exactly is left for the backend to refuse, naming the keyword).

* ``dependentRequired``, ``dependentSchemas`` and draft 7's ``dependencies``: an ``anyOf`` over which
  trigger keys are present, each branch the whole object schema with the trigger forbidden, or required
  together with what it brings: its required keys and properties merged in, any other keyword of its
  schema intersected by an ``allOf`` (at most 4 triggers).
* ``not`` of a ``type`` (the complement of the types), of ``required`` (some listed key absent, up to 4), or
  of a ``const``/``enum`` of scalars (per type: the other booleans, numbers in the open intervals between the
  excluded ones, strings matching a pattern that spells every string but the excluded ones).
* ``oneOf`` whose branches are provably disjoint (distinct types, a required property whose const/enum
  values differ, a required key the other branch's closed object cannot hold): exactly an ``anyOf``.
* ``uniqueItems`` on arrays of at most one item: always satisfied, dropped; over booleans or an enum of at
  most 3 values: the enum of every arrangement of distinct values (within the length bounds).
"""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

from scheduler.grammar_spec import regex_literal
from scheduler.schema_walk import iter_subschemas

MAX_TRIGGERS = 4  # dependency keys rewritten per object: the rewrite has 2^n branches
MAX_UNIQUE_VALUES = 3  # uniqueItems over an enum of up to this many values: 16 arrangements at most
TYPES = ("null", "boolean", "object", "array", "number", "string")  # "integer" is within "number"
_ANNOTATIONS = ("title", "description", "$comment", "default", "examples")
_KEPT_ON_NODE = ("$defs", "definitions", "$schema", "$id", "$comment", "title", "description")
# Keywords whose meaning depends on sibling keywords: never moved between schemas.
_SIBLING_BOUND = ("additionalProperties", "patternProperties", "unevaluatedProperties", "properties", "items",
                  "additionalItems", "prefixItems", "unevaluatedItems", "if", "then", "else", "$ref")
_OBJECT_KEYS = ("type", "properties", "required", "additionalProperties", "patternProperties", "minProperties",
                "maxProperties", "propertyNames")


def rewrite(schema: dict[str, Any]) -> dict[str, Any]:
    """Rewrite ``schema`` in place (every subschema) and return it."""
    for node in iter_subschemas(schema):
        _dependencies(node)
        _not(node)
        _one_of(node, schema)
        if node.get("uniqueItems"):
            _unique_items(node)
    return schema


# ---- dependencies --------------------------------------------------------------------------------


def _dependencies(node: dict[str, Any]) -> None:
    triggers = _triggers(node)
    if not triggers or len(triggers) > MAX_TRIGGERS:
        return
    if node.get("patternProperties") and any(s and s.get("properties") for _, s in triggers.values()):
        return  # which pattern a brought key matches is not worked out here
    kept = {k: node.pop(k) for k in list(node) if k in _KEPT_ON_NODE}  # definitions are not copied per branch
    base = {k: v for k, v in node.items() if k not in ("dependencies", "dependentRequired", "dependentSchemas")}
    branches = []
    for present in itertools.product((False, True), repeat=len(triggers)):
        branch = copy.deepcopy(base)
        props = branch.setdefault("properties", {})
        required = list(branch.get("required") or [])
        also: list[Any] = []  # what the present triggers' schemas say beyond properties
        for (key, (keys, brought)), on in zip(triggers.items(), present, strict=True):
            if not on:
                props[key] = False
                continue
            if brought is None:
                also.append(False)  # this trigger cannot be present: no branch
                break
            required += [key, *keys, *(brought.get("required") or [])]
            for name, sub in (brought.get("properties") or {}).items():
                props[name] = _narrowed(props, base.get("additionalProperties"), name, sub)
            also += _beyond_properties(brought, branch)
        if required:
            branch["required"] = list(dict.fromkeys(required))
        if False not in also:
            branches.append({"allOf": [branch, *also]} if also else branch)
    node.clear()
    node.update(kept)
    node["anyOf"] = branches


def _triggers(node: dict[str, Any]) -> dict[str, tuple[list[str], Any]] | None:
    """Trigger key -> (the keys it requires, the schema it brings; None for ``false``: the key cannot be
    present); None when a value is malformed (left for the backend to name)."""
    triggers: dict[str, tuple[list[str], Any]] = {}
    sources = [("dependencies", node.get("dependencies")), ("dependentRequired", node.get("dependentRequired")),
               ("dependentSchemas", node.get("dependentSchemas"))]
    for keyword, table in sources:
        for key, value in (table or {}).items():
            keys, brought = triggers.get(key, ([], {}))
            if isinstance(value, list) and keyword != "dependentSchemas":
                keys = keys + value
            elif value is False:
                brought = None
            elif isinstance(value, dict) and keyword != "dependentRequired":
                brought = value if brought == {} else {"allOf": [brought, value]} if brought is not None else None
            elif value is not True:
                return None
            triggers[key] = (keys, brought)
    return triggers


def _beyond_properties(brought: dict[str, Any], branch: dict[str, Any]) -> list[dict[str, Any]]:
    """What a dependent schema says beyond its properties and required keys: keywords the branch lacks
    (and whose meaning does not depend on their siblings) are merged into it, the rest returned for an
    ``allOf``."""
    contextual = any(k in brought for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))
    rest = {k: v for k, v in brought.items() if k not in (*_ANNOTATIONS, "required")
            and (contextual or k != "properties")}
    if rest.get("type") == "object":
        del rest["type"]
    for key in [k for k in rest if k not in branch and k not in _SIBLING_BOUND and not contextual]:
        branch[key] = rest.pop(key)
    return [rest] if rest else []


def _narrowed(props: dict[str, Any], additional: Any, name: str, sub: Any) -> Any:
    """Property ``name``'s schema once a dependent schema adds ``sub``: the object's own rule for the key
    (its declared schema, else what ``additionalProperties`` says) still holds."""
    own = props.get(name, True if additional is None else additional)
    return sub if own is True else False if own is False else {"allOf": [own, sub]}


def _plain_object(node: dict[str, Any]) -> bool:
    return node.get("type", "object") == "object" and all(
        k in _OBJECT_KEYS or k in ("dependencies", "dependentRequired", "dependentSchemas", "title", "description",
                                   "$schema", "$id", "$comment", "default", "examples")
        for k in node)


# ---- uniqueItems --------------------------------------------------------------------------------


def _unique_items(node: dict[str, Any]) -> None:
    longest = node.get("maxItems")
    if isinstance(longest, int) and longest <= 1:
        del node["uniqueItems"]  # zero or one item: always unique
        return
    items = node.get("items")
    plain_enum = isinstance(items, dict) and set(items) <= {"enum", "const", "title", "description"}
    values = [True, False] if items == {"type": "boolean"} else _values(items) if plain_enum else None
    if values is None or len(values) > MAX_UNIQUE_VALUES or set(node) - {"type", "items", "uniqueItems", "minItems",
                                                                         "maxItems", "title", "description"}:
        return
    if node.get("type", "array") != "array" or len({_json_key(v) for v in values}) != len(values):
        return
    shortest, longest = node.get("minItems", 0), longest if isinstance(longest, int) else len(values)
    arrangements = [list(a) for n in range(shortest, min(longest, len(values)) + 1)
                    for a in itertools.permutations(values, n)]
    node.clear()
    node["enum"] = arrangements  # every array of distinct values, as literals


def _json_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


# ---- not -----------------------------------------------------------------------------------------


def _not(node: dict[str, Any]) -> None:
    negated = node.get("not")
    if not isinstance(negated, dict) or len(negated) != 1:
        return
    if "type" in negated:
        excluded = {negated["type"]} if isinstance(negated["type"], str) else set(negated["type"])
        if "integer" in excluded and "number" not in excluded:
            return  # "not an integer" admits 1.5: no set of types says that
        own = node.get("type", list(TYPES))
        own = [own] if isinstance(own, str) else list(own)
        node["type"] = [t for t in own if ("number" if t == "integer" else t) not in excluded]
        del node["not"]
    elif ("const" in negated or isinstance(negated.get("enum"), list)) and set(node) <= {"not", "type", "title",
                                                                                         "description"}:
        branches = _all_but(_values(negated), node.get("type"))
        if branches is not None:
            node.pop("not")
            node.pop("type", None)
            node["anyOf"] = branches
    elif isinstance(negated.get("required"), list) and len(negated["required"]) == 1:
        node.setdefault("properties", {})[negated["required"][0]] = False  # "not all of [k]": k is absent
        del node["not"]
    elif isinstance(negated.get("required"), list) and 1 < len(negated["required"]) <= MAX_TRIGGERS \
            and "anyOf" not in node and _plain_object({k: v for k, v in node.items() if k != "not"}):
        base = {k: v for k, v in node.items() if k != "not"}  # not all of the keys: one of them is absent
        branches = []
        for key in negated["required"]:
            branch = copy.deepcopy(base)
            branch.setdefault("properties", {})[key] = False
            branches.append(branch)
        node.clear()
        node["anyOf"] = branches


def _all_but(excluded: list[Any], kind: Any) -> list[dict[str, Any]] | None:
    """Schemas (one per type) for every value of ``kind`` (a type or types; None: any) except ``excluded``
    scalars; None when an excluded value is an object or an array (no complement written for those)."""
    if any(isinstance(v, dict | list) for v in excluded):
        return None
    kinds = list(TYPES) if kind is None else [kind] if isinstance(kind, str) else list(kind)
    numbers = sorted({v for v in excluded if isinstance(v, int | float) and not isinstance(v, bool)})
    branches: list[dict[str, Any]] = []
    for t in kinds:
        if t == "boolean":
            kept = [b for b in (True, False) if not any(v is b for v in excluded)]
            branches += [{"enum": kept}] if kept else []
        elif t == "null":
            branches += [] if None in excluded else [{"type": "null"}]
        elif t == "string":
            words = [v for v in excluded if isinstance(v, str)]
            branches.append({"type": "string", "pattern": f"^{all_strings_but(words)}$"} if words else {"type": t})
        elif t in ("number", "integer"):
            bounds = [None, *numbers, None]  # the open intervals between excluded numbers
            for lo, hi in itertools.pairwise(bounds):
                branch: dict[str, Any] = {"type": t}
                if lo is not None:
                    branch["exclusiveMinimum"] = lo
                if hi is not None:
                    branch["exclusiveMaximum"] = hi
                branches.append(branch)
        else:
            branches.append({"type": t})
    return branches


def all_strings_but(words: list[str]) -> str:
    """A regex (unanchored body) for every string except ``words``: a trie of them, leaving it anywhere."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def body(node: dict[str, Any]) -> str:
        children = sorted(k for k in node if k)
        alts = [] if "" in node else [""]  # stopping here is allowed unless a word ends here
        leave = "".join(regex_literal(c) for c in children)
        alts.append(f"[^{leave}](?s:.*)" if children else "(?s:.+)")
        alts += [regex_literal(c) + body(node[c]) for c in children]
        return "(?:" + "|".join(alts) + ")"

    return body(trie)


# ---- oneOf ---------------------------------------------------------------------------------------


def _one_of(node: dict[str, Any], root: dict[str, Any]) -> None:
    branches = node.get("oneOf")
    if not isinstance(branches, list) or "anyOf" in node:
        return
    resolved = [_resolve(b, root) for b in branches]
    if all(isinstance(b, dict) for b in resolved) and all(
            _disjoint(a, b) for a, b in itertools.combinations(resolved, 2)):
        node["anyOf"] = node.pop("oneOf")


def _resolve(schema: Any, root: dict[str, Any], depth: int = 0) -> Any:
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#/") or depth > 8:
        return schema
    target: Any = root
    for part in ref[2:].split("/"):
        target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
    return _resolve(target, root, depth + 1) if isinstance(target, dict) else schema


def _types(schema: dict[str, Any]) -> set[str] | None:
    kind = schema.get("type")
    if kind is None:
        return None
    kinds = {kind} if isinstance(kind, str) else set(kind)
    return {"number" if k == "integer" else k for k in kinds}


def _values(schema: Any) -> list[Any] | None:
    if isinstance(schema, dict) and "const" in schema:
        return [schema["const"]]
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list):
        return schema["enum"]
    return None


def _disjoint(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    if (va := _values(a)) is not None and (vb := _values(b)) is not None:
        return not any(x == y and type(x) is type(y) for x in va for y in vb)
    return _object_disjoint(a, b) or _object_disjoint(b, a)


def _object_disjoint(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Some key a requires that b cannot hold, or that both require with disjoint const/enum values."""
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    for key in a.get("required") or ():
        if pb.get(key) is False or (b.get("additionalProperties") is False and key not in pb
                                    and not b.get("patternProperties")):
            return True
        if key in (b.get("required") or ()):
            va, vb = _values(pa.get(key)), _values(pb.get(key))
            if va is not None and vb is not None and not any(x == y and type(x) is type(y) for x in va for y in vb):
                return True
    return False
