"""A JSON schema narrowed to documents a small model can finish, still inside the schema: every document the
narrowed schema admits is valid under the original (each rule below only removes valid documents).

* Closed objects: an object that declares ``properties`` admits only those, unless the schema itself
  admits more (``additionalProperties`` true or a schema, ``patternProperties``,
  ``unevaluatedProperties``). This is what XGrammar calls strict mode and vLLM serves by default; without
  it a small model runs away inventing keys. Objects that take part in an ``allOf`` or a
  ``dependentSchemas`` (and definitions a schema with ``allOf`` may merge) stay as they are: closing one
  side of an intersection would exclude the other side's properties. Nothing under a ``not`` or an
  ``if`` is narrowed: narrowing there would widen what the whole schema admits.
* Bounded numbers: a ``number`` is written with at most 17 significant digits (what a float64 carries),
  at most 9 of them after the point, and no exponent; an ``integer`` with at most 17 digits.
* Bounded fractions: ``date-time`` and ``time`` strings carry at most 9 fractional-second digits.

A schema opts out with ``"x-slotserve": {"strict": false}`` at its root (then it is used as given).
"""

from __future__ import annotations

import math
from typing import Any

from scheduler.schema_walk import children, iter_subschemas

SIGNIFICANT_DIGITS = 17
FRACTION_DIGITS = range(10)  # one number branch per count of decimals: at most 9, and 17 digits in all
MAX_INTEGER = 10**SIGNIFICANT_DIGITS - 1
# At most 9 digits after the seconds' point, whatever the offset: a pattern the format's grammar intersects.
SECOND_FRACTION_PATTERN = r"^[^.]*(\.[0-9]{1,9}[^0-9.][^.]*)?$"
OPT_OUT_KEY = "x-slotserve"
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref", "if")
# Schemas that apply to the same object as their parent: closing one would exclude the other's properties.
_INTERSECTED = ("allOf", "dependentSchemas", "dependencies")
# Narrowing under a negation or a condition would widen what the schema admits: left as written.
_UNTOUCHED = ("not", "if")


def wants_strict(schema: dict[str, Any]) -> bool:
    """Whether the schema accepts the narrowing (it has not opted out); removes the opt-out key."""
    options = schema.pop(OPT_OUT_KEY, None)
    return not (isinstance(options, dict) and options.get("strict") is False)


def tighten(schema: dict[str, Any], numbers: bool = True, objects: bool = True) -> dict[str, Any]:
    """Narrow ``schema`` in place (see the module docstring) and return it; applying it twice changes nothing
    more. ``numbers``: bound number literals and second fractions (for backends that enforce
    ``minimum``/``maximum``/``multipleOf``); ``objects``: close objects."""
    merged_defs = any("allOf" in sub for sub in iter_subschemas(schema))
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, keep_open = stack.pop()
        if not isinstance(node, dict):
            continue
        if objects and not keep_open and _declares_properties(node) and not any(k in node for k in _OPEN_KEYS):
            _close(node)
        if numbers:
            _bound_literals(node)
        for key, sub in children(node):
            if key in _UNTOUCHED:
                continue
            keep = key in _INTERSECTED or (key in ("$defs", "definitions") and merged_defs)
            stack.append((sub, keep))
    return schema


def _declares_properties(node: dict[str, Any]) -> bool:
    """Some property is declared with a schema (a ``false`` one only forbids a key, as rewrites write)."""
    props = node.get("properties")
    return isinstance(props, dict) and any(sub is not False for sub in props.values())


def _close(node: dict[str, Any]) -> None:
    """Admit only the declared properties, and the required ones a schema forgot to declare (any value)."""
    for key in node.get("required") or ():
        if isinstance(key, str):
            node["properties"].setdefault(key, {})
    node["additionalProperties"] = False


def _bound_literals(node: dict[str, Any]) -> None:
    kind = node.get("type")
    if "enum" in node or "const" in node:
        return
    if kind == "number" and "multipleOf" not in node:
        branches = _number_branches(node)
        if branches:
            rest = {k: v for k, v in node.items() if k != "type" and k not in _NUMBER_BOUNDS}
            node.clear()
            node.update(rest)
            node["anyOf"] = branches
    elif kind == "integer":
        node["minimum"] = max(node.get("minimum", -MAX_INTEGER), -MAX_INTEGER)
        node["maximum"] = min(node.get("maximum", MAX_INTEGER), MAX_INTEGER)
    elif node.get("format") in ("date-time", "time") and "pattern" not in node and kind in (None, "string"):
        node["pattern"] = SECOND_FRACTION_PATTERN


_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _number_branches(node: dict[str, Any]) -> list[dict[str, Any]]:
    """One branch per count of decimals k: |x| below 10^(17-k), a multiple of 10^-k (k = 0: an integer). The
    number's own bounds go into every branch; branches they leave empty are dropped."""
    lo, hi = node.get("minimum"), node.get("maximum")
    own = {k: node[k] for k in ("exclusiveMinimum", "exclusiveMaximum") if k in node}
    branches = []
    for k in FRACTION_DIGITS:
        bound = 10 ** (SIGNIFICANT_DIGITS - k) - 10.0**-k if k else MAX_INTEGER
        low = -bound if lo is None else max(lo, -bound)
        high = bound if hi is None else min(hi, bound)
        if not k:
            low, high = math.ceil(low), math.floor(high)
        if low <= high:
            branch: dict[str, Any] = {"type": "number" if k else "integer", "minimum": low, "maximum": high, **own}
            if k:
                branch["multipleOf"] = 10.0**-k
            branches.append(branch)
    return branches
