"""String items under a `pattern` or an asserted `format` in a unique array: what they can still become, asked
of llguidance itself (docs/structured-output.md, "Unique items").

The language of such an item is the grammar engine's (its reading of the regex, its grammars for `date`,
`email`, `uri`...), which no restatement of ours could match exactly, so the look-ahead is llguidance: for the
values the array already holds, the item's string schema is compiled with one more pattern, every string but
those values (an `allOf`, which llguidance intersects), and an item's bytes so far are dead exactly when that
grammar refuses them. Each such grammar is built twice: over single bytes, for a prefix the host's lexer asks
about (`PatternItems.dead`), and over the model's tokenizer, whose mask where the item stands keeps, in one
call, the tokens that certainly leave a new value reachable (`PatternItems.mask`; `scheduler.json_keys` checks
only the others against the byte grammar).

Values longer than `MAX_EXCLUDED_CHARS` are not written into the excluding pattern (its nesting grows with
their length): the closing quote on one is still removed (the tracker compares every closing exactly), only
the look-ahead does not see them, so a pattern that admits just such long values may end a request with an
error, never with a repeated item.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from scheduler.grammar_scalars import GrammarScalars, UsedScalar, only_used_ahead
from scheduler.schema_rewrite import all_strings_but

STRING_KEYWORDS = ("pattern", "format", "minLength", "maxLength")
MAX_EXCLUDED_CHARS = 64  # longer used values stay out of the excluding pattern (see the module docstring)
MAX_GRAMMARS = 64  # compiled (item, used values) grammars kept per language, least recently used dropped
MAX_SCALAR_ANSWERS = 4096  # (item, used values, bytes) -> dead answers kept for `GrammarScalars`
END_BYTE_TOKEN = 256  # the byte tokenizer's one special token


class _ByteVocabulary:
    """What llguidance's TokenizerWrapper reads for a tokenizer whose tokens are the 256 single bytes."""

    eos_token_id = END_BYTE_TOKEN
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<end>"]
    special_token_ids = [END_BYTE_TOKEN]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


_byte_tokenizer: LLTokenizer | None = None
_byte_lock = threading.Lock()


def byte_tokenizer() -> LLTokenizer:
    global _byte_tokenizer
    with _byte_lock:
        if _byte_tokenizer is None:
            _byte_tokenizer = LLTokenizer(TokenizerWrapper(_ByteVocabulary()))
        return _byte_tokenizer


@dataclass(frozen=True)
class PatternItems:
    """String items whose values are a pattern's or a format's (`schema`: the item's string schema as the
    grammar has it, JSON text)."""

    schema: str
    language: PatternLanguage = field(compare=False, repr=False)
    values = None  # not an enum
    max_length = None  # the language decides where an item must close

    def dead(self, written: bytes, used: Collection[Any]) -> bool:
        """Whether the item whose bytes so far are ``written`` (its opening quote included) can only become
        values in ``used`` (or none at all)."""
        return not self.language.viable(self.schema, _strings(used), written)

    def exhausted(self, used: Collection[Any]) -> bool:
        return self.dead(b'"', used)

    def mask(self, written: bytes, used: Collection[Any]) -> np.ndarray:
        """Bitmask words [ceil(V/32)] of model tokens each of which keeps the item able to become a value not in
        ``used``. Not all of them: where the grammar forces its next bytes llguidance allows only some of the
        tokens that spell them, and a token that goes past the closing quote ends this grammar."""
        return self.language.mask(self.schema, _strings(used), written)


def _strings(used: Collection[Any]) -> frozenset[str]:
    return frozenset(v for v in used if isinstance(v, str) and len(v) <= MAX_EXCLUDED_CHARS)


class PatternLanguage:
    """llguidance's answers about unique-array items whose language only it knows, for one model tokenizer:
    pattern and format strings, composed items, numbers on a fractional grid (`scheduler.grammar_scalars`).
    ``prepare`` turns an item schema into what the backend's grammar compiles (formats it asserts, strict
    narrowing)."""

    def __init__(self, tokenizer: LLTokenizer, prepare: Callable[[dict[str, Any]], dict[str, Any]],
                 options: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self._prepare = prepare
        self._options = options
        self._lock = threading.Lock()
        self._byte_matchers: OrderedDict[tuple[str, frozenset[str]], LLMatcher] = OrderedDict()
        # (schema, used) -> a matcher over the model's tokens in its start state, one advanced over some item
        # bytes, and those bytes
        self._token_matchers: OrderedDict[tuple[str, frozenset[str]],
                                          tuple[LLMatcher, LLMatcher, bytes]] = OrderedDict()
        self._scalar_answers: OrderedDict[tuple[str, frozenset[UsedScalar], bytes], bool | None] = OrderedDict()

    def strings(self, node: dict[str, Any], strict: bool = True) -> PatternItems | None:
        """The string part of a unique array's items under ``node``: PatternItems where a pattern or an
        asserted format is left, else None (plain strings: `item_space` follows them itself); raises
        ValueError when the grammar engine refuses the item schema."""
        schema: dict[str, Any] = {"type": "string", **{k: node[k] for k in STRING_KEYWORDS if k in node}}
        prepared = self._prepared(schema, strict)
        if "pattern" not in prepared and "format" not in prepared:
            return None
        return PatternItems(self._checked(prepared), self)

    def composed_strings(self, node: dict[str, Any], strict: bool = True) -> PatternItems:
        """String items under a composed schema (an `allOf`, its `$ref`s inlined): the language is the whole
        schema's. Raises ValueError when the grammar engine refuses it."""
        return PatternItems(self._checked(self._prepared(node, strict)), self)

    def scalars(self, node: dict[str, Any], strict: bool = True) -> GrammarScalars:
        """Number and literal items the item-space counts do not follow (`scheduler.grammar_scalars`). Raises
        ValueError when the grammar engine refuses the item schema."""
        return GrammarScalars(self._checked(self._prepared(node, strict)), self)

    def _prepared(self, schema: dict[str, Any], strict: bool) -> dict[str, Any]:
        schema = copy.deepcopy(schema)
        if not strict:
            schema["x-slotserve"] = {"strict": False}
        return self._prepare(schema)

    def _checked(self, prepared: dict[str, Any]) -> str:
        text = json.dumps(prepared, sort_keys=True)
        with self._lock:
            if self._byte_matcher(text, frozenset()).is_error():
                raise ValueError(f"item schema refused: {text}")
        return text

    def scalar_dead(self, schema: str, used: frozenset[UsedScalar], written: bytes) -> bool | None:
        """`GrammarScalars.dead`: None where the grammar refuses ``written``; answers are kept (LRU)."""
        key = (schema, used, written)
        with self._lock:
            if key in self._scalar_answers:
                self._scalar_answers.move_to_end(key)
                return self._scalar_answers[key]
            matcher = self._byte_matcher(schema, frozenset()).deep_copy()
        if matcher.validate_tokens(list(written)) != len(written):
            answer = None
        else:
            matcher.consume_tokens(list(written))
            answer = only_used_ahead(matcher, written, used)
        with self._lock:
            self._scalar_answers[key] = answer
            while len(self._scalar_answers) > MAX_SCALAR_ANSWERS:
                self._scalar_answers.popitem(last=False)
        return answer

    def viable(self, schema: str, used: frozenset[str], written: bytes) -> bool:
        with self._lock:  # a matcher serves one thread at a time
            matcher = self._byte_matcher(schema, used)
            return not matcher.is_error() and matcher.validate_tokens(list(written)) == len(written)

    def mask(self, schema: str, used: frozenset[str], written: bytes) -> np.ndarray:
        words = (self.tokenizer.vocab_size + 31) // 32
        with self._lock:
            key = (schema, used)
            entry = self._token_matchers.pop(key, None)
            if entry is None:
                start = LLMatcher(self.tokenizer, self._grammar(schema, used), log_level=0)
                entry = (start, start.deep_copy(), b"")
            start, matcher, fed = entry
            if not written.startswith(fed):  # another item, or the same one rolled back: from the start again
                matcher, fed = start.deep_copy(), b""
            if written != fed and not matcher.is_error():
                matcher.consume_tokens(self.tokenizer.tokenize_bytes(written[len(fed):]))
            self._token_matchers[key] = (start, matcher, written)
            while len(self._token_matchers) > MAX_GRAMMARS:
                self._token_matchers.popitem(last=False)
            if matcher.is_error():
                return np.zeros(words, np.uint32)
            return np.frombuffer(matcher.compute_bitmask(), np.uint32)[:words].copy()

    def _byte_matcher(self, schema: str, used: frozenset[str]) -> LLMatcher:
        """The byte-level matcher of (schema, used) in its start state; call with the lock held."""
        key = (schema, used)
        matcher = self._byte_matchers.pop(key, None)
        if matcher is None:
            matcher = LLMatcher(byte_tokenizer(), self._grammar(schema, used), log_level=0)
        self._byte_matchers[key] = matcher
        while len(self._byte_matchers) > MAX_GRAMMARS:
            self._byte_matchers.popitem(last=False)
        return matcher

    def _grammar(self, schema: str, used: frozenset[str]) -> str:
        item = json.loads(schema)
        if used:  # beside any allOf the item has (a composed one)
            item["allOf"] = [*item.get("allOf", []), {"pattern": f"^{all_strings_but(sorted(used))}$"}]
        return LLMatcher.grammar_from_json_schema(json.dumps(item), overrides=self._options)  # type: ignore[arg-type]
