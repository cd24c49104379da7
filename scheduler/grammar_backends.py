"""Shared pieces of the grammar backends: the per-request matcher interface, the backend interface,
and schema normalization.

Backends (`scheduler.grammar_llguidance`, the default, and `scheduler.grammar_outlines`) work on the
model's raw token bytes (`Tokenizer.token_bytes`: "▁" is a space, "<0xNN>" the byte NN), so a
multi-byte character split over byte-fallback tokens is matched byte by byte, and control tokens never
match text. Stop tokens (EOS, <end_of_turn>) are allowed exactly where the grammar accepts. JSON is
compact (no whitespace at all), which also keeps small models from looping on whitespace.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from core.tokenizer import Tokenizer
from scheduler.grammar_spec import ConstraintSpec, UnsupportedConstraintError
from scheduler.json_keys import KeyTracker
from scheduler.schema_rewrite import rewrite
from scheduler.schema_walk import admits_undeclared_keys, iter_subschemas
from scheduler.strict_schema import tighten, wants_strict
from scheduler.unique_items import lift

__all__ = ["Backend", "GrammarMatcher", "iter_subschemas", "mask_words", "prepare_schema", "repeats_possible"]


def mask_words(vocab_size: int) -> int:
    """32-bit words per bitmask row."""
    return (vocab_size + 31) // 32


class GrammarMatcher(ABC):
    """One request's position in its grammar. Not thread-safe: drive it from the engine thread. ``keys``
    follows the JSON the grammar produces to keep its objects' keys unique (`scheduler.json_keys`; None for
    grammars of no JSON, set by `GrammarCompiler.matcher`)."""

    stop_ids: frozenset[int]
    vocab_size: int
    keys: KeyTracker | None = None

    @abstractmethod
    def consume(self, token: int) -> bool:
        """Advance by one sampled token. False if it was not allowed; the matcher is then in error."""

    def consume_tokens(self, tokens: list[int]) -> bool:
        """Advance by several tokens (e.g. forced ones); False at the first one not allowed."""
        return all(self.consume(t) for t in tokens)

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, to append without sampling (may be empty)."""

    @abstractmethod
    def is_accepting(self) -> bool:
        """The output so far is complete: a stop token is allowed now."""

    @abstractmethod
    def is_finished(self) -> bool:
        """Nothing but a stop token can follow (also true after a stop token or an error)."""

    @property
    @abstractmethod
    def error(self) -> str | None:
        """Why the matcher stopped on a bad token or a backend limit; None while healthy."""

    def closing_path(self, limit: int) -> list[int] | None:
        """Tokens that take the output from here to its end (a stop token last unless the grammar ends by
        itself), at most ``limit`` of them; None when the backend cannot tell or none was found. The matcher
        itself does not move. A backend without it never closes a document early (scheduler.budget_close)."""
        return None


class Backend(ABC):
    name: str

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.stop_ids = frozenset(tokenizer.stop_ids)

    @abstractmethod
    def warm_up(self) -> None:
        """Build the tokenizer bridge now (it is otherwise built by the first compile)."""

    @abstractmethod
    def compile(self, spec: ConstraintSpec) -> Any:
        """A reusable compiled handle; raises UnsupportedConstraintError."""

    @abstractmethod
    def matcher(self, handle: Any) -> GrammarMatcher: ...


_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties", "minContains",
           "maxContains")  # fmt: skip


def prepare_schema(schema: Any, bound_literals: bool = True, formats: frozenset[str] | None = None,
                   lift_unique: bool = False) -> dict[str, Any]:
    """Normalize a schema before handing it to a backend (``schema`` is a private copy, mutated): rewritten
    exactly by `schema_rewrite.rewrite`, then narrowed by `strict_schema.tighten` (``bound_literals``:
    numbers and second fractions too). ``formats``: the formats the backend asserts; any other is an annotation
    (as in draft 2020-12) and dropped, so its strings are plain strings. ``lift_unique``: the `uniqueItems` the
    host enforces (`scheduler.unique_items`) are left out of the grammar."""
    if schema is True:
        return {}
    if schema is False:
        raise UnsupportedConstraintError("unsatisfiable schema", "the schema is `false`: no output is valid")
    if not isinstance(schema, dict):
        raise UnsupportedConstraintError("schema", "a JSON schema must be an object or a boolean")
    # Backend options ride in "x-guidance"; the user does not get to turn on lenient mode or whitespace.
    schema.pop("x-guidance", None)
    strict = wants_strict(schema)
    # Rewrites first: their proofs (disjoint oneOf branches, what a closed object forbids) must hold for the
    # schema as written; the narrowing then applies to the rewritten branches too.
    rewrite(schema)
    if lift_unique:
        lift(schema)
    if strict:
        tighten(schema, numbers=bound_literals)
    for sub in iter_subschemas(schema):
        if formats is not None and isinstance(sub.get("format"), str) and sub["format"] not in formats:
            del sub["format"]
        for key in _COUNTS:  # 2020-12: 2.0 is an integer; llguidance wants 2
            if isinstance(sub.get(key), float) and sub[key].is_integer():
                sub[key] = int(sub[key])
        # llguidance does not make keys matched by additionalProperties/patternProperties unique, so
        # {"a":1,"a":2} would pass minProperties=2 yet parse (last key wins) to one property.
        open_keys = sub.get("additionalProperties") is not False or sub.get("patternProperties")
        if isinstance(sub.get("minProperties"), int | float) and sub["minProperties"] >= 2 and open_keys:
            raise UnsupportedConstraintError(
                "minProperties", ">= 2 with additional or pattern properties (duplicate keys not excluded)"
            )
    return schema


def repeats_possible(spec: ConstraintSpec) -> bool:
    """Whether a document of ``spec`` could repeat a key or a unique item, so the host's tracker must check
    (`scheduler.json_keys`): some object admits keys it does not declare, or the host enforces a unique array.
    Judged on the schema as the grammar gets it (closed objects after the strict narrowing); tool calls and
    json_object always check."""
    if spec.kind in ("json_object", "tools"):
        return True
    if spec.kind != "json_schema":
        return False
    try:
        schema = prepare_schema(spec.schema, lift_unique=True)
    except UnsupportedConstraintError:
        return True
    if '"uniqueItems"' in spec.value:
        return True
    return any(admits_undeclared_keys(node) for node in iter_subschemas(schema))
