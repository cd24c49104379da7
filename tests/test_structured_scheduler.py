"""Constrained decoding inside the scheduler's batched step: one grammar per slot, masks filled on the
host while the device computes, outputs always valid, unconstrained neighbours untouched."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from agents.tool_calls import parse_tool_calls
from core.engine import Engine, EngineConfig
from core.sampling import SamplingParams
from core.tokenizer import Tokenizer
from core.weights import random_params
from scheduler.grammar import ConstraintSpec, GrammarCompiler, fill_masks
from scheduler.request import FinishReason, GenerationRequest
from scheduler.scheduler import Scheduler, SchedulerConfig
from tiny_models import GEMMA3

VOCAB = 262_144

SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7}}, "required": ["n"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "café"]}},
     "required": ["ok", "tag"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4, "pattern": "^[a-z]+$"}},
     "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": {"type": "integer",
     "minimum": -5, "maximum": 5}}, "required": ["x"], "additionalProperties": False}}, "required": ["p"],
     "additionalProperties": False},
    {"enum": ["alpha", "beta", 42, None]},
    {"type": "object", "properties": {"v": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["v"], "additionalProperties": False},
    {"type": "object", "properties": {"s": {"type": "string", "enum": ["日本", "naïve"]}, "k": {"const": 1}},
     "required": ["s", "k"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def setup(compile_cache, default_gguf):
    from core.config import ModelConfig

    cfg = ModelConfig.from_hf_dict({**GEMMA3, "vocab_size": VOCAB})
    params = random_params(cfg, std=0.1, norm_std=0.1, seed=7)
    engine = Engine(cfg, params, EngineConfig(num_slots=8, max_len=192, chunk_sizes=(4, 16)), "float32")
    engine.warmup()
    tokenizer = Tokenizer.from_pretrained(default_gguf)
    compiler = GrammarCompiler(tokenizer)
    compiler.warm_up()
    return engine, tokenizer, compiler


def prompt(seed: int, n: int = 9) -> tuple[int, ...]:
    return tuple(int(x) for x in np.random.default_rng(seed).integers(1000, VOCAB - 1000, size=n))


def run(sched: Scheduler, reqs):
    handles = [sched.submit(r) for r in reqs]
    sched.run_until_idle()
    return [h.result(timeout=0) for h in handles]


def test_eight_schemas_in_one_batch_all_validate(setup):
    engine, tokenizer, compiler = setup
    sched = Scheduler(engine, tokenizer, SchedulerConfig(), stop_ids=compiler.stop_ids)
    reqs = [GenerationRequest(prompt(i), SamplingParams(temperature=1.0, seed=i), max_tokens=80,
                              constraint=compiler.matcher(compiler.compile(ConstraintSpec.json_schema(s))))
            for i, s in enumerate(SCHEMAS)]
    results = run(sched, reqs)
    assert sched.stats.decode_steps > 0
    for schema, (_, text, fin) in zip(SCHEMAS, results, strict=True):
        assert fin.reason is FinishReason.STOP, (schema, text, fin)
        jsonschema.validate(json.loads(text), schema)


def test_unconstrained_neighbours_are_unaffected(setup):
    engine, tokenizer, compiler = setup
    free = [GenerationRequest(prompt(100 + i), SamplingParams(temperature=0.8, seed=i), max_tokens=12)
            for i in range(4)]
    alone = run(Scheduler(engine, tokenizer, stop_ids=frozenset()), free)
    constrained = [GenerationRequest(prompt(200 + i), SamplingParams(temperature=1.0, seed=i), max_tokens=60,
                                     constraint=compiler.matcher(compiler.compile(ConstraintSpec.json_schema(s))))
                   for i, s in enumerate(SCHEMAS[:4])]
    mixed = run(Scheduler(engine, tokenizer, stop_ids=frozenset()), [x for pair in zip(free, constrained,
                                                                                      strict=True) for x in pair])
    assert [r[0] for r in mixed[0::2]] == [r[0] for r in alone]


def test_greedy_choice_regex_and_tool_call(setup):
    engine, tokenizer, compiler = setup
    sched = Scheduler(engine, tokenizer, stop_ids=compiler.stop_ids)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Zürich"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["city", "days"], "additionalProperties": False}}}]
    specs = [ConstraintSpec.choice(["yes", "no", "peut-être"]), ConstraintSpec.regex(r"[0-9]{3}-[a-c]{2}"),
             ConstraintSpec.tools(tools, "required")]
    reqs = [GenerationRequest(prompt(300 + i), SamplingParams(temperature=0), max_tokens=60,
                              constraint=compiler.matcher(compiler.compile(spec))) for i, spec in enumerate(specs)]
    (_, choice, f1), (_, code, f2), (_, call, f3) = run(sched, reqs)
    assert choice in ("yes", "no", "peut-être") and f1.reason is FinishReason.STOP
    assert len(code) == 6 and code[:3].isdigit() and code[3] == "-" and f2.reason is FinishReason.STOP
    calls = parse_tool_calls(call, specs[2])
    assert calls and calls[0]["function"]["name"] == "get_weather"
    args = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(args, tools[0]["function"]["parameters"])


def test_max_tokens_inside_a_structure_finishes_with_length(setup):
    engine, tokenizer, compiler = setup
    sched = Scheduler(engine, tokenizer, stop_ids=compiler.stop_ids)
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"},
                                                        "minItems": 20}}, "required": ["items"]}
    spec = ConstraintSpec.json_schema(schema)
    req = GenerationRequest(prompt(400), SamplingParams(temperature=1.0, seed=3), max_tokens=5,
                            constraint=compiler.matcher(compiler.compile(spec)))
    ids, text, fin = run(sched, [req])[0]
    assert fin.reason is FinishReason.LENGTH and len(ids) == 5
    assert text.startswith("{")


# Schemas whose documents a random model runs long in (open strings, arrays, recursion) and that a budget of 48
# tokens can still close: nested required objects, arrays with minItems, $ref recursion, an open object.
CLOSABLE = [
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "string"}, "d": {"type": "integer"}}, "required": ["c", "d"]}}, "required": ["b"]},
        "e": {"type": "boolean"}}, "required": ["a", "e"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 3},
                                      "n": {"type": "number"}}, "required": ["tags", "n"]},
    {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v", "kids"]}}, "$ref": "#/$defs/node"},
    {"type": "object", "additionalProperties": {"type": "string"}},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                      "notes": {"type": "string", "minLength": 5}}, "required": ["code", "notes"]},
    # An unanchored pattern (contains two word characters: punctuation is valid content that never satisfies
    # it) and a schema with no type (a bare number or a string is a whole document).
    {"type": "object", "properties": {"language": {"type": "string", "pattern": "(\\w{2})"},
                                      "label": {"type": "string", "pattern": "[A-Z]"}},
     "required": ["language", "label"]},
    {"description": "anything"},
    # Unique arrays (scheduler/unique_items.py): a closing path never completes an item the array holds.
    {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True,
                                              "minItems": 3},
                                      "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True,
                                               "minItems": 2}}, "required": ["ids", "tags"]},
]


def test_closing_paths_end_every_document_validly_from_any_point(setup):
    """From random points of random documents, the matcher's closing path is accepted token by token and ends a
    document that validates: the length the budget relies on is a real ending, never an underestimate."""
    _, tokenizer, compiler = setup
    rng = np.random.default_rng(5)
    for schema in CLOSABLE:
        compiled = compiler.compile(ConstraintSpec.json_schema(schema))
        for _ in range(6):
            matcher, taken = compiler.matcher(compiled), []
            for _ in range(int(rng.integers(0, 30))):  # a random prefix the grammar allows
                mask = np.zeros((1, (VOCAB + 31) // 32), np.uint32)
                fill_masks([(matcher, 0)], mask)
                matcher.keys.drop_repeats(mask[0])  # as the scheduler does
                allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
                allowed = [t for t in allowed if t not in compiler.stop_ids]
                if not allowed or matcher.is_finished():
                    break
                token = int(rng.choice(allowed))
                assert matcher.consume(token)
                matcher.keys.feed_token(token)  # as the scheduler does with every accepted token
                taken.append(token)
            path = matcher.closing_path(512)
            assert path is not None, (schema, tokenizer.decode(taken))
            ending = [t for t in path if t not in compiler.stop_ids]
            assert all(matcher.consume(t) for t in ending) and matcher.is_accepting()
            document = json.loads(tokenizer.decode(taken + ending), object_pairs_hook=no_repeated_keys)
            jsonschema.validate(document, schema)


def test_a_document_that_would_be_cut_closes_within_max_tokens_and_validates(setup):
    """A random model runs long inside these documents: with a budget of 48 tokens, each closes along its grammar
    (finish STOP, marked budget_closed, counted) and validates; the same requests with closing off are cut
    (LENGTH). A document whose shortest ending cannot fit any more still ends with LENGTH."""
    engine, tokenizer, compiler = setup

    def requests(close: bool) -> list[GenerationRequest]:
        return [GenerationRequest(prompt(500 + i), SamplingParams(temperature=1.0, seed=i), max_tokens=48,
                                  close_within_budget=close,
                                  constraint=compiler.matcher(compiler.compile(ConstraintSpec.json_schema(s))))
                for i, s in enumerate(CLOSABLE)]

    sched = Scheduler(engine, tokenizer, stop_ids=compiler.stop_ids)
    closed = run(sched, requests(True))
    cut = run(Scheduler(engine, tokenizer, stop_ids=compiler.stop_ids), requests(False))
    for schema, (ids, text, fin), (_, _, fin_off) in zip(CLOSABLE, closed, cut, strict=True):
        assert fin.reason is FinishReason.STOP and len(ids) <= 48, (schema, text)
        jsonschema.validate(json.loads(text), schema)
        assert fin.budget_closed == (fin_off.reason is FinishReason.LENGTH), (schema, text)
        assert not fin_off.budget_closed
    assert sum(f.budget_closed for _, _, f in closed) >= 3  # most of them would have been cut
    assert sched.stats.budget_closed == sum(f.budget_closed for _, _, f in closed)


def pushed_outputs(setup, compiled, bias, track: bool, seed: int, max_tokens: int) -> list[str]:
    """Eight sampled outputs of a random model under ``bias``, with the host's repeat tracker or without it."""
    engine, tokenizer, compiler = setup
    reqs = []
    for i in range(8):
        matcher = compiler.matcher(compiled)
        matcher.keys = matcher.keys if track else None
        reqs.append(GenerationRequest(prompt(seed + i), SamplingParams(temperature=1.0, seed=i, logit_bias=bias),
                                      max_tokens=max_tokens, constraint=matcher))
    return [text for _, text, _ in run(Scheduler(engine, tokenizer, stop_ids=compiler.stop_ids), reqs)]


def no_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"repeated key in {keys}"
    return dict(pairs)


def repeated_keys(text: str) -> bool:
    try:
        json.loads(text, object_pairs_hook=no_repeated_keys)
    except AssertionError:
        return True
    return False


def test_a_key_being_written_cannot_close_on_a_key_its_object_has(setup):
    """The tracker follows nested objects, values and escapes: the tokens that would close the key being written
    on a key its object has (spelled the same or with an escape) are the ones removed, and only those."""
    _, tokenizer, compiler = setup
    everything = np.full((VOCAB + 31) // 32, 0xFFFFFFFF, np.uint32)

    def closing(document: bytes) -> set[str]:
        tracker = compiler.matcher(compiler.compile(ConstraintSpec.json_object())).keys
        tracker.feed(document)
        return {tokenizer.decode([t]) for t in tracker.repeating(everything)}

    nested = b'{"ab":1,"n":{"ab":[{"x":"ab"}],"z":2},"'
    assert {'"', '":', '",'} <= closing(nested + b"ab") and '"' in closing(nested + b"n")
    assert not closing(nested + b"x") and not closing(nested + b"z") and not closing(nested + b"abc")
    assert not any(piece.startswith('"') for piece in closing(nested + b"a"))  # "a" is free; "ab" via b"
    assert '"' in closing(b'{"a":1,"\\u0061')  # an escape spelling of the used key "a"
    assert not any(piece.startswith('"') for piece in closing(b'{"a":1,"b":"a'))  # a value string, not a key
    tracker = compiler.matcher(compiler.compile(ConstraintSpec.json_object())).keys
    tracker.feed(b'{"ab":1,"ab')
    narrowed = everything.copy()
    assert tracker.drop_repeats(narrowed) > 0
    assert not narrowed[tokenizer.encode('"', parse_special=False)[0] >> 5] >> np.uint32(
        tokenizer.encode('"', parse_special=False)[0] & 31) & 1


def test_open_objects_never_repeat_a_key(setup):
    """A random model pushed (logit_bias) to write short keys and many of them repeats keys without the tracker,
    never with it (a used key is extended instead); the outputs still validate."""
    engine, tokenizer, compiler = setup
    schema = {"type": "object", "additionalProperties": False,
              "patternProperties": {"^[ab][0-9]*$": {"type": "integer", "minimum": 0, "maximum": 9}}}
    compiled = compiler.compile(ConstraintSpec.json_schema(schema))
    (close_key,), (letter,), (next_key,), (close_object,) = (tokenizer.encode(t) for t in ('":', "a", ',"', "}"))
    bias = ((close_key, 6.0), (letter, 6.0), (next_key, 6.0), (close_object, -100.0))

    def outputs(track: bool) -> list[str]:
        return pushed_outputs(setup, compiled, bias, track, seed=700, max_tokens=48)

    assert sum(repeated_keys(text) for text in outputs(track=False)) >= 2
    for text in outputs(track=True):
        assert not repeated_keys(text), text
        jsonschema.validate(json.loads(text), schema)


def test_near_the_budget_no_new_item_or_member_starts(setup):
    """In the tokens just before a document must close, the mask keeps the grammar's tokens except those that
    would start another item or member (a comma, a bracket or brace, a string closed into one); the closing
    path's next token stays allowed. Far from the budget nothing is narrowed."""
    from scheduler.budget_close import CLOSE_SLACK, WIND_DOWN, BudgetClose

    _, tokenizer, compiler = setup
    schema = {"type": "array", "items": {"type": "integer"}}
    matcher = compiler.matcher(compiler.compile(ConstraintSpec.json_schema(schema)))
    for token in tokenizer.encode("[12"):
        assert matcher.consume(token)
        matcher.keys.feed_token(token)

    def narrowed(left: int) -> set[str]:
        mask = np.zeros((1, (VOCAB + 31) // 32), np.uint32)
        fill_masks([(matcher, 0)], mask)
        budget, generated = BudgetClose(), 100
        budget.narrow(matcher, generated, generated + left, mask[0])
        return {tokenizer.decode([t]) for t in np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))}

    closing = len(matcher.closing_path(512))  # "]": the grammar ends there
    far, near = narrowed(200), narrowed(closing + CLOSE_SLACK + WIND_DOWN)
    assert {",", "]", "3"} <= far
    assert "]" in near and "3" in near and "," not in near and not any("," in piece for piece in near)


@pytest.mark.parametrize("additional", [False, {"type": "integer"}])
def test_the_grammar_itself_writes_a_declared_property_at_most_once(setup, additional):
    """Declared properties are the grammar's job (llguidance writes them once, in schema order, and keeps
    their names out of additional keys); the key tracker covers only open keys. Checked with no tracker."""
    _, tokenizer, compiler = setup
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "additionalProperties": additional}
    matcher = compiler.matcher(compiler.compile(ConstraintSpec.json_schema(schema)))
    matcher.keys = None
    def allowed() -> set[str]:
        mask = np.zeros((1, (VOCAB + 31) // 32), np.uint32)
        fill_masks([(matcher, 0)], mask)
        return {tokenizer.decode([t]) for t in np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))}

    for token in tokenizer.encode('{"a":1,"'):
        assert matcher.consume(token)
    if additional is False:  # closed: only the other declared key may follow
        assert not any(piece.startswith("a") for piece in allowed()) and "b" in allowed()
        return
    assert matcher.consume(tokenizer.encode("a")[0])  # "a" may start an additional key ("ab")...
    assert not any(piece.startswith('"') for piece in allowed())  # ...but the key "a" cannot close again


UNIQUE_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["tags", "ids"],
    "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "minItems": 2},
                   "ids": {"type": "array", "items": {"$ref": "#/$defs/id"}, "uniqueItems": True, "minItems": 2}},
    "$defs": {"id": {"type": "integer", "minimum": 0}},
}


def repeated_items(document: object) -> bool:
    """Some array in the document holds two equal items (as JSON Schema compares them)."""
    if isinstance(document, dict):
        return any(repeated_items(v) for v in document.values())
    if isinstance(document, list):
        # Numbers by value; true and 1 are different items (json.dumps keeps them apart).
        seen = [float(v) if isinstance(v, int | float) and not isinstance(v, bool) else json.dumps(v, sort_keys=True)
                for v in document]
        return len(set(seen)) != len(seen) or any(repeated_items(v) for v in document)
    return False


def test_a_unique_array_cannot_complete_an_item_it_holds(setup):
    """uniqueItems over strings and numbers compiles (the grammar without it) and the tracker removes exactly
    the tokens that would complete an item already in that array: strings compared decoded, numbers by value,
    0 (which can not grow) at its first digit; other arrays and values are free."""
    _, tokenizer, compiler = setup
    everything = np.full((VOCAB + 31) // 32, 0xFFFFFFFF, np.uint32)
    compiled = compiler.compile(ConstraintSpec.json_schema(UNIQUE_SCHEMA))
    assert compiled.nav is not None

    def completing(document: bytes, mask: np.ndarray = everything) -> set[str]:
        tracker = compiler.matcher(compiled).keys
        tracker.feed(document)
        return {tokenizer.decode([t]) for t in tracker.repeating(mask)}

    assert {'"', '",', '"]'} <= completing(b'{"tags":["ab","c\\u0064","ab')
    assert '"' in completing(b'{"tags":["ab","cd","cd')  # "c\u0064" is "cd"
    # "abc" is new: only a token that then writes the empty string twice ('""""""') repeats an item.
    assert all(piece.count('"') >= 6 for piece in completing(b'{"tags":["ab","cd","abc'))
    assert {",", "]"} <= completing(b'{"tags":["a","b","c"],"ids":[10,2,10')
    assert "," in completing(b'{"tags":["a","b","c"],"ids":[10,2.0,2')  # 2 == 2.0
    assert "0" in completing(b'{"tags":["a","b","c"],"ids":[0,')
    grown = b'{"tags":["a","b","c"],"ids":[10,2,1'  # 1 may still become 1, 11, 12...: no token the grammar takes
    assert not {piece for piece in completing(grown, grammar_mask(compiler, compiled, grown)) if '"' not in piece}
    short = compiler.matcher(compiler.compile(ConstraintSpec.json_schema(
        {"type": "array", "items": {"type": "string", "maxLength": 2}, "uniqueItems": True}))).keys
    short.feed(b'["ab","a')  # "ab" could only close: its last character is the repeat
    found = {tokenizer.decode([t]) for t in short.repeating(everything)}
    assert "b" in found and not {'"', "c", '",'} & found  # "a" and "ac" are new
    only_b = np.zeros_like(everything)
    b = tokenizer.encode("b")[0]
    only_b[b >> 5] = np.uint32(1) << np.uint32(b & 31)
    assert short.drop_repeats(only_b) == 1 and not only_b.any()  # a repeat is never let through: no token
    free = compiler.matcher(compiler.compile(ConstraintSpec.json_schema(
        {"type": "array", "items": {"type": "string"}}))).keys
    free.feed(b'["ab","ab')
    assert not free.repeating(everything)


def grammar_mask(compiler, compiled, document: bytes) -> np.ndarray:
    """The grammar's own mask ([ceil(V/32)] uint32) after ``document``."""
    matcher = compiler.matcher(compiled)
    assert matcher.consume_tokens(compiler.tokenizer.encode(document.decode()))
    mask = np.zeros((1, (VOCAB + 31) // 32), np.uint32)
    fill_masks([(matcher, 0)], mask)
    return mask[0]


def test_unique_arrays_never_repeat_an_item(setup):
    """A random model pushed (logit_bias) to write one short string and one number again and again repeats
    items without the tracker, never with it; every output validates, uniqueness included."""
    engine, tokenizer, compiler = setup
    compiled = compiler.compile(ConstraintSpec.json_schema(UNIQUE_SCHEMA))
    bias = tuple((tokenizer.encode(text)[0], 7.0) for text in ("a", '","', "7", ",", "]"))

    def outputs(track: bool) -> list[str]:
        return pushed_outputs(setup, compiled, bias, track, seed=800, max_tokens=64)

    untracked = [json.loads(text) for text in outputs(track=False) if _parses(text)]
    assert sum(repeated_items(doc) for doc in untracked) >= 2
    for text in outputs(track=True):
        document = json.loads(text)
        assert not repeated_items(document), text
        jsonschema.validate(document, UNIQUE_SCHEMA)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


COLORS = {"type": "array", "items": {"enum": ["red", "green", "blue", "cyan", "magenta"]}, "uniqueItems": True,
          "minItems": 2}


def test_a_unique_enum_array_commits_to_no_used_value_and_ends_when_all_are_used(setup):
    """An enum of more values than the arrangement rewrite takes compiles; a token that could only spell a used
    value is removed where it commits to it, and once every value is used so is the quote of another item. A
    random model pushed to write item after item then ends every array validly, never with an error."""
    engine, tokenizer, compiler = setup
    everything = np.full((VOCAB + 31) // 32, 0xFFFFFFFF, np.uint32)
    compiled = compiler.compile(ConstraintSpec.json_schema(COLORS))

    def repeating(document: bytes) -> set[str]:
        tracker = compiler.matcher(compiled).keys
        tracker.feed(document)
        return {tokenizer.decode([t]) for t in tracker.repeating(everything)}

    assert {"re", "red", '"re', "r"} & repeating(b'["red","green",') == {'"re', '"r'} & repeating(b'["red","green",')
    assert "d" in repeating(b'["red","green","re')  # "re" can only become "red"
    assert "ue" not in repeating(b'["red","green","bl')
    assert '"' in repeating(b'["red","green","blue","cyan","magenta",')  # nothing is left to write,
    assert "," in repeating(b'["red","green","blue","cyan","magenta"')  # so no other item may begin
    assert "," not in repeating(b'["red","green","blue","cyan"')
    bias = tuple((tokenizer.encode(text)[0], 8.0) for text in ('","', "red", "re"))
    assert_end_unique_and_valid(setup, compiled, bias, COLORS, seed=900)


def assert_end_unique_and_valid(setup, compiled, bias, schema, seed: int) -> None:
    """Eight outputs of a random model pushed by ``bias``, with the tracker: every one ends on its own (never in
    an error), repeats no item and validates."""
    engine, tokenizer, compiler = setup
    reqs = [GenerationRequest(prompt(seed + i), SamplingParams(temperature=1.0, seed=i, logit_bias=bias),
                              max_tokens=40, constraint=compiler.matcher(compiled)) for i in range(8)]
    for _, text, fin in run(Scheduler(engine, tokenizer, stop_ids=compiler.stop_ids), reqs):
        assert fin.reason is FinishReason.STOP, (text, fin)
        document = json.loads(text)
        assert not repeated_items(document), text
        jsonschema.validate(document, schema)


BOUNDED_UNIQUE = [
    ({"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 12}, "uniqueItems": True,
      "minItems": 2}, ("1", ",")),
    ({"type": "array", "items": {"type": ["boolean", "null", "integer"], "minimum": 0, "maximum": 2},
      "uniqueItems": True, "minItems": 2}, ("true", "null", ",", "0")),
    ({"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 5}, "uniqueItems": True}, ("5", ",")),
    ({"type": "array", "items": {"enum": [10, 2.5, "x", False]}, "uniqueItems": True}, ("1", "0", ",")),
    ({"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 3}, {"type": "null"}]},
      "uniqueItems": True}, ("1", "null", ",")),
    ({"type": "array", "items": {"type": "string", "pattern": "^(x|xy|xyz|z)$"}, "uniqueItems": True,
      "minItems": 1}, ("x", "y", '","', ",")),
    ({"type": "array", "items": {"type": "string", "format": "ipv4", "pattern": "^10\\.0\\.0\\.[1-3]$"},
      "uniqueItems": True, "minItems": 1}, ("1", '","', ",")),
    ({"type": "array", "items": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 1},
      "uniqueItems": True, "minItems": 1}, ("0", ".", "5", ",")),
    ({"type": "array", "items": {"allOf": [{"type": "integer"}, {"minimum": 1, "maximum": 3}]},
      "uniqueItems": True, "minItems": 1}, ("1", ",")),
]


@pytest.mark.parametrize(("schema", "pushed"), BOUNDED_UNIQUE,
                         ids=["range", "mixed", "bounded-number", "enum", "any-of", "pattern", "format",
                              "fractional-grid", "all-of"])
def test_unique_arrays_of_bounded_scalars_neither_repeat_nor_run_into_a_dead_end(setup, schema, pushed):
    """Items that can run out (a range, booleans and null, a number at its maximum, an enum of mixed values, a
    union of a range and null, a pattern's and a format's strings): a random model pushed to write the same
    values repeats items without the tracker; with it no output repeats one, none ends in an error (the
    look-ahead removes a value's first character once every value it could become is used, and the comma once
    none is left), and every output validates."""
    engine, tokenizer, compiler = setup
    compiled = compiler.compile(ConstraintSpec.json_schema(schema))
    bias = tuple((tokenizer.encode(text)[0], 7.0) for text in pushed)
    untracked = [json.loads(text) for text in pushed_outputs(setup, compiled, bias, False, seed=1200, max_tokens=40)
                 if _parses(text)]
    assert sum(repeated_items(doc) for doc in untracked) >= 2
    assert_end_unique_and_valid(setup, compiled, bias, schema, seed=1200)


def test_a_key_closed_by_a_token_with_an_escape_is_found_by_the_text_it_adds(setup):
    """A token whose bytes before its closing quote hold an escape (`=\\""` adds `="`) closes a key on the
    decoded text: it is looked up as such, not tried against every key; inside an unfinished escape every
    quote token is a candidate."""
    _, tokenizer, compiler = setup
    quotes = compiler.quote_tokens()
    [token] = [i for i in quotes.ids.tolist() if tokenizer.token_bytes(i) == b'=\\""']  # adds '="', then closes
    [inside] = [i for i in quotes.ids.tolist() if tokenizer.token_bytes(i) == b'\\"']  # an escaped quote only
    assert token in quotes.closing_on(b"k", ['k="', "other"])
    assert token in quotes.closing_on(b"k\\u0041", ['kA="'])  # the key so far holds an escape too
    assert token not in quotes.closing_on(b"k", ['k="x']) and inside not in quotes.closing_on(b"k", ['k"'])
    assert len(quotes.closing_on(b"k\\", ["k"])) == len(quotes.ids)  # a pending escape: any quote token
