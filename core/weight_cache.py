"""Prepared weights kept on disk: the parameters exactly as the engine takes them (dequantized, quantized to
W8A8 and rotated, fused), so that a restart reads them back instead of preparing them again.

A cache file is a safetensors file named by its key: the checkpoint's identity (a GGUF file's content hash,
remembered beside the file's stats so that an unchanged file is not read again; for a checkpoint
directory, its files' names, sizes and modification times), the preparation settings and `FORMAT`. Its
metadata holds the key again, the parameter tree's shape and a SHA-256 of the tensors; a file whose key or
checksum does not match is not used (it is rebuilt). Writes go to a temporary file that is renamed into
place, so a crash never leaves a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from core.file_memo import content_hash, remembered

log = logging.getLogger(__name__)

FORMAT = 1  # bump whenever what the loaders prepare changes (the old files then no longer match)


def checkpoint_identity(path: Path, memo_dir: Path | None = None) -> str:
    """What identifies the checkpoint's bytes: a single file's content hash (remembered in ``memo_dir``
    while the file is unchanged, `core.file_memo`), or a directory's file stats."""
    if path.is_file():
        return remembered(path, "sha256", lambda: content_hash(path), memo_dir)
    digest = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        stat = f.stat()
        digest.update(f"{f.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def cache_key(identity: str, settings: dict[str, Any]) -> str:
    text = json.dumps({"format": FORMAT, "checkpoint": identity, "settings": settings}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _flatten(tree: Any, prefix: str, out: dict[str, np.ndarray]) -> Any:
    """The tree's shape with every array replaced by its name; the arrays go into ``out``."""
    if isinstance(tree, dict):
        return {k: _flatten(v, f"{prefix}{k}.", out) for k, v in tree.items()}
    if isinstance(tree, list):
        return {"__list__": [_flatten(v, f"{prefix}{i}.", out) for i, v in enumerate(tree)]}
    if tree is None:
        return None
    name, array = prefix[:-1], np.asarray(tree)
    if array.dtype.name == "bfloat16":  # safetensors' numpy side has no bfloat16: stored as its bits
        out[name] = array.view(np.uint16)
        return {"__array__": name, "bfloat16": True}
    out[name] = array
    return {"__array__": name}


def _unflatten(shape: Any, arrays: dict[str, np.ndarray], place: Any) -> Any:
    if shape is None:
        return None
    if "__array__" in shape:
        array = arrays[shape["__array__"]]
        return place(array.view(jnp.bfloat16) if shape.get("bfloat16") else array)
    if "__list__" in shape:
        return [_unflatten(v, arrays, place) for v in shape["__list__"]]
    return {k: _unflatten(v, arrays, place) for k, v in shape.items()}


def _checksum(arrays: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(memoryview(np.ascontiguousarray(arrays[name])).cast("B"))  # the bytes, not a copy
    return digest.hexdigest()


def save(directory: Path, key: str, params: dict[str, Any]) -> Path | None:
    """Write the prepared parameters; None (and a log line) when they cannot be stored (e.g. a dtype
    safetensors' numpy side does not know), in which case the next start prepares them again."""
    from safetensors.numpy import save_file

    arrays: dict[str, np.ndarray] = {}
    shape = _flatten(params, "", arrays)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{key}.safetensors"
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    try:
        save_file(arrays, str(tmp), metadata={"key": key, "tree": json.dumps(shape), "sha256": _checksum(arrays)})
        os.replace(tmp, target)
    except (ValueError, TypeError, OSError) as e:
        log.warning("prepared weights not cached: %s", e)
        tmp.unlink(missing_ok=True)
        return None
    return target


def load(directory: Path, key: str, place: Any) -> dict[str, Any] | None:
    """The prepared parameters stored under ``key`` (each array through ``place``, e.g. `jax.device_put`);
    None when there are none, or the file's key or checksum does not match (a stale or corrupt file)."""
    from safetensors import SafetensorError, safe_open

    path = directory / f"{key}.safetensors"
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            arrays = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - a safe_open, not a dict
    except (SafetensorError, OSError, ValueError) as e:
        log.warning("prepared weights at %s unreadable (%s): preparing them again", path, e)
        return None
    if meta.get("key") != key or meta.get("sha256") != _checksum(arrays):
        log.warning("prepared weights at %s do not match their key or checksum: preparing them again", path)
        return None
    return _unflatten(json.loads(meta["tree"]), arrays, place)
