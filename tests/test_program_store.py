"""Exported programs on disk (core.program_store): a second engine on the same store traces nothing and
computes bit for bit what the first computed; a damaged entry is caught by its checksum and exported again;
an entry from another environment or for other arguments is never looked up."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from core import program_store
from core.engine import Engine, EngineConfig
from core.program_store import ENTRY_SUFFIX, ProgramStore, program_key, source_digest
from core.sampling import SamplingParams
from core.weights import random_params
from tiny_models import model_config

CONFIG = EngineConfig(num_slots=2, max_len=32, chunk_sizes=(8,), attention_buckets=(), verify_width=0)


@pytest.fixture(scope="module")
def model(compile_cache):
    cfg = model_config("gemma3")
    return cfg, random_params(cfg, std=0.1, norm_std=0.1, seed=5)


@pytest.fixture(scope="module")
def filled(model, tmp_path_factory) -> tuple[Path, list[np.ndarray]]:
    """A store every program was exported to, and what its engine computed."""
    directory = tmp_path_factory.mktemp("programs")
    return directory, outputs(engine_on(model, ProgramStore(directory)))


def copy_of(filled, tmp_path: Path) -> Path:
    shutil.copytree(filled[0], tmp_path / "programs")
    return tmp_path / "programs"


def engine_on(model, store: ProgramStore | None) -> Engine:
    cfg, params = model
    engine = Engine(cfg, params, CONFIG, "float32", store)
    engine.warmup()
    return engine


def outputs(engine: Engine) -> list[np.ndarray]:
    """A prefill, two decode steps and a sampling step: what a request runs."""
    prompt = np.array([2, 17, 99, 4, 250, 31], np.int32)
    logits = [np.asarray(engine.prefill(0, prompt, 0))]
    tokens, positions, active = np.array([7, 0]), np.array([len(prompt), 0]), np.array([1, 0])
    for _ in range(2):
        logits.append(np.asarray(engine.decode(tokens, positions, active)))
        positions = positions + active
    engine.begin_request(0, SamplingParams(temperature=0.8, top_k=20), prompt, seed=11)
    first = engine.sample_slot(0, jax.numpy.asarray(logits[0]), 0)
    sampled = engine.sample(jax.numpy.asarray(logits[-1]), active, np.array([1, 0]))
    return [*logits, first.tokens, first.logprobs, sampled.tokens, sampled.logprobs]


def test_a_second_engine_reads_every_program_back_and_computes_the_same_bits(model, tmp_path):
    store = ProgramStore(tmp_path)
    first = engine_on(model, store)
    counts = first.programs.counts()
    assert counts["from_program_store"] == 0 and store.exports == counts["total"] == counts["compiled"]
    assert len(list(tmp_path.glob(f"*{ENTRY_SUFFIX}"))) == counts["total"]
    expected = outputs(first)

    again = ProgramStore(tmp_path)
    second = engine_on(model, again)
    assert second.programs.counts()["from_program_store"] == counts["total"]
    assert again.hits == counts["total"] and again.exports == 0
    for a, b in zip(expected, outputs(second), strict=True):
        np.testing.assert_array_equal(a, b)
    # And a cold engine without any store computes the same bits (one path: every program is exported).
    for a, b in zip(expected, outputs(engine_on(model, None)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_damaged_entry_is_exported_again_never_used(model, filled, tmp_path):
    directory, expected = copy_of(filled, tmp_path), filled[1]
    entries = sorted(directory.glob(f"*{ENTRY_SUFFIX}"))
    damaged, cut = entries[0], entries[1]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:100])

    store = ProgramStore(directory)
    second = engine_on(model, store)
    assert store.exports == 2 and store.hits == len(entries) - 2
    assert second.programs.counts()["from_program_store"] == len(entries) - 2
    for a, b in zip(expected, outputs(second), strict=True):
        np.testing.assert_array_equal(a, b)
    assert store._read(damaged) is not None and store._read(cut) is not None  # rewritten whole


def test_a_good_checksum_over_an_unreadable_module_is_exported_again(model, filled, tmp_path):
    directory = copy_of(filled, tmp_path)
    entry = sorted(directory.glob(f"*{ENTRY_SUFFIX}"))[0]
    payload = b"not an exported module"
    entry.write_bytes(program_store.MAGIC + hashlib.sha256(payload).digest() + payload)
    store = ProgramStore(directory)
    engine_on(model, store)
    assert store.exports == 1 and store._read(entry) is not None


def test_another_environment_or_other_arguments_never_look_an_entry_up(model, filled, tmp_path, monkeypatch):
    directory = copy_of(filled, tmp_path)
    args = (jax.ShapeDtypeStruct((2, 8), np.int32),)
    key = program_key("decode", args)
    assert key != program_key("prefill", args)
    assert key != program_key("decode", (jax.ShapeDtypeStruct((2, 8), np.float32),))
    assert key != program_key("decode", (jax.ShapeDtypeStruct((2, 9), np.int32),))
    assert key != program_key("decode", ((jax.ShapeDtypeStruct((2, 8), np.int32),),))  # another tree
    # Edited model code, another jax or another backend: other keys, so every program is exported anew.
    monkeypatch.setattr(program_store, "environment_fingerprint", lambda: "another environment")
    store = ProgramStore(directory)
    engine = engine_on(model, store)
    assert store.hits == 0 and store.exports == engine.programs.counts()["total"]


def test_programs_exported_through_the_store_still_donate_the_cache(model, filled, tmp_path):
    engine = engine_on(model, ProgramStore(copy_of(filled, tmp_path)))
    before = jax.tree_util.tree_leaves(engine.cache)
    engine.decode(np.array([3, 0]), np.array([0, 0]), np.array([1, 0]))
    assert all(leaf.is_deleted() for leaf in before)


def test_a_program_that_cannot_be_exported_is_lowered_directly(model, filled, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("custom call outside the stable set")

    expected = filled[1]
    monkeypatch.setattr("core.programs.export.export", refuse)
    store = ProgramStore(tmp_path)
    engine = engine_on(model, store)
    assert store.exports == 0 and not list(Path(tmp_path).glob(f"*{ENTRY_SUFFIX}"))
    for a, b in zip(expected, outputs(engine), strict=True):
        np.testing.assert_array_equal(a, b)


def test_editing_any_core_source_changes_the_digest_every_key_holds(tmp_path):
    """An edited model file must never meet the module exported from its old text."""
    core = Path(program_store.__file__).parent
    shutil.copytree(core, tmp_path / "core", ignore=shutil.ignore_patterns("__pycache__"))
    before = source_digest(tmp_path / "core")
    assert before == source_digest(core)
    model = tmp_path / "core" / "model.py"
    model.write_text(model.read_text() + "\n# an edit\n")
    edited = source_digest(tmp_path / "core")
    assert edited != before
    (tmp_path / "core" / "loaders" / "new_loader.py").write_text("")  # a new file below core/ counts too
    assert source_digest(tmp_path / "core") != edited
    edited = source_digest(tmp_path / "core")
    model.rename(tmp_path / "core" / "model_renamed.py")  # and so does a renamed one
    assert source_digest(tmp_path / "core") != edited
