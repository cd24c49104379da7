"""Prepared weights kept on disk: a second load reads them back (the same arrays), a corrupt or stale file
is detected by its checksum or key and rebuilt, never used."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from core.runtime import load_model


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints, default_gguf, tmp_path_factory):
    """The tiny Gemma 3 checkpoint with a tokenizer beside it (load_model reads one)."""
    import shutil

    from core.tokenizer import Tokenizer

    directory = tmp_path_factory.mktemp("tiny-with-tokenizer")
    shutil.copytree(tiny_checkpoints["gemma3"][0], directory, dirs_exist_ok=True)
    Tokenizer.from_pretrained(default_gguf).save(directory)
    return directory


def leaves(params) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]


def same(a, b) -> bool:
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb,
                                                                                                    strict=True))


@pytest.mark.parametrize(("precision", "dtype"), [("w8a8", "float32"), ("float", "float32"), ("float", "bfloat16")])
def test_a_second_load_reads_the_prepared_weights_back(checkpoint, tmp_path, precision, dtype):
    directory = checkpoint  # the dtype is given: chosen by a timing otherwise, which may differ between loads
    first = load_model(directory, dtype=dtype, precision=precision, weights_cache=tmp_path)
    assert not first.weights_from_cache and len(list(tmp_path.glob("*.safetensors"))) == 1
    second = load_model(directory, dtype=dtype, precision=precision, weights_cache=tmp_path)
    assert second.weights_from_cache and same(first.params, second.params)


def test_a_corrupt_or_stale_cache_file_is_rebuilt_not_used(checkpoint, tmp_path):
    directory = checkpoint
    first = load_model(directory, dtype="float32", precision="w8a8", weights_cache=tmp_path)
    [cached] = tmp_path.glob("*.safetensors")
    data = bytearray(cached.read_bytes())
    data[-1] ^= 0xFF  # one byte of tensor data changed
    cached.write_bytes(bytes(data))
    again = load_model(directory, dtype="float32", precision="w8a8", weights_cache=tmp_path)
    assert not again.weights_from_cache and same(first.params, again.params)  # the checksum caught it
    assert load_model(directory, dtype="float32", precision="w8a8", weights_cache=tmp_path).weights_from_cache
    other = load_model(directory, dtype="float32", precision="float", weights_cache=tmp_path)  # another key
    assert not other.weights_from_cache
    cached.write_bytes(b"not a safetensors file")
    assert not load_model(directory, dtype="float32", precision="w8a8", weights_cache=tmp_path).weights_from_cache


def test_a_checkpoint_files_hash_is_remembered_until_the_file_changes(tmp_path):
    import hashlib
    import os

    from core.file_memo import MEMO_FILE
    from core.weight_cache import checkpoint_identity

    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights v1")
    memo = tmp_path / "cache"
    first = checkpoint_identity(model, memo)
    assert first == hashlib.sha256(b"weights v1").hexdigest() and (memo / MEMO_FILE).exists()
    # The remembered hash is what a restart uses: proven by a memo entry no hash of the file could give.
    data = json.loads((memo / MEMO_FILE).read_text())
    data[f"sha256:{model.resolve()}"]["value"] = "remembered"
    (memo / MEMO_FILE).write_text(json.dumps(data))
    assert checkpoint_identity(model, memo) == "remembered"
    # A rewritten file (same size, even with its old modification time) is hashed again.
    stat = model.stat()
    model.write_bytes(b"weights v2")
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert checkpoint_identity(model, memo) == hashlib.sha256(b"weights v2").hexdigest()
    (memo / MEMO_FILE).write_text("not json")  # a damaged memo: the file is hashed again
    assert checkpoint_identity(model, memo) == hashlib.sha256(b"weights v2").hexdigest()
