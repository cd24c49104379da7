"""llguidance backend: exact JSON schema / regex / lark grammars, masks in parallel without the GIL."""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer
from llguidance.numpy import fill_next_token_bitmask_par

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
from scheduler.pattern_items import PatternLanguage
from scheduler.tool_protocol import TOOL_CALL_MARKER, call_head

__all__ = ["LLGuidanceBackend", "LLGuidanceMatcher", "fill_llguidance_masks", "llguidance_tokenizer"]


# The order in which a closing path tries one-character tokens outside a string: close an object or array, then
# the shortest values (other digits where a unique array already holds 0), the separators, then any other
# character (a key's name; a regex's text).
STRUCTURE_ORDER = '}]0"[{,:tfn123456789'
# Inside a string: the closing quote, else content, letters and digits before punctuation (a pattern is more
# often about word characters); content is taken round-robin (`Closers.content`), so a pattern that wants a
# character the string lacks gets it after at most one pass over the alphabet.
CONTENT_ORDER = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


LONGEST_RUN = 8  # a closing path takes one token at most this many times in a row, so it cannot spin in content


@dataclass(frozen=True)
class Closers:
    """One-character token ids a closing path tries: `structure` outside strings, `quote` then `content`
    (rotated per step) inside one."""

    structure: tuple[int, ...]
    quote: int | None
    content: tuple[int, ...]


def closing_candidates(tokenizer: Tokenizer) -> Closers:
    """The one-character tokens of printable ASCII, in the orders `Closers` describes."""
    def ids(chars: str) -> tuple[int, ...]:
        pieces = [tokenizer.encode(c, parse_special=False) for c in dict.fromkeys(chars)]  # each char once
        return tuple(p[0] for p in pieces if len(p) == 1)

    printable = "".join(chr(c) for c in range(32, 127))
    rest = "".join(c for c in printable if c not in STRUCTURE_ORDER + CONTENT_ORDER)
    quote = ids('"')
    return Closers(ids(STRUCTURE_ORDER + CONTENT_ORDER + rest), quote[0] if quote else None,
                   ids(CONTENT_ORDER + "".join(c for c in rest + STRUCTURE_ORDER if c != '"')))


class LLGuidanceMatcher(GrammarMatcher):
    """A thin shell over an LLMatcher (a deep copy of the compiled template); stop ids are its EOS set;
    `closers`: `closing_candidates` of the tokenizer."""

    __slots__ = ("_m", "closers", "keys", "stop_ids", "vocab_size")

    def __init__(self, matcher: LLMatcher, stop_ids: frozenset[int], vocab_size: int,
                 closers: Closers | None = None) -> None:
        self._m = matcher
        self.stop_ids = stop_ids
        self.vocab_size = vocab_size
        self.closers = closers
        self.keys = None

    def consume(self, token: int) -> bool:
        return self._m.consume_token(int(token))

    def consume_tokens(self, tokens: list[int]) -> bool:
        return self._m.consume_tokens([int(t) for t in tokens])

    def forced_tokens(self) -> list[int]:
        if self._m.is_stopped():
            return []
        return self._m.compute_ff_tokens()

    def is_accepting(self) -> bool:
        return not self._m.is_error() and self._m.is_accepting()

    def is_finished(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None

    def closing_path(self, limit: int) -> list[int] | None:
        """Greedy on a copy of the matcher: the tokens the grammar forces, else the first one-character token
        it allows (`Closers`: closing quote or content inside a JSON string, closing brackets and short values
        outside) that closes no key on a used one (`keys`, whose lexer also says where strings are); a stop
        token once the output is complete. Every step is one the grammar allows, so the path is a valid ending
        whenever it is found, not always the shortest one."""
        if self.closers is None:
            return None
        m, path, closers = self._m.deep_copy(), [], self.closers
        lexer = self.keys.path_lexer() if self.keys is not None else None  # strings, and no key repeated
        token_bytes = self.keys.quotes.token_bytes if self.keys is not None else None
        while len(path) < limit:
            if m.is_error():
                return None
            if m.is_stopped():
                return path
            if m.is_accepting():
                stop = next((t for t in sorted(self.stop_ids) if m.validate_tokens([t]) == 1), None)
                return None if stop is None else [*path, stop]
            if lexer is not None and lexer.in_string:
                turn = len(path) % len(closers.content)
                order = (closers.quote, *closers.content[turn:], *closers.content[:turn])
            else:
                order = closers.structure
            run = path[-LONGEST_RUN:]
            stuck = run[0] if len(run) == LONGEST_RUN and len(set(run)) == 1 else None  # e.g. "0000..." content
            step = m.compute_ff_tokens() or next(
                ([t] for t in order if t is not None and t != stuck and m.validate_tokens([t]) == 1
                 and (lexer is None or not lexer.fork().repeats_in(token_bytes(t)))), None)
            if step is None or not m.consume_tokens(step):
                return None
            if lexer is not None:
                lexer.repeats_in(b"".join(token_bytes(t) for t in step))
            path += step
        return None


_bridge_lock = threading.Lock()
_llg_tokenizers: weakref.WeakKeyDictionary[Tokenizer, dict[int, LLTokenizer]] = weakref.WeakKeyDictionary()

# Compact JSON, exact semantics. Applied as overrides, so nothing in the schema can change them.
_JSON_OPTIONS: dict[str, Any] = {
    "item_separator": ",",
    "key_separator": ":",
    "whitespace_flexible": False,
    "coerce_one_of": False,
    "lenient": False,
}
# Ten times the default lexer fuel for building regexes (~200 ms at worst): with the default a
# pattern like ^(?:\S+\s+){0,49}\S+$ under maxLength ran out mid-generation and rejected valid text.
_LIMITS = {"initial_lexer_fuel": 10_000_000, "verbose_errors": False}


class _LLGTokenizerSource:
    """What llguidance.TokenizerWrapper reads: raw bytes per id, special ids, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int) -> None:
        special = tokenizer.special_ids
        # Special tokens keep their names; llguidance marks them (0xFF prefix) so text never matches them.
        self.tokens = [
            tokenizer.id_to_token(i).encode() if i in special else tokenizer.token_bytes(i)
            for i in range(tokenizer.vocab_size)
        ]
        # Logit ids past the tokenizer's vocabulary (a padded embedding) become never-allowed specials.
        padding = range(tokenizer.vocab_size, n_vocab)
        self.tokens += [f"<slotserve_pad_{i}>".encode() for i in padding]
        self.special_token_ids = sorted(special) + list(padding)
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self._tok = weakref.ref(tokenizer)  # the cache is keyed weakly by the tokenizer: do not pin it
        self._byte_ids = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256)]

    def __call__(self, text: bytes | str) -> list[int]:
        tok = self._tok()
        if tok is None:
            raise RuntimeError("tokenizer was garbage-collected")
        if isinstance(text, str):
            return tok.encode(text)
        try:
            return tok.encode(text.decode("utf-8"))
        except UnicodeDecodeError as e:  # a partial character at the end: byte-fallback ids for it
            return tok.encode(text[: e.start].decode("utf-8")) + [self._byte_ids[b] for b in text[e.start :]]


def llguidance_tokenizer(tokenizer: Tokenizer, vocab_size: int | None = None) -> LLTokenizer:
    """The llguidance view of ``tokenizer`` (seconds to build for 262k tokens; built once per process)."""
    n_vocab = vocab_size or tokenizer.vocab_size
    with _bridge_lock:
        per_size = _llg_tokenizers.setdefault(tokenizer, {})
        if n_vocab not in per_size:
            wrapper = llguidance.TokenizerWrapper(_LLGTokenizerSource(tokenizer, n_vocab))
            per_size[n_vocab] = LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=sorted(tokenizer.stop_ids))
        return per_size[n_vocab]


# The string formats llguidance asserts; any other is an annotation (draft 2020-12) and generated as a plain string.
ASSERTED_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                              "uuid"})


def _llg_json(schema: Any) -> dict[str, Any]:
    # In lark's %json the options must ride in the schema: overrides do not reach there.
    return {**prepare_schema(schema, formats=ASSERTED_FORMATS, lift_unique=True), "x-guidance": _JSON_OPTIONS}


def _tools_lark(spec: ConstraintSpec) -> str:
    answer, marker = spec.answer_schema, json.dumps(TOOL_CALL_MARKER)
    if spec.tool_mode != "auto":
        lines = ["start: calls"]
    elif answer is not None:  # a typed answer, or calls
        lines = [f"start: answer | {marker} calls"]
    else:  # text; or text up to the call marker (a lazy lexeme ending at it), then calls
        lines = ["start: TEXT | pre calls", f"pre[stop={marker}]: /(?s:.*)/"]
    count = MAX_PARALLEL_CALLS if spec.parallel else 1  # calls: call (marker call)*, written out to its bound
    lines.append("calls: " + " | ".join(" ".join(["call"] + [f"{marker} call"] * n) for n in range(count)))
    functions = spec.functions
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    for i, fn in enumerate(functions):
        params = fn["parameters"]
        if isinstance(params, dict) and "type" not in params:
            params = {**params, "type": "object"}  # arguments are always an object
        prefix = json.dumps(call_head(fn["name"]))
        try:
            args = canonical_json(_llg_json(params))
        except UnsupportedConstraintError as e:
            raise UnsupportedConstraintError(e.feature, f"parameters of {fn['name']!r}: {e.detail}") from None
        lines.append(f'call_{i}: {prefix} args_{i} "}}"')
        lines.append(f"args_{i}: %json {args}")
    if spec.tool_mode == "auto" and answer is not None:
        try:
            lines.append(f"answer: %json {canonical_json(_llg_json(answer))}")
        except UnsupportedConstraintError as e:
            raise UnsupportedConstraintError(e.feature, f"response_format: {e.detail}") from None
    elif spec.tool_mode == "auto":
        lines.append(f"TEXT: /{not_containing_regex(TOOL_CALL_MARKER)}/")
    return "\n".join(lines) + "\n"


def llguidance_grammar(spec: ConstraintSpec) -> str:
    """The llguidance grammar (JSON text) for ``spec``; validity is checked when a matcher is built."""
    if spec.kind in ("json_schema", "json_object"):
        schema = prepare_schema(spec.schema, formats=ASSERTED_FORMATS, lift_unique=spec.kind == "json_schema")
        return LLMatcher.grammar_from_json_schema(canonical_json(schema), overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(regex_literal(o) for o in spec.options))
    return LLMatcher.grammar_from_lark(_tools_lark(spec))


# llguidance error text -> the feature we name.
_LLG_FEATURES: list[tuple[re.Pattern[str], Any]] = [
    (re.compile(r"Unimplemented keys: \[(.*?)\]"), lambda m: ", ".join(json.loads(f"[{m[1]}]"))),
    (re.compile(r"Unknown format: (.*)"), lambda m: f"format: {m[1]}"),
    (re.compile(r"oneOf constraints are not supported"), lambda m: "oneOf (branches not provably exclusive)"),
    (re.compile(r"Resource '([^']*)' is not present"), lambda m: "remote $ref"),
    (re.compile(r"Unsatisfiable schema: (.*)"), lambda m: "unsatisfiable schema"),
    (re.compile(r"patternProperty regexes .* are not disjoint"), lambda m: "patternProperties (overlapping)"),
    (re.compile(r"Expected positive integer for '(\w+)'"), lambda m: m[1]),
    (re.compile(r"Value for '(\w+)' has too many digits"), lambda m: f"{m[1]} (too many digits)"),
    (re.compile(r"(?i)look-?around|look-?ahead|look-?behind"), lambda m: "regex lookaround"),
    (re.compile(r"(?i)backreferences?"), lambda m: "regex backreference"),
    (re.compile(r"too big \(limit for this grammar"), lambda m: "grammar too complex"),
]


def llguidance_error(spec: ConstraintSpec, message: str) -> UnsupportedConstraintError:
    """Our error for an llguidance compile error, naming the feature it refused."""
    lines = [line.strip() for line in message.strip().splitlines()] or ["unknown error"]
    # Regex syntax errors put the reason on an "error: ..." line after a caret diagram; match on that
    # line, not on text that quotes the user's pattern.
    reason = next((line[len("error: ") :] for line in lines if line.startswith("error: ")), None)
    key = reason or lines[0]
    detail = f"{lines[0]} {reason}" if reason else lines[0]
    for pattern, feature in _LLG_FEATURES:
        m = pattern.search(key)
        if m:
            return UnsupportedConstraintError(feature(m), detail[:300])
    default = {"regex": "regex", "choice": "choice", "tools": "tools"}.get(spec.kind, "schema")
    return UnsupportedConstraintError(default, detail[:300])


class LLGuidanceBackend(Backend):
    name = "llguidance"
    _closers: Closers | None = None  # closing_candidates, made on the first matcher
    _patterns: PatternLanguage | None = None  # made on first use

    def pattern_language(self) -> PatternLanguage:
        """What pattern and format items of unique arrays can become, asked of llguidance (one per backend)."""
        if self._patterns is None:
            self._patterns = PatternLanguage(llguidance_tokenizer(self.tokenizer, self.vocab_size),
                                             lambda schema: prepare_schema(schema, formats=ASSERTED_FORMATS),
                                             _JSON_OPTIONS)
        return self._patterns

    def warm_up(self) -> None:
        llguidance_tokenizer(self.tokenizer, self.vocab_size)

    def compile(self, spec: ConstraintSpec) -> LLMatcher:
        grammar = llguidance_grammar(spec)
        # Building the matcher is the compile (lexer, parser tables); it releases the GIL. The result
        # is a template that `matcher` deep-copies per request.
        template = LLMatcher(
            llguidance_tokenizer(self.tokenizer, self.vocab_size), grammar, log_level=0,
            limits=LLParserLimits(**_LIMITS),
        )  # fmt: skip
        if template.is_error():
            error = llguidance_error(spec, template.get_error())
            if spec.kind == "tools":  # say which function's parameters were refused
                error = self._tools_error(spec) or error
            raise error
        return template

    def _tools_error(self, spec: ConstraintSpec) -> UnsupportedConstraintError | None:
        for fn in spec.functions:
            try:
                grammar = llguidance_grammar(ConstraintSpec.json_schema(fn["parameters"]))
            except UnsupportedConstraintError as e:
                return UnsupportedConstraintError(e.feature, f"parameters of {fn['name']!r}: {e.detail}")
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
            if is_error:
                e = llguidance_error(spec, messages[0])
                return UnsupportedConstraintError(e.feature, f"parameters of {fn['name']!r}: {e.detail}")
        return None

    def matcher(self, handle: LLMatcher) -> GrammarMatcher:
        if self._closers is None:
            self._closers = closing_candidates(self.tokenizer)
        return LLGuidanceMatcher(handle.deep_copy(), self.stop_ids, self.vocab_size, self._closers)


_executor: LLExecutor | None = None
_executor_lock = threading.Lock()


def fill_llguidance_masks(rows: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
    """Masks of llguidance matchers into rows of an int32 bitmask, in parallel on llguidance's pool."""
    global _executor
    if _executor is None:
        with _executor_lock:
            _executor = _executor or LLExecutor()
    fill_next_token_bitmask_par(_executor, [(m._m, row) for m, row in rows], bitmask)  # type: ignore[attr-defined]
