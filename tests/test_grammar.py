"""scheduler.grammar: per-slot constraints on the real Gemma 3 vocabulary (262k tokens).

One llguidance compiler is shared by the module (its tokenizer bridge takes a second or two); the
outlines-core test builds its Index over the full vocabulary and is marked slow.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from concurrent.futures import wait

import numpy as np
import pytest
from pydantic import BaseModel

from agents.tool_calls import parse_tool_calls
from scheduler.grammar import (
    CompiledGrammar,
    ConstraintSpec,
    GrammarCompiler,
    UnsupportedConstraintError,
    fill_masks,
    llguidance_tokenizer,
)
from scheduler.tool_protocol import TOOL_CALL_MARKER

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "label": {"type": "string"}},
    "required": ["x", "label"],
    "additionalProperties": False,
}


class Pet(BaseModel):
    name: str
    age: int
    tags: list[str] = []


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer)
    start = time.perf_counter()
    compiler.warm_up()
    print(f"\nllguidance tokenizer bridge: {time.perf_counter() - start:.2f} s")
    yield compiler
    compiler.close()


def run(compiler, spec, ids) -> tuple[bool, bool]:
    """(every token consumed, accepting at the end)."""
    matcher = compiler.matcher(compiler.compile(spec))
    ok = matcher.consume_tokens(list(ids))
    return ok, ok and matcher.is_accepting()


def accepts(compiler, tokenizer, spec, text: str) -> bool:
    return run(compiler, spec, tokenizer.encode(text))[1]


def mask_after(compiler, spec, prefix_ids) -> np.ndarray:
    """The allowed-token set (bool per id) after feeding ``prefix_ids``."""
    matcher = compiler.matcher(compiler.compile(spec))
    assert matcher.consume_tokens(list(prefix_ids))
    mask = np.zeros((1, (compiler.vocab_size + 31) // 32), np.uint32)
    fill_masks([(matcher, 0)], mask)
    return np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: compiler.vocab_size].astype(bool)


def byte_ids(tokenizer, text: str) -> list[int]:
    """``text`` spelled with byte-fallback tokens only (<0xNN> per UTF-8 byte)."""
    return [tokenizer.token_to_id(f"<0x{b:02X}>") for b in text.encode()]


# --------------------------------------------------------------------------------------------------
# the tokenizer bridge
# --------------------------------------------------------------------------------------------------


def test_bridge_is_exact_on_raw_token_bytes(compiler, tokenizer):
    bridge = llguidance_tokenizer(tokenizer)
    assert bridge is llguidance_tokenizer(tokenizer)  # built once per process and tokenizer
    assert bridge.vocab_size == tokenizer.vocab_size
    assert sorted(bridge.eos_tokens) == sorted(tokenizer.stop_ids)
    for i in range(0, tokenizer.vocab_size, 7):
        if i in tokenizer.special_ids:
            assert bridge.is_special_token(i)
        else:
            assert bridge.decode_bytes([i]) == tokenizer.token_bytes(i), i
    assert bridge.decode_bytes([tokenizer.token_to_id("▁the")]) == b" the"
    assert bridge.decode_bytes([tokenizer.token_to_id("<0xE6>")]) == b"\xe6"


def test_padded_model_vocabulary(tokenizer, compiler):
    """Logit ids past the tokenizer's vocabulary (padded embeddings) are never allowed."""
    padded = GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size + 100)
    try:
        spec = ConstraintSpec.regex("[a-z ]+")
        matcher = padded.matcher(padded.compile(spec))
        mask = np.zeros((1, (padded.vocab_size + 31) // 32), np.uint32)
        fill_masks([(matcher, 0)], mask)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little").astype(bool)
        assert not bits[tokenizer.vocab_size :].any()
        assert (bits[: tokenizer.vocab_size] == mask_after(compiler, spec, [])).all()
        assert not matcher.consume(tokenizer.vocab_size + 5)
    finally:
        padded.close()


def test_a_schema_compiled_while_the_bridge_builds_in_the_background_waits_for_it(tokenizer, compiler):
    """The server builds the bridge after /ready: a constrained request meanwhile gets the same grammar."""
    later = GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size + 32)  # a size no bridge exists for yet
    try:
        building = later.warm_up_in_background()
        spec = ConstraintSpec.regex("[a-z ]+")
        matcher = later.matcher(later.compile(spec))  # submitted while the bridge is (likely) still building
        assert building.result(timeout=60) is None
        mask = np.zeros((1, (later.vocab_size + 31) // 32), np.uint32)
        fill_masks([(matcher, 0)], mask)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little").astype(bool)
        assert (bits[: tokenizer.vocab_size] == mask_after(compiler, spec, [])).all()
    finally:
        later.close()


def test_a_bridge_held_back_until_quiet_is_built_by_a_compile_that_needs_it_or_never(tokenizer, compiler):
    """The server holds the bridge back while it serves: a constrained request meanwhile builds it itself
    (the same grammar); a server stopping first never builds it."""
    gate = threading.Event()
    later = GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size + 33)  # a size no bridge exists for yet
    try:
        building = later.warm_up_in_background(lambda: gate.wait(60))
        spec = ConstraintSpec.regex("[a-z ]+")
        matcher = later.matcher(later.compile(spec))
        assert not building.done()  # still held back: the compile built what it needed
        mask = np.zeros((1, (later.vocab_size + 31) // 32), np.uint32)
        fill_masks([(matcher, 0)], mask)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little").astype(bool)
        assert (bits[: tokenizer.vocab_size] == mask_after(compiler, spec, [])).all()
        gate.set()
        assert building.result(timeout=60) is None
    finally:
        later.close()
    never = GrammarCompiler(tokenizer, vocab_size=tokenizer.vocab_size + 34)
    try:
        given_up = never.warm_up_in_background(lambda: False)
        wait([given_up], timeout=10)
        assert given_up.cancelled()
    finally:
        never.close()


# --------------------------------------------------------------------------------------------------
# kinds and masks
# --------------------------------------------------------------------------------------------------


def test_every_kind_compiles(compiler):
    specs = [
        ConstraintSpec.json_schema(POINT),
        ConstraintSpec.json_schema(Pet),
        ConstraintSpec.json_schema(True),
        ConstraintSpec.json_object(),
        ConstraintSpec.regex(r"\d{3}-[a-z]+"),
        ConstraintSpec.choice(["yes", "no"]),
        ConstraintSpec.tools([WEATHER, ADD], "auto"),
        ConstraintSpec.tools([WEATHER, ADD], "required"),
        ConstraintSpec.tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}),
    ]
    for spec in specs:
        compiled = compiler.compile(spec)
        assert isinstance(compiled, CompiledGrammar) and compiled.spec == spec and compiled.backend == "llguidance"
        assert compiler.matcher(compiled).error is None


def test_mask_is_exactly_what_the_grammar_allows(compiler, tokenizer):
    """Brute force: a token's bit is set iff a matcher at the same point accepts consuming it."""
    spec = ConstraintSpec.json_schema(POINT)
    prefix = tokenizer.encode('{"x":7,"label":"caf')
    allowed = mask_after(compiler, spec, prefix)
    rng = np.random.default_rng(0)
    candidates = set(np.flatnonzero(allowed)[:300].tolist()) | set(rng.integers(0, tokenizer.vocab_size, 700).tolist())
    candidates |= set(tokenizer.stop_ids) | {tokenizer.token_to_id(t) for t in ("<0xC3>", "<0xA9>", '"}', '"', "é")}
    candidates |= {tokenizer.token_to_id("<start_of_turn>"), tokenizer.bos_id, tokenizer.pad_id}
    for token in sorted(candidates):
        ok, _ = run(compiler, spec, [*prefix, token])
        assert ok == allowed[token], (token, tokenizer.token_bytes(token), allowed[token])
    assert allowed[tokenizer.token_to_id("<0xC3>")] and not allowed[tokenizer.token_to_id("<0xA9>")]
    assert not any(allowed[t] for t in tokenizer.stop_ids)  # not accepting mid-string
    assert not any(allowed[t] for t in tokenizer.special_ids)


def test_stop_tokens_only_where_accepting(compiler, tokenizer):
    spec = ConstraintSpec.regex("ab|abc")
    stops = sorted(tokenizer.stop_ids)
    assert not mask_after(compiler, spec, [])[stops].any()
    a, b, c = (tokenizer.token_to_id(x) for x in "abc")
    after_ab = mask_after(compiler, spec, [a, b])
    assert after_ab[stops].all() and after_ab[c]  # accepting, and may go on
    after_abc = mask_after(compiler, spec, [a, b, c])
    assert np.flatnonzero(after_abc).tolist() == stops  # finished: only a stop token
    matcher = compiler.matcher(compiler.compile(spec))
    assert not matcher.consume(stops[0]) and matcher.error  # EOS before the grammar accepts: refused
    for stop in stops:
        matcher = compiler.matcher(compiler.compile(spec))
        assert matcher.consume_tokens([a, b, c]) and matcher.is_finished() and matcher.is_accepting()
        assert matcher.consume(stop) and matcher.is_finished()


def test_choice_among_non_ascii_strings(compiler, tokenizer):
    spec = ConstraintSpec.choice(["café", "日本", "yes"])
    for option in ("café", "日本", "yes"):
        assert accepts(compiler, tokenizer, spec, option)
        assert run(compiler, spec, byte_ids(tokenizer, option))[1]  # every byte its own token
    # "é" split across tokens: "caf" then the two UTF-8 bytes as byte-fallback tokens
    assert run(compiler, spec, [*tokenizer.encode("caf"), *byte_ids(tokenizer, "é")])[1]
    assert run(compiler, spec, tokenizer.encode("caf")) == (True, False)
    for wrong in ("cafe", "日", "日本語", "Yes", " yes", ""):
        assert not accepts(compiler, tokenizer, spec, wrong), wrong


def test_regex(compiler, tokenizer):
    spec = ConstraintSpec.regex(r"\d{3}-[a-z]+")
    assert accepts(compiler, tokenizer, spec, "123-abc")
    for wrong in ("12-abc", "123-", "123-ABC", "1234-abc", "123-abc "):
        assert not accepts(compiler, tokenizer, spec, wrong), wrong


def test_json_escapes_and_non_ascii_round_trip(compiler, tokenizer):
    spec = ConstraintSpec.json_schema(
        {"type": "object", "properties": {"s": {"type": "string"}, "t": {"type": "array"}}, "required": ["s"]}
    )
    value = {"s": 'quote" back\\slash\nnew\ttab \u0001 café 日本 🦜 \u2028', "t": ["ß", {"ключ": "значение"}]}
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    assert accepts(compiler, tokenizer, spec, text)
    assert run(compiler, spec, byte_ids(tokenizer, text))[1]  # multi-byte characters split byte by byte
    # a tokenization mixing byte-fallback bytes for the emoji with ordinary tokens around it
    head, tail = text.split("🦜")
    assert run(compiler, spec, [*tokenizer.encode(head), *byte_ids(tokenizer, "🦜"), *tokenizer.encode(tail)])[1]
    assert json.loads(tokenizer.decode(tokenizer.encode(text))) == value
    assert "\\u0001" in text  # control characters are escaped; printable ones have one spelling: raw
    assert not accepts(compiler, tokenizer, spec, json.dumps(value, separators=(",", ":")))  # \u00e9 etc.
    for bad in ('{"s":"a\nb"}', '{"s":"\\x41"}', '{"s":"\\ud83e"}x'):  # raw control char, bad escape, trailing
        assert not accepts(compiler, tokenizer, spec, bad), bad


def test_whitespace_is_bounded(compiler, tokenizer):
    """Compact JSON only: no whitespace token is allowed between JSON tokens, so no whitespace loops."""
    whitespace = [i for i in range(tokenizer.vocab_size) if (b := tokenizer.token_bytes(i)) and not b.strip()]
    assert len(whitespace) > 20
    for spec in (ConstraintSpec.json_object(), ConstraintSpec.json_schema(POINT)):
        for prefix in ("{", '{"x":', '{"x":1,'):
            if prefix == '{"x":1,' and spec.kind == "json_object":
                continue
            allowed = mask_after(compiler, spec, tokenizer.encode(prefix))
            assert not allowed[whitespace].any(), (spec.kind, prefix)
    assert not accepts(compiler, tokenizer, ConstraintSpec.json_schema(POINT), '{"x": 1,"label":"a"}')
    assert not accepts(compiler, tokenizer, ConstraintSpec.json_object(), '{"a":1} ')
    assert not accepts(compiler, tokenizer, ConstraintSpec.json_object(), ' {"a":1}')


def test_schema_constraints_are_enforced(compiler, tokenizer):
    spec = ConstraintSpec.json_schema(POINT)
    assert accepts(compiler, tokenizer, spec, '{"x":9,"label":"ok"}')
    bad_points = ('{"x":10,"label":"no"}', '{"x":-1,"label":"no"}', '{"label":"no","x":1}', '{"x":1.5,"label":""}')
    for bad in (*bad_points, '{"x":1}'):
        assert not accepts(compiler, tokenizer, spec, bad), bad
    pet = ConstraintSpec.json_schema(Pet)
    assert accepts(compiler, tokenizer, pet, '{"name":"Rex","age":3,"tags":["good"]}')
    assert accepts(compiler, tokenizer, pet, '{"name":"Rex","age":3}')
    assert not accepts(compiler, tokenizer, pet, '{"name":"Rex","age":"3"}')


# --------------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "feature"),
    [
        (lambda: ConstraintSpec.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (lambda: ConstraintSpec.json_schema({"not": {"minLength": 3}}), "not"),  # no exact complement written
        (lambda: ConstraintSpec.json_schema({"$ref": "https://example.com/s.json"}), "remote $ref"),
        (lambda: ConstraintSpec.json_schema({"oneOf": [{"type": "integer"}, {"type": "number"}]}), "oneOf"),
        (lambda: ConstraintSpec.json_schema(False), "unsatisfiable schema"),
        # duplicate additional keys would satisfy minProperties textually but not once parsed
        (lambda: ConstraintSpec.json_schema({"type": "object", "minProperties": 2}), "minProperties"),
        (lambda: ConstraintSpec.regex("(a"), "regex"),
        (lambda: ConstraintSpec.regex(r"(?=a)a"), "regex"),
        (lambda: ConstraintSpec.tools([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}], "required"),
         "uniqueItems"),
    ],
)  # fmt: skip
def test_unsupported_features_are_refused_by_name(compiler, spec, feature):
    with pytest.raises(UnsupportedConstraintError) as info:
        compiler.compile(spec())
    assert info.value.feature.startswith(feature) and feature in str(info.value)
    assert isinstance(info.value, ValueError)


def test_tool_errors_name_the_function(compiler):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(UnsupportedConstraintError, match="parameters of 'f'"):
        compiler.compile(ConstraintSpec.tools([ADD, bad], "auto"))


def test_oversize_constraint_is_refused(tokenizer, compiler):
    small = GrammarCompiler(tokenizer, max_schema_bytes=1000)
    try:
        big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100)}}
        with pytest.raises(UnsupportedConstraintError) as info:
            small.compile(ConstraintSpec.json_schema(big))
        assert info.value.feature == "schema size"
        with pytest.raises(UnsupportedConstraintError, match="schema size"):
            small.compile(ConstraintSpec.choice([f"option {i}" for i in range(200)]))
    finally:
        small.close()


def test_slow_compile_is_refused_and_the_refusal_cached(tokenizer, compiler):
    slow = GrammarCompiler(tokenizer, compile_timeout_s=0.2)
    release = threading.Event()
    real = slow._backend.compile
    slow._backend.compile = lambda spec: (release.wait(5), real(spec))[1]  # type: ignore[method-assign]
    try:
        spec = ConstraintSpec.regex("slow")
        start = time.perf_counter()
        with pytest.raises(UnsupportedConstraintError) as info:
            slow.compile(spec)
        assert info.value.feature == "grammar too complex" and time.perf_counter() - start < 3
        with pytest.raises(UnsupportedConstraintError):
            slow.compile(spec)  # answered from the cache: no second compile is started
        assert slow.cache_info()["misses"] == 1
    finally:
        release.set()
        slow.close()


def test_a_flood_of_slow_schemas_is_refused_as_busy_with_bounded_work(tokenizer, compiler):
    """Two workers, four compiles at most in flight, every compile stuck: the first two run and are refused as
    too complex when their time is up; the next two wait their whole time for a worker and are refused as
    busy (not cached: a retry may succeed); a fifth distinct schema is refused as busy at once. Nothing queues
    without bound, and every answer comes within the timeout of its submission."""
    from scheduler.grammar_spec import GrammarBusyError

    slow = GrammarCompiler(tokenizer, compile_timeout_s=0.3, max_workers=2, max_pending=4)
    release = threading.Event()
    real = slow._backend.compile
    slow._backend.compile = lambda spec: (release.wait(10), real(spec))[1]  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        futures = [slow.compile_async(ConstraintSpec.regex(f"slow{i}")) for i in range(4)]
        with pytest.raises(GrammarBusyError):
            slow.compile_async(ConstraintSpec.regex("slow4")).result(timeout=0)
        errors = [f.exception(timeout=3) for f in futures]
        assert time.perf_counter() - start < 2
        assert [type(e).__name__ for e in errors] == ["UnsupportedConstraintError"] * 2 + ["GrammarBusyError"] * 2
        assert slow.cache_info()["size"] == 2  # only the verdicts on schemas that were compiled are kept
        release.set()
        deadline = time.perf_counter() + 10
        while slow._pending and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert slow._pending == 0
        assert slow.compile(ConstraintSpec.regex("slow3")).spec.value  # the busy one compiles on a retry
    finally:
        release.set()
        slow.close()


# --------------------------------------------------------------------------------------------------
# cache and async
# --------------------------------------------------------------------------------------------------


def test_compile_cache_hit(compiler):
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
    first = compiler.compile(ConstraintSpec.json_schema(schema))
    before = compiler.cache_info()
    start = time.perf_counter()
    again = compiler.compile(ConstraintSpec.json_schema(json.loads(json.dumps(schema)), strict=False))
    assert again is first and time.perf_counter() - start < 0.005
    assert compiler.cache_info()["hits"] == before["hits"] + 1
    # key order is part of the schema (it fixes generation order): a reordered schema is another entry
    reordered = {"required": ["k"], "properties": {"k": {"type": "boolean"}}, "type": "object"}
    assert compiler.compile(ConstraintSpec.json_schema(reordered)) is not first
    assert ConstraintSpec.json_schema(schema) == ConstraintSpec.json_schema(schema, strict=False)


def test_compile_async(compiler, tokenizer):
    specs = [ConstraintSpec.regex(f"async-{i}[0-9]+") for i in range(6)]
    futures = [compiler.compile_async(s) for s in specs]
    assert compiler.compile_async(specs[0]) is futures[0]  # in flight or done: shared
    for spec, future in zip(specs, futures, strict=True):
        compiled = future.result(timeout=30)
        assert compiled.spec == spec
    assert accepts(compiler, tokenizer, specs[3], "async-342")
    bad = compiler.compile_async(ConstraintSpec.json_schema({"type": "array", "uniqueItems": True}))
    assert isinstance(bad.exception(timeout=30), UnsupportedConstraintError)


# --------------------------------------------------------------------------------------------------
# tool calls
# --------------------------------------------------------------------------------------------------


def call_text(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"), ensure_ascii=False)


def test_tool_choice_none_and_bad_names():
    assert ConstraintSpec.tools([WEATHER], "none") is None
    assert ConstraintSpec.tools([], "auto") is None
    with pytest.raises(UnsupportedConstraintError, match="unknown function 'nope'"):
        ConstraintSpec.tools([WEATHER], {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(UnsupportedConstraintError, match="required"):
        ConstraintSpec.tools([], "required")
    with pytest.raises(UnsupportedConstraintError, match="declared twice"):
        ConstraintSpec.tools([ADD, ADD])


def test_allowed_tools_restrict_the_callable_functions():
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "add"}}]}}
    spec = ConstraintSpec.tools([WEATHER, ADD], choice)
    assert spec.tool_mode == "required" and [f["name"] for f in spec.functions] == ["add"]
    flat = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]}
    spec = ConstraintSpec.tools([WEATHER, ADD], flat)  # the Responses API's flat shape
    assert spec.tool_mode == "auto" and [f["name"] for f in spec.functions] == ["get_weather"]
    with pytest.raises(UnsupportedConstraintError, match="unknown function 'sub'"):
        ConstraintSpec.tools([WEATHER, ADD], {"type": "allowed_tools", "mode": "auto",
                                              "tools": [{"type": "function", "name": "sub"}]})


def test_tool_choice_required(compiler, tokenizer):
    spec = ConstraintSpec.tools([WEATHER, ADD], "required")
    call = call_text("get_weather", {"city": "Zürich", "unit": "C"})
    assert accepts(compiler, tokenizer, spec, call)
    assert accepts(compiler, tokenizer, spec, call_text("add", {"a": 1, "b": -2}))
    assert run(compiler, spec, tokenizer.encode("Sure, the weather is"))[0] is False  # text: refused
    assert not accepts(compiler, tokenizer, spec, TOOL_CALL_MARKER + call)  # no marker when required
    assert not accepts(compiler, tokenizer, spec, call_text("add", {"a": 1}))  # missing argument
    assert not accepts(compiler, tokenizer, spec, call_text("sub", {"a": 1, "b": 2}))  # undeclared
    assert not accepts(compiler, tokenizer, spec, call + call)  # one call only
    [parsed] = parse_tool_calls(call, spec)
    assert parsed["type"] == "function" and parsed["id"].startswith("call_")
    assert parsed["function"]["name"] == "get_weather"
    assert json.loads(parsed["function"]["arguments"]) == {"city": "Zürich", "unit": "C"}


def test_parallel_tool_calls_admit_up_to_four_calls_and_none_means_one(compiler, tokenizer):
    call = call_text("add", {"a": 1, "b": 2})
    for mode, lead in (("required", ""), ("auto", TOOL_CALL_MARKER)):
        parallel = ConstraintSpec.tools([WEATHER, ADD], mode, parallel=True)
        single = ConstraintSpec.tools([WEATHER, ADD], mode)
        two = lead + call + TOOL_CALL_MARKER + call_text("get_weather", {"city": "Paris"})
        assert accepts(compiler, tokenizer, parallel, two) and not accepts(compiler, tokenizer, single, two)
        assert accepts(compiler, tokenizer, parallel, lead + TOOL_CALL_MARKER.join([call] * 4))
        assert not accepts(compiler, tokenizer, parallel, lead + TOOL_CALL_MARKER.join([call] * 5))
        assert len(parse_tool_calls(two, parallel)) == 2


def test_tool_choice_named(compiler, tokenizer):
    spec = ConstraintSpec.tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}})
    assert accepts(compiler, tokenizer, spec, call_text("add", {"a": 1, "b": 2}))
    assert not accepts(compiler, tokenizer, spec, call_text("get_weather", {"city": "Paris"}))
    # the name is forced: the grammar hands over the whole prefix without sampling
    matcher = compiler.matcher(compiler.compile(spec))
    forced = matcher.forced_tokens()
    assert tokenizer.decode(forced).startswith('{"name":"add","arguments":{')
    assert matcher.consume_tokens(forced)
    assert parse_tool_calls(call_text("add", {"a": 1, "b": 2}), spec)[0]["function"]["name"] == "add"


def test_tool_choice_auto(compiler, tokenizer):
    spec = ConstraintSpec.tools([WEATHER, ADD], "auto")
    text = "The weather in Paris is sunny, 21 °C. 日本 too."
    call = TOOL_CALL_MARKER + call_text("get_weather", {"city": "Paris"})
    assert accepts(compiler, tokenizer, spec, text)
    assert accepts(compiler, tokenizer, spec, "")
    assert accepts(compiler, tokenizer, spec, call)
    assert accepts(compiler, tokenizer, spec, "<tool")  # a prefix of the marker is still text
    assert not accepts(compiler, tokenizer, spec, TOOL_CALL_MARKER + "I think")  # marker commits to a call
    assert not accepts(compiler, tokenizer, spec, call + " and more")  # the call ends the output
    after = "Let me check the weather. " + call  # a call may follow some text, as in a chat
    assert accepts(compiler, tokenizer, spec, after)
    assert not accepts(compiler, tokenizer, spec, "Let me check. " + TOOL_CALL_MARKER + "soon")
    [parsed] = parse_tool_calls(after, spec)
    assert parsed["function"]["name"] == "get_weather"
    assert parse_tool_calls(text, spec) is None
    assert parse_tool_calls(call, spec)[0]["function"]["name"] == "get_weather"
    with pytest.raises(ValueError):
        parse_tool_calls(TOOL_CALL_MARKER + '{"name":"get_weather","argu', spec)  # cut short
    # free text never allows control tokens other than the stop tokens
    allowed = mask_after(compiler, spec, tokenizer.encode("Hello"))
    assert allowed[sorted(tokenizer.stop_ids)].all()
    assert not allowed[sorted(tokenizer.special_ids - tokenizer.stop_ids)].any()


TEMPERATURE = {"type": "object", "properties": {"temp": {"type": "integer"}}, "required": ["temp"],
               "additionalProperties": False}


def test_tools_with_an_answer_format_admit_a_call_or_a_document_and_nothing_else(compiler, tokenizer):
    spec = ConstraintSpec.tools([WEATHER, ADD], "auto", answer=ConstraintSpec.json_schema(TEMPERATURE))
    call = TOOL_CALL_MARKER + call_text("get_weather", {"city": "Paris"})
    assert accepts(compiler, tokenizer, spec, '{"temp":21}')
    assert accepts(compiler, tokenizer, spec, call)
    assert not accepts(compiler, tokenizer, spec, "The weather is fine")  # no free text: a typed answer
    assert not accepts(compiler, tokenizer, spec, '{"temp":"warm"}')
    assert not accepts(compiler, tokenizer, spec, '{"temp":21}' + TOOL_CALL_MARKER)
    assert parse_tool_calls('{"temp":21}', spec) is None
    assert parse_tool_calls(call, spec)[0]["function"]["name"] == "get_weather"


# --------------------------------------------------------------------------------------------------
# batched masks
# --------------------------------------------------------------------------------------------------


def test_fill_masks_fills_only_listed_rows(compiler, tokenizer):
    specs = [
        ConstraintSpec.json_schema(POINT),
        ConstraintSpec.json_object(),
        ConstraintSpec.regex(r"[0-9]+"),
        ConstraintSpec.choice(["café", "日本"]),
        ConstraintSpec.tools([WEATHER, ADD], "auto"),
        ConstraintSpec.tools([WEATHER, ADD], "required"),
        ConstraintSpec.json_schema(Pet),
        ConstraintSpec.regex(r"[a-z]{2,5}"),
    ]
    matchers = [compiler.matcher(compiler.compile(s)) for s in specs]
    words = (compiler.vocab_size + 31) // 32
    for dtype in (np.uint32, np.int32):
        mask = np.full((10, words), 7, dtype)
        rows = [(m, i + 1) for i, m in enumerate(matchers)]  # rows 1..8; 0 and 9 are other slots
        fill_masks(rows, mask)
        assert (mask[0] == 7).all() and (mask[9] == 7).all()
        for matcher, row in rows:
            single = np.zeros((1, words), np.uint32)
            fill_masks([(matcher, 0)], single)
            assert (mask[row].view(np.uint32) == single[0]).all()
    times = []
    mask = np.zeros((8, words), np.uint32)
    for _ in range(20):
        start = time.perf_counter()
        fill_masks([(m, i) for i, m in enumerate(matchers)], mask)
        times.append(time.perf_counter() - start)
    print(f"\nfill_masks, 8 rows: median {np.median(times) * 1e3:.2f} ms")
    with pytest.raises(ValueError):
        fill_masks([(matchers[0], 0)], np.zeros((1, words + 1), np.uint32))


# --------------------------------------------------------------------------------------------------
# outlines-core
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "integer", "minimum": 0}, "minimum"),
        ({"type": "number", "exclusiveMaximum": 1}, "exclusiveMaximum"),
        ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "allOf"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),  # not provably disjoint
        ({"type": "string", "pattern": "^a+$"}, "pattern"),
        ({"type": "object", "required": ["x"]}, "required"),
        ({"$ref": "#/$defs/s", "maxLength": 2, "$defs": {"s": {"type": "string"}}}, "$ref with sibling keywords"),
        ({"type": "string", "enum": ["a", 1]}, "enum with type"),
        ({"enum": [{"a.b": 1}]}, "enum of objects or arrays"),
    ],
)
def test_outlines_core_refuses_what_it_cannot_enforce(schema, feature):
    from scheduler.grammar_outlines import outlines_regex

    with pytest.raises(UnsupportedConstraintError) as info:
        outlines_regex(ConstraintSpec.json_schema(schema))
    assert info.value.feature == feature


@pytest.mark.slow
def test_outlines_core_backend_agrees_with_llguidance(tokenizer, compiler):
    outlines = GrammarCompiler(tokenizer, backend="outlines-core", compile_timeout_s=300)
    try:
        cases = {
            ConstraintSpec.json_schema(
                {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                 "required": ["a"], "additionalProperties": False}
            ): ['{"a":12}', '{"a":-3,"b":true}', '{"a":1.5}', '{"b":true}', '{"a": 1}', '{"a":1,"c":2}', '{"a":1'],
            ConstraintSpec.choice(["café", "日本"]): ["café", "日本", "cafe", "日", ""],
            ConstraintSpec.regex("[a-c]{2}x"): ["abx", "ccx", "ab", "abxx", "adx"],
            ConstraintSpec.tools([ADD], "auto", answer=ConstraintSpec.json_schema(TEMPERATURE)): [
                '{"temp":3}', TOOL_CALL_MARKER + call_text("add", {"a": 1, "b": 2}), "hello", '{"temp":3}x'],
        }  # fmt: skip
        for spec, texts in cases.items():
            start = time.perf_counter()
            outlines.compile(spec)
            print(f"\noutlines-core Index for {spec.kind}: {time.perf_counter() - start:.1f} s")
            for text in texts:
                ids = tokenizer.encode(text)
                assert run(outlines, spec, ids) == run(compiler, spec, ids), (spec.value, text)
            # byte-fallback spellings of non-ASCII text work too
            if spec.kind == "choice":
                assert run(outlines, spec, byte_ids(tokenizer, "café"))[1]
        # same allowed set where both are mid-grammar (outlines-core drops moves out of accepting states)
        spec = next(iter(cases))
        prefix = tokenizer.encode('{"a":')
        assert (mask_after(outlines, spec, prefix) == mask_after(compiler, spec, prefix)).all()
        with pytest.raises(UnsupportedConstraintError, match="minimum"):
            outlines.compile(ConstraintSpec.json_schema({"type": "integer", "minimum": 1}))
    finally:
        outlines.close()


# --------------------------------------------------------------------------------------------------
# strict narrowing and exact rewrites (scheduler.strict_schema, scheduler.schema_rewrite)
# --------------------------------------------------------------------------------------------------


def agrees_with_jsonschema(compiler, tokenizer, schema, documents) -> None:
    """The grammar accepts exactly the documents jsonschema calls valid (a rewrite is exact)."""
    import jsonschema

    for doc in documents:
        text = json.dumps(doc, separators=(",", ":"))
        assert accepts(compiler, tokenizer, ConstraintSpec.json_schema(schema), text) == \
            jsonschema.validators.validator_for(schema)(schema).is_valid(doc), (schema, text)


def test_objects_admit_only_declared_properties_unless_the_schema_admits_more(compiler, tokenizer):
    closed = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city", "zip"]}
    spec = ConstraintSpec.json_schema(closed)
    assert accepts(compiler, tokenizer, spec, '{"city":"Oslo","zip":1}')  # a required key it forgot to declare
    assert not accepts(compiler, tokenizer, spec, '{"city":"Oslo","zip":1,"type":"object"}')  # undeclared
    assert not accepts(compiler, tokenizer, spec, '{"city":"Oslo","city":"Oslo","zip":1}')  # duplicate
    opened = {**closed, "additionalProperties": True}
    assert accepts(compiler, tokenizer, ConstraintSpec.json_schema(opened), '{"city":"Oslo","zip":1,"x":2}')
    opt_out = {**closed, "x-slotserve": {"strict": False}}
    assert accepts(compiler, tokenizer, ConstraintSpec.json_schema(opt_out), '{"city":"Oslo","zip":1,"x":2}')
    merged = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"properties": {"b": {"type": "integer"}}}]}  # closing a side would drop the other's keys
    assert accepts(compiler, tokenizer, ConstraintSpec.json_schema(merged), '{"a":1,"b":2}')


@pytest.mark.parametrize(("text", "ok"), [
    ("1.5", True), ("-0.001", True), ("12345678901234567", True), ("1234567.123456789", True), ("0", True),
    ("123456789012345678", False), ("1.1234567891", False), ("1e5", False), ("1E+999", False),
    ("12345678901234567.5", False),
])
def test_number_literals_carry_at_most_17_digits_9_decimals_and_no_exponent(compiler, tokenizer, text, ok):
    assert accepts(compiler, tokenizer, ConstraintSpec.json_schema({"type": "number"}), text) is ok


def test_number_bounds_and_second_fractions_stay_exact_within_the_narrowing(compiler, tokenizer):
    bounded = ConstraintSpec.json_schema({"type": "number", "exclusiveMinimum": 0, "maximum": 10})
    assert [accepts(compiler, tokenizer, bounded, t) for t in ("0", "0.5", "10", "10.5", "-1")] == \
        [False, True, True, False, False]
    assert not accepts(compiler, tokenizer, ConstraintSpec.json_schema({"type": "integer"}), "1" * 18)
    stamp = ConstraintSpec.json_schema({"type": "string", "format": "date-time"})
    assert accepts(compiler, tokenizer, stamp, '"2020-01-01T10:00:00.123456789+01:00"')
    assert not accepts(compiler, tokenizer, stamp, '"2020-01-01T10:00:00.1234567891Z"')
    assert not accepts(compiler, tokenizer, stamp, '"2020-13-01T10:00:00Z"')  # the format itself still holds


def test_unknown_formats_are_plain_strings(compiler, tokenizer):
    assert accepts(compiler, tokenizer, ConstraintSpec.json_schema({"type": "string", "format": "color"}), '"red"')


CLOSED = {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}
OBJECTS = [{}, {"a": 1}, {"b": 2}, {"c": 3}, {"a": 1, "b": 2}, {"a": 1, "c": 3}, {"b": 2, "c": 3},
           {"a": 1, "b": 2, "c": 3}]


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": CLOSED, "additionalProperties": False, "dependentRequired": {"a": ["b"]}},
    {"type": "object", "properties": CLOSED, "additionalProperties": False,
     "dependentRequired": {"a": ["b"], "c": ["a"]}},
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": CLOSED,
     "additionalProperties": False, "dependencies": {"b": ["c"]}},
    {"type": "object", "properties": CLOSED, "additionalProperties": False,
     "dependentSchemas": {"a": {"required": ["c"]}}},
    {"type": "object", "properties": CLOSED, "additionalProperties": False, "not": {"required": ["b"]}},
    {"type": "object", "properties": CLOSED, "additionalProperties": False, "not": {"required": ["a", "c"]}},
])
def test_dependencies_and_not_required_are_rewritten_exactly(compiler, tokenizer, schema):
    agrees_with_jsonschema(compiler, tokenizer, schema, OBJECTS)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": CLOSED, "additionalProperties": False,  # beyond adding properties
     "dependentSchemas": {"a": {"not": {"required": ["c"]}}}},
    {"type": "object", "properties": CLOSED, "additionalProperties": False,
     "dependentSchemas": {"a": {"properties": {"b": {"minimum": 5}}, "anyOf": [{"required": ["b"]},
                                                                                 {"required": ["c"]}]}}},
    {"type": "object", "properties": CLOSED, "additionalProperties": False,  # boolean dependent schemas
     "dependentSchemas": {"a": True, "b": False}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False,
     "dependentSchemas": {"a": {"properties": {"b": {"type": "integer"}}}}},  # b stays forbidden by the object
    {"type": "object", "properties": CLOSED, "additionalProperties": False,  # the object's own anyOf is kept
     "anyOf": [{"required": ["a"]}, {"required": ["b"]}], "dependentRequired": {"b": ["c"]}},
])
def test_general_dependent_schemas_are_rewritten_exactly(compiler, tokenizer, schema):
    objects = [*OBJECTS, {"a": 1, "b": 7}, {"a": 1, "b": 7, "c": 3}]
    agrees_with_jsonschema(compiler, tokenizer, schema, objects)


def test_schema_passes_treat_property_names_as_names(compiler, tokenizer):
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "oneOf": {"type": "integer"},
                                               "dependentRequired": {"type": "boolean"}},
              "required": ["not"], "additionalProperties": False}
    agrees_with_jsonschema(compiler, tokenizer, schema, [{"not": "x"}, {"not": 1}, {"not": "x", "oneOf": 2},
                                                         {"not": "x", "dependentRequired": True}, {}])


def test_one_of_disjointness_is_proven_on_the_schema_as_written(compiler, tokenizer):
    # Closed by the narrowing, the branches look disjoint, yet {"a": 1} matches both as written.
    schema = {"oneOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"properties": {"b": {"type": "integer"}}}]}
    with pytest.raises(UnsupportedConstraintError, match="oneOf"):
        compiler.compile(ConstraintSpec.json_schema(schema))


def test_nothing_under_a_not_is_narrowed():
    from scheduler.grammar_backends import prepare_schema

    negated = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    prepared = prepare_schema({"type": "object", "not": copy.deepcopy(negated)})
    assert prepared["not"] == negated  # closing it would admit {"a": 1, "b": 2}, which the schema excludes


def test_not_of_a_type_is_the_other_types(compiler, tokenizer):
    schema = {"not": {"type": ["string", "null"]}}
    agrees_with_jsonschema(compiler, tokenizer, schema, ["x", None, 1, 1.5, True, [1], {}])


def test_not_of_scalar_values_is_every_other_value(compiler, tokenizer):
    schema = {"not": {"enum": ["red", "re", "", 3, True, None]}}
    agrees_with_jsonschema(compiler, tokenizer, schema, ["red", "re", "", "r", "reds", "blue", 3, 4, 2.5, -3, True,
                                                         False, None, [], {}])
    one = {"type": "string", "not": {"const": "x"}}
    agrees_with_jsonschema(compiler, tokenizer, one, ["x", "xx", "", "y", 1])


def test_a_one_of_with_provably_disjoint_branches_is_enforced(compiler, tokenizer):
    by_kind = {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
         "required": ["kind"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
         "required": ["kind"], "additionalProperties": False}]}
    agrees_with_jsonschema(compiler, tokenizer, by_kind, [{"kind": "cat", "lives": 9}, {"kind": "dog", "good": True},
                                                         {"kind": "cow"}, {"kind": "cat", "good": True}])
    by_type = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    agrees_with_jsonschema(compiler, tokenizer, by_type, ["x", 1, 1.5, None])
    overlapping = {"oneOf": [{"type": "integer"}, {"type": "number"}]}  # 1 matches both: still refused
    with pytest.raises(UnsupportedConstraintError, match="oneOf"):
        compiler.compile(ConstraintSpec.json_schema(overlapping))


def test_unique_items_on_short_arrays_booleans_and_small_enums_is_enforced(compiler, tokenizer):
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 1, "uniqueItems": True}
    agrees_with_jsonschema(compiler, tokenizer, schema, [[], [1], [1, 1]])
    flags = {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True}
    agrees_with_jsonschema(compiler, tokenizer, flags, [[], [True], [True, False], [False, True], [True, True],
                                                        [False, False, True]])
    colors = {"type": "array", "items": {"enum": ["red", "blue", 3]}, "uniqueItems": True, "minItems": 2}
    agrees_with_jsonschema(compiler, tokenizer, colors, [["red"], ["red", 3], [3, "blue", "red"], ["red", "red"],
                                                         ["blue", 3, 3]])


@pytest.mark.parametrize("items", [{"type": "string"}, {"type": "integer", "minimum": 0},
                                   {"type": ["number", "string"]}, {"$ref": "#/$defs/word"},
                                   {"type": "string", "minLength": 2, "maxLength": 40},
                                   {"enum": ["a", "b", "c", "d", "e"]}, {"type": "integer", "maximum": 5},
                                   {"enum": [1, 2, 3, 4]}, {"type": ["string", "null"]},
                                   {"enum": ["a", "b", "c", "d"], "pattern": "^a"},
                                   {"type": "number", "multipleOf": 2}, {"type": "number", "maximum": 1},
                                   {"type": ["boolean", "null", "integer"], "minimum": 0, "maximum": 3},
                                   {"oneOf": [{"type": "string", "minLength": 1}, {"type": "null"}]},
                                   {"type": "string", "pattern": "^[ab]$"}, {"type": "string", "format": "date"},
                                   {"type": ["string", "null"], "format": "email", "maxLength": 30},
                                   {"type": "number", "multipleOf": 0.25, "maximum": 1},
                                   {"allOf": [{"type": "integer"}, {"minimum": 2}]},
                                   {"allOf": [{"type": "string"}, {"maxLength": 3}, {"pattern": "^a"}]},
                                   {"allOf": [{"$ref": "#/$defs/word"}, {"minLength": 2}]}])
def test_unique_items_over_scalars_compiles_with_the_host_enforcing_it(compiler, items):
    schema = {"type": "array", "items": items, "uniqueItems": True, "$defs": {"word": {"type": "string"}}}
    compiled = compiler.compile(ConstraintSpec.json_schema(schema))
    assert compiled.nav is not None and compiled.nav.unique(compiled.nav.top())


@pytest.mark.parametrize("items", [{"type": "object"}, {"anyOf": [{"type": "integer"}, {"type": "object"}]},
                                   {"allOf": [{"type": ["string", "integer"]}, {"minimum": 2}]}])
def test_unique_items_the_host_can_not_follow_exactly_stays_refused(compiler, items):
    """Objects, and items composed of strings and other kinds at once: the host can not tell which remaining
    values are left, so masking a repeat could leave no valid token. Refused, as in a tool's parameters and on
    the outlines-core backend."""
    with pytest.raises(UnsupportedConstraintError, match="uniqueItems"):
        compiler.compile(ConstraintSpec.json_schema({"type": "array", "items": items, "uniqueItems": True}))
    params = {"type": "object", "properties": {"xs": {"type": "array", "items": items, "uniqueItems": True}}}
    with pytest.raises(UnsupportedConstraintError, match="uniqueItems"):
        compiler.compile(ConstraintSpec.tools([{"type": "function", "function": {"name": "f", "parameters": params}}],
                                              "required"))


def _function(name: str, tags: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"tags": tags}, "required": ["tags"]}}}


UNIQUE_TAGS = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}


@pytest.mark.parametrize("mode", ["required", "auto", "auto-answer"])
def test_unique_items_in_a_tool_call_are_kept_per_function(compiler, tokenizer, mode):
    """A function's parameters with `uniqueItems` over scalars compile: in each call the host follows that
    function's own arguments (told apart by the call's name), so `f`'s unique tags can not repeat while `g`'s
    plain ones may; the answer of a tool-or-answer union is followed by its own schema."""
    everything = np.full((tokenizer.vocab_size + 31) // 32, 0xFFFFFFFF, np.uint32)
    answer = ConstraintSpec.json_schema({"type": "object", "properties": {"ids": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "required": ["ids"]})
    spec = ConstraintSpec.tools([_function("f", UNIQUE_TAGS), _function("g", {"type": "array",
                                                                               "items": {"type": "string"}})],
                                "required" if mode == "required" else "auto",
                                answer=answer if mode == "auto-answer" else None, parallel=True)
    compiled = compiler.compile(spec)
    assert compiled.call_nav is not None

    def repeating(text: str) -> set[str]:
        tracker = compiler.matcher(compiled).keys
        tracker.feed(text.encode())
        return {tokenizer.decode([t]) for t in tracker.repeating(everything)}

    lead = "" if mode == "required" else TOOL_CALL_MARKER
    assert '"' in repeating(lead + '{"name":"f","arguments":{"tags":["a","b","a')
    assert '"' not in repeating(lead + '{"name":"g","arguments":{"tags":["a","b","a')
    second = lead + '{"name":"g","arguments":{"tags":["a"]}}' + TOOL_CALL_MARKER  # then a call of f
    assert '"' in repeating(second + '{"name":"f","arguments":{"tags":["a","b","a')
    if mode == "auto-answer":
        assert {",", "]"} <= repeating('{"ids":[4,7,4')
        assert compiled.nav is not None


def test_grammar_asked_unique_items_hold_in_a_tool_call(compiler, tokenizer):
    """A function's unique array of numbers on a fractional grid (asked of llguidance's byte grammar) in a
    required call: a repeated `0.5` can not complete, and once 0, 0.5 and 1 are used no comma is left."""
    everything = np.full((tokenizer.vocab_size + 31) // 32, 0xFFFFFFFF, np.uint32)
    halves = {"type": "array", "items": {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 1},
              "uniqueItems": True}
    compiled = compiler.compile(ConstraintSpec.tools([_function("f", halves)], "required"))

    def repeating(text: str) -> set[str]:
        tracker = compiler.matcher(compiled).keys
        tracker.feed(text.encode())
        return {tokenizer.decode([t]) for t in tracker.repeating(everything)}

    call = TOOL_CALL_MARKER + '{"name":"f","arguments":{"tags":['
    assert "5" in repeating(call + "0.5,0.") and "5" not in repeating(call + "0,0.")
    assert "," in repeating(call + "0,0.5,1") and "," not in repeating(call + "0,1")


@pytest.mark.parametrize(("schema", "possible"), [
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, False),  # closed by the strict narrowing
    ({"anyOf": [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "null"}]}, False),
    ({"type": "object", "properties": {"a": {"type": "object", "additionalProperties": {"type": "string"}}}}, True),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, True),
    ({"type": "array", "items": {}}, True),  # an item may be any object
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "x-slotserve": {"strict": False}}, True),
])
def test_the_repeat_tracker_checks_only_where_a_key_or_an_item_could_repeat(compiler, schema, possible):
    """Where every object is closed and no array must be unique, nothing can repeat: the tracker skips its
    per-step check (no cost on such schemas) and only follows the document for closing paths."""
    compiled = compiler.compile(ConstraintSpec.json_schema(schema))
    assert compiled.repeats_possible is possible
    assert compiler.matcher(compiled).keys.checks is possible


def test_the_tracker_checks_keys_only_in_objects_that_admit_undeclared_ones(compiler, tokenizer):
    """Per object, as the grammar has it after the strict narrowing: in an open object (additionalProperties) a
    used key can not close again; in a closed one (declared properties only, each written once by the grammar)
    the tracker has nothing to check, and a document of closed objects costs it no work per step."""
    everything = np.full((tokenizer.vocab_size + 31) // 32, 0xFFFFFFFF, np.uint32)
    schema = {"type": "object", "properties": {
        "meta": {"type": "object", "additionalProperties": {"type": "string"}},
        "point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}},
        "both": {"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}}}]}}}
    compiled = compiler.compile(ConstraintSpec.json_schema(schema))

    def tracked(document: bytes) -> tuple[bool, set[str]]:
        tracker = compiler.matcher(compiled).keys
        tracker.feed(document)
        return tracker.lexer.frames[-1].closed, {tokenizer.decode([t]) for t in tracker.repeating(everything)}

    closed, repeats = tracked(b'{"meta":{"a":"1","a')
    assert not closed and {'"', '":'} <= repeats
    assert tracked(b'{"point":{"x":1,"') == (True, set())
    assert tracked(b'{"both":{"x":1,"')[0] is False  # allOf sides stay open: the grammar may admit more keys
