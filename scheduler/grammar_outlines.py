"""outlines-core backend: a regex per grammar, compiled to a token-level DFA (Index) per tokenizer.

Selectable, not the default: Index construction takes ~1-20 s per schema on 262k tokens (GIL
released), and only a checked subset of JSON Schema is enforced exactly; the rest is refused.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from core.tokenizer import Tokenizer
from scheduler.grammar_backends import Backend, GrammarMatcher, prepare_schema
from scheduler.grammar_spec import (
    MAX_PARALLEL_CALLS,
    ConstraintSpec,
    UnsupportedConstraintError,
    canonical_json,
    not_containing_regex,
    regex_literal,
)
from scheduler.tool_protocol import TOOL_CALL_MARKER, call_head

__all__ = ["OutlinesCoreBackend", "OutlinesMatcher", "check_outlines_schema", "outlines_regex", "outlines_vocabulary"]

_vocab_lock = threading.Lock()


class OutlinesMatcher(GrammarMatcher):
    """outlines-core Guide plus what it lacks: several stop ids, an error state, finished-ness."""

    def __init__(self, index: Any, stop_ids: frozenset[int], vocab_size: int) -> None:
        from outlines_core import Guide

        self._index = index
        self._guide = Guide(index)
        self._finals = frozenset(index.get_final_states())
        self.stop_ids = stop_ids
        self.vocab_size = vocab_size
        self._stopped = False  # a stop token was consumed
        self._error: str | None = None

    def _final(self) -> bool:
        return self._guide.get_state() in self._finals

    def consume(self, token: int) -> bool:
        token = int(token)
        if self._error is not None or self._stopped:
            self._error = self._error or f"token {token} after the end of the output"
            return False
        if token in self.stop_ids:
            if self._final():
                self._stopped = True
                return True
        elif self._guide.accepts_tokens([token]):
            self._guide.advance(token_id=token, return_tokens=False)
            return True
        self._error = f"token {token} not allowed by the grammar"
        return False

    def _next_text_tokens(self) -> list[int]:
        return [t for t in self._guide.get_tokens() if t not in self.stop_ids]

    def forced_tokens(self) -> list[int]:
        if self._error is not None or self._stopped or self._final():
            return []
        tokens = self._next_text_tokens()
        return tokens if len(tokens) == 1 else []

    def is_accepting(self) -> bool:
        return self._error is None and (self._stopped or self._final())

    def is_finished(self) -> bool:
        return self._error is not None or self._stopped or (self._final() and not self._next_text_tokens())

    @property
    def error(self) -> str | None:
        return self._error

    def fill_row(self, row: np.ndarray) -> None:
        """Write this matcher's mask into one contiguous uint32 row."""
        if self._error is not None or self._stopped:
            row[:] = 0
        else:
            self._guide.write_mask_into(row.ctypes.data, row.size, 4)
        final = self._stopped or self._error is not None or self._final()
        for t in self.stop_ids:  # the Guide knows one EOS; every stop id follows "accepting"
            word, bit = divmod(t, 32)
            row[word] = (row[word] | np.uint32(1 << bit)) if final else (row[word] & ~np.uint32(1 << bit))


_oc_vocabularies: weakref.WeakKeyDictionary[Tokenizer, Any] = weakref.WeakKeyDictionary()

# Keywords outlines-core's regex translation enforces exactly (checked against the JSON Schema test
# suite in tests/test_schema_suite.py), and annotations that constrain nothing. Anything else is
# refused: it ignores numeric bounds, approximates allOf/oneOf, its format regexes admit invalid
# values (e.g. 2021-02-31), patterns are spliced into JSON strings unescaped, and it drops keywords
# beside $ref/anyOf/enum.
_OC_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                             "writeOnly"})  # fmt: skip
_OC_BY_TYPE = {
    "string": frozenset({"minLength", "maxLength", "format"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
}
_OC_TYPES = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})
OC_FORMATS = frozenset({"uuid"})
OUTLINES_MAX_REGEX = 4_000


def _json_types(value: Any) -> set[str]:
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    return {str: {"string"}, type(None): {"null"}, list: {"array"}, dict: {"object"}}[type(value)]


def check_outlines_schema(schema: dict[str, Any]) -> None:
    """Raise UnsupportedConstraintError unless outlines-core enforces ``schema`` exactly."""
    stack: list[tuple[Any, bool]] = [(schema, True)]
    while stack:
        node, root = stack.pop()
        if not isinstance(node, dict):
            raise UnsupportedConstraintError("boolean subschema", "outlines-core backend")
        keys = set(node) - _OC_ANNOTATIONS - ({"$schema", "$defs", "definitions"} if root else set())
        kind = node.get("type")
        if kind is not None:
            kinds = [kind] if isinstance(kind, str) else kind
            if not isinstance(kinds, list) or not kinds or not set(kinds) <= _OC_TYPES:
                raise UnsupportedConstraintError("type", f"{kind!r} (outlines-core backend)")
            keys.discard("type")
        typed = _OC_BY_TYPE.get(kind, frozenset()) if isinstance(kind, str) else frozenset()
        for key in ("$ref", "anyOf", "enum", "const"):
            if key in node:
                # outlines-core drops siblings of these; only a `type` every value satisfies is safe.
                rest = keys - {key} - ({"type"} if key in ("enum", "const") else set())
                if rest:
                    raise UnsupportedConstraintError(f"{key} with sibling keywords", ", ".join(sorted(rest)))
                if key in ("enum", "const"):
                    values = node["enum"] if key == "enum" else [node["const"]]
                    # It splices object keys into the regex unescaped ("a.b" would match "axb").
                    if not isinstance(values, list) or any(isinstance(v, dict | list) for v in values):
                        raise UnsupportedConstraintError(f"{key} of objects or arrays", "outlines-core backend")
                    if kind is not None and any(not _json_types(v) & set(kinds) for v in values):
                        raise UnsupportedConstraintError(f"{key} with type", "outlines-core backend")
                keys.discard(key)
        unknown = keys - typed
        if unknown:
            raise UnsupportedConstraintError(", ".join(sorted(unknown)), "not enforced exactly by outlines-core")
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and ref.startswith("#/")):
            raise UnsupportedConstraintError("$ref", f"{ref!r}: only local references (outlines-core backend)")
        if "format" in node and node["format"] not in OC_FORMATS:
            raise UnsupportedConstraintError(f"format: {node['format']}", "outlines-core backend")
        props, required = node.get("properties", {}), node.get("required", [])
        if not isinstance(props, dict) or not isinstance(required, list) or not set(required) <= set(props):
            # outlines-core ignores required keys that have no property schema.
            raise UnsupportedConstraintError("required", "names a key not in properties (outlines-core backend)")
        if isinstance(node.get("items"), list):
            raise UnsupportedConstraintError("items", "array form (outlines-core backend)")
        stack.extend((s, False) for s in props.values())
        for key in ("$defs", "definitions"):
            if root and isinstance(node.get(key), dict):
                stack.extend((s, False) for s in node[key].values())
        if "prefixItems" in node and node.get("items", False) is not False:
            raise UnsupportedConstraintError("items after prefixItems", "outlines-core backend")
        if "items" in node and "prefixItems" not in node:
            stack.append((node["items"], False))
        if isinstance(node.get("additionalProperties"), dict):
            stack.append((node["additionalProperties"], False))
        for key in ("anyOf", "prefixItems"):
            if key in node:
                if not isinstance(node[key], list) or not node[key]:
                    raise UnsupportedConstraintError(key, "must be a non-empty list")
                stack.extend((s, False) for s in node[key])


def _oc_schema_regex(schema: Any) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    schema = prepare_schema(schema, bound_literals=False, formats=OC_FORMATS)  # it enforces no numeric bounds
    check_outlines_schema(schema)
    try:
        return "(?:" + build_regex_from_schema(canonical_json(schema), "") + ")"
    except Exception as e:  # its own "Unsupported JSON Schema structure" errors
        raise UnsupportedConstraintError("schema", f"outlines-core: {str(e).splitlines()[0][:300]}") from None


def outlines_regex(spec: ConstraintSpec) -> str:
    """The regex outlines-core compiles for ``spec`` (no tokenizer needed); raises for refused features."""
    if spec.kind in ("json_schema", "json_object"):
        return _oc_schema_regex(spec.schema)
    if spec.kind == "regex":
        return spec.value
    if spec.kind == "choice":
        return "(?:" + "|".join(regex_literal(o) for o in spec.options) + ")"
    calls = []
    for fn in spec.functions:
        params = fn["parameters"]
        if isinstance(params, dict) and "type" not in params:
            params = {**params, "type": "object"}
        try:
            args = _oc_schema_regex(params)
        except UnsupportedConstraintError as e:
            raise UnsupportedConstraintError(e.feature, f"parameters of {fn['name']!r}: {e.detail}") from None
        calls.append(regex_literal(call_head(fn["name"])) + args + r"\x7D")
    one = "(?:" + "|".join(calls) + ")"
    more = MAX_PARALLEL_CALLS - 1 if spec.parallel else 0
    call = f"{one}(?:{regex_literal(TOOL_CALL_MARKER)}{one}){{0,{more}}}" if more else one
    marker = regex_literal(TOOL_CALL_MARKER)
    if spec.tool_mode == "auto" and spec.answer_schema is not None:
        return f"(?:{_oc_schema_regex(spec.answer_schema)}|{marker}{call})"
    if spec.tool_mode == "auto":  # text, then the marker and calls wherever the model writes them
        return f"(?:{not_containing_regex(TOOL_CALL_MARKER)}(?:{marker}{call})?)"
    return call


def outlines_vocabulary(tokenizer: Tokenizer) -> Any:
    """outlines-core Vocabulary from raw token bytes; control tokens left out (EOS is its own entry)."""
    from outlines_core import Vocabulary

    with _vocab_lock:
        if tokenizer not in _oc_vocabularies:
            groups: dict[bytes, list[int]] = {}
            special = tokenizer.special_ids
            for i in range(tokenizer.vocab_size):
                if i not in special:
                    groups.setdefault(tokenizer.token_bytes(i), []).append(i)
            _oc_vocabularies[tokenizer] = Vocabulary(tokenizer.eos_id, groups)
        return _oc_vocabularies[tokenizer]


class OutlinesCoreBackend(Backend):
    """Regex-only backend: an Index (a token-level DFA) per grammar, ~1-20 s each on 262k tokens."""

    name = "outlines-core"

    def warm_up(self) -> None:
        outlines_vocabulary(self.tokenizer)

    def compile(self, spec: ConstraintSpec) -> Any:
        from outlines_core import Index

        regex = outlines_regex(spec)
        if len(regex) > OUTLINES_MAX_REGEX:
            # Index construction cannot be interrupted and grows steeply with the regex: a 6 kB one
            # (any JSON object) takes minutes on 262k tokens. Refuse rather than tie up a worker.
            raise UnsupportedConstraintError("grammar too complex", f"{len(regex)}-character regex (outlines-core)")
        try:
            return Index(regex, outlines_vocabulary(self.tokenizer))
        except Exception as e:
            feature = "regex" if spec.kind == "regex" else "grammar"
            raise UnsupportedConstraintError(feature, f"outlines-core: {str(e).splitlines()[0][:300]}") from None

    def matcher(self, handle: Any) -> GrammarMatcher:
        return OutlinesMatcher(handle, self.stop_ids, self.vocab_size)
