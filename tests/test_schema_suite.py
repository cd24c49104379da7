"""Fail closed, measured: every vendored JSON schema is either refused at compile time (naming the
feature) or its grammar accepts every valid test document and rejects every invalid one.

Data (tests/data/json-schema, see its README): the official JSON-Schema-Test-Suite for draft 2020-12
and 255 schemas sampled from JSONSchemaBench. A document is serialized the way our grammars write JSON
(compact, ``ensure_ascii=False``), tokenized canonically with the model's tokenizer (no BOS) and fed
token by token; accepted = every token consumed and the matcher accepting at the end.

Principled exclusions, all in the safe direction (a valid document we cannot produce; an accepted
invalid document is never excused):
* format: our grammars assert `format`; draft 2020-12 makes it an annotation by default, so the suite's
  format.json calls e.g. "2962" a valid email.
* number spelling: equal numbers have one spelling in const/enum/integer (1, not 1.0); the document is
  excused when its respelling (integral floats written as integers) is accepted.
* key order: properties are generated in schema order; the document is excused when the same object
  with its keys in another order is accepted.
* format annotations: a `format` the backend does not assert is an annotation (draft 2020-12) and its
  strings are plain strings; a document labelled invalid only by such a format (valid under jsonschema,
  which asserts no format by default) is counted as valid, not as an accepted invalid document.
* strict narrowing (`scheduler.strict_schema`): objects admit only declared properties unless the schema
  admits more, numbers carry at most 17 digits (9 decimals, no exponent), second fractions 9 digits; the
  document is excused when the narrowed schema itself (checked with jsonschema) refuses it.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from scheduler.grammar import ConstraintSpec, UnsupportedConstraintError
from scheduler.grammar_backends import iter_subschemas
from scheduler.grammar_llguidance import ASSERTED_FORMATS
from scheduler.grammar_outlines import OC_FORMATS
from scheduler.strict_schema import tighten, wants_strict

DATA = Path(__file__).parent / "data" / "json-schema"


@dataclass
class Case:
    suite: str  # "test-suite-draft2020-12" or "jsonschemabench-sample"
    source: str  # file name
    description: str
    schema: Any
    tests: list[dict[str, Any]]


def load_cases() -> list[Case]:
    cases = []
    for path in sorted(DATA.glob("*/*.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        for group in doc if isinstance(doc, list) else [doc]:
            cases.append(
                Case(path.parent.name, path.name, group.get("description", ""), group["schema"], group["tests"])
            )
    return cases


CASES = load_cases()


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def respell_numbers(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [respell_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: respell_numbers(v) for k, v in value.items()}
    return value


def reorderings(value: Any, limit: int = 20) -> list[Any]:
    """The value with its objects' keys in other orders (a bounded sample, recursively)."""
    if isinstance(value, dict):
        out = []
        for keys in itertools.islice(itertools.permutations(value), limit):
            choices = [reorderings(value[k], 4) for k in keys]
            out += [dict(zip(keys, vals, strict=True)) for vals in itertools.islice(itertools.product(*choices), 4)]
        return out[:limit]
    if isinstance(value, list):
        return [list(v) for v in itertools.islice(itertools.product(*(reorderings(v, 4) for v in value)), limit)]
    return [value]


def in_schema_order(schema: Any, value: Any) -> Any:
    """The value with every object's keys in the order of the ``properties`` map (then the required keys it
    does not declare) that names most of them: the order in which properties are generated; for documents
    too deep for `reorderings` to find it."""
    orders = [[*sub["properties"], *(k for k in sub.get("required") or () if k not in sub["properties"])]
              for sub in iter_subschemas(schema) if isinstance(sub.get("properties"), dict)]  # required-only keys next

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            # the map declaring most of the keys; keys it does not declare (pattern or additional) go last
            order = max(orders, key=lambda o: len(set(v) & set(o)), default=[])
            keys = sorted(v, key=lambda k: order.index(k) if k in order else len(order))
            return {k: walk(v[k]) for k in keys}
        return [walk(x) for x in v] if isinstance(v, list) else v

    return walk(value)


def annotation_only(schema: Any, value: Any, asserted: frozenset[str] = ASSERTED_FORMATS) -> bool:
    """The schema has a format the backend does not assert, and the value is valid when formats annotate."""
    formats = {sub.get("format") for sub in iter_subschemas(schema)} - {None}
    if not formats - asserted:
        return False
    try:
        return jsonschema.validators.validator_for(schema)(schema).is_valid(value)
    except (jsonschema.exceptions.SchemaError, jsonschema.exceptions.RefResolutionError, RecursionError):
        return False


def narrowed_accepts(schema: dict[str, Any], value: Any) -> bool:
    narrowed = json.loads(json.dumps(schema))
    if wants_strict(narrowed):
        tighten(narrowed)
    try:
        return jsonschema.validators.validator_for(schema)(narrowed).is_valid(value)
    except (jsonschema.exceptions.SchemaError, jsonschema.exceptions.RefResolutionError, RecursionError):
        return True  # no verdict: not excused


def test_every_schema_is_refused_or_enforced_exactly(compiler, tokenizer, capsys):
    def accepts(compiled, value: Any) -> bool:
        """The grammar takes the document and the host's tracker (no repeated key or unique item) lets it be."""
        matcher, text = compiler.matcher(compiled), dumps(value)
        if not (matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()):
            return False
        return matcher.keys is None or not matcher.keys.lexer.fork().repeats_in(text.encode())

    def exclusion(case: Case, compiled, value: Any) -> str | None:
        """Why a valid document the grammar refuses is a documented, safe-direction exclusion."""
        if case.suite == "test-suite-draft2020-12" and case.source == "format.json":
            return "format asserted"
        respelled = respell_numbers(value)
        if dumps(respelled) != dumps(value) and accepts(compiled, respelled):
            return "number spelling"
        if any(accepts(compiled, v) for v in [in_schema_order(case.schema, value), *reorderings(value)[1:]]):
            return "key order"
        if isinstance(case.schema, dict) and not narrowed_accepts(case.schema, value):
            return "strict narrowing"
        return None

    refused: Counter[str] = Counter()
    refused_by_source: Counter[str] = Counter()
    excused: Counter[str] = Counter()
    accepted_invalid, rejected_valid = [], []
    compiled_count = documents = 0
    for case in CASES:
        try:
            compiled = compiler.compile(ConstraintSpec.json_schema(case.schema))
        except UnsupportedConstraintError as e:
            assert e.feature and e.feature in str(e), (case.source, case.description)
            refused[e.feature] += 1
            refused_by_source[case.suite] += 1
            continue
        compiled_count += 1
        for test in case.tests:
            documents += 1
            ok = accepts(compiled, test["data"])
            where = (case.source, case.description, test["description"], dumps(test["data"])[:120])
            if ok and not test["valid"]:
                if annotation_only(case.schema, test["data"]):
                    excused["format annotation"] += 1
                else:
                    accepted_invalid.append(where)
            elif not ok and test["valid"]:
                reason = exclusion(case, compiled, test["data"])
                if reason is None:
                    rejected_valid.append(where)
                else:
                    excused[reason] += 1

    total, n_refused = len(CASES), sum(refused.values())
    bench = sum(c.suite == "jsonschemabench-sample" for c in CASES)
    with capsys.disabled():
        print(f"\n[schema suite, llguidance] {total} schemas ({bench} JSONSchemaBench, {total - bench} official):")
        print(f"  {compiled_count} compiled, {n_refused} refused ({dict(refused_by_source)})")
        print(f"  {documents} documents checked; safe-direction exclusions: {dict(excused)}")
        print(f"  refused by feature: {dict(refused.most_common())}")
    assert total >= 200
    assert not accepted_invalid, f"schema-invalid documents accepted: {accepted_invalid}"
    assert not rejected_valid, f"valid documents rejected without a documented reason: {rejected_valid}"
    assert n_refused < compiled_count, "refusals must be a minority"
    assert documents >= 1000


def test_outlines_core_allowlist_is_exact():
    """The outlines-core path: schemas past its allowlist must never accept an invalid document.

    Checked on a byte-level vocabulary (one token per byte), which needs no tokenizer and builds each
    Index in milliseconds; the tokenizer bridge itself is covered in test_grammar. Valid documents may
    be refused (it writes no additional properties, keeps schema key order, and its Index drops moves
    from an accepting state to a non-accepting one, e.g. "1" -> "1." in a top-level number), so those
    are only counted.
    """
    from outlines_core import Index, Vocabulary

    from scheduler.grammar_outlines import OUTLINES_MAX_REGEX, outlines_regex

    eos = 256
    vocabulary = Vocabulary(eos, {bytes([b]): [b] for b in range(256)})
    refused: Counter[str] = Counter()
    accepted_invalid = []
    admitted = documents = rejected_valid = 0
    for case in CASES:
        try:
            regex = outlines_regex(ConstraintSpec.json_schema(case.schema))
            if len(regex) > OUTLINES_MAX_REGEX:  # the backend refuses these too (Index would take minutes)
                raise UnsupportedConstraintError("grammar too complex")
            index = Index(regex, vocabulary)
        except UnsupportedConstraintError as e:
            refused[e.feature] += 1
            continue
        except ValueError:  # Index construction failed (e.g. an unmatchable regex): the backend refuses it
            refused["grammar"] += 1
            continue
        admitted += 1
        finals = set(index.get_final_states())
        for test in case.tests:
            documents += 1
            state = index.get_initial_state()
            for byte in dumps(test["data"]).encode():
                state = index.get_next_state(state, byte)
                if state is None:
                    break
            ok = state is not None and state in finals
            if ok and not test["valid"] and not annotation_only(case.schema, test["data"], OC_FORMATS):
                accepted_invalid.append((case.source, case.description, test["description"]))
            rejected_valid += not ok and test["valid"]
    print(f"[outlines-core] {len(CASES)} schemas: {admitted} admitted ({documents} documents, "
          f"{rejected_valid} valid ones refused); refused: {dict(refused.most_common(12))}")  # fmt: skip
    assert admitted >= 50
    assert not accepted_invalid, f"schema-invalid documents accepted: {accepted_invalid}"
