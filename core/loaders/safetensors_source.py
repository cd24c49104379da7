"""A Hugging Face checkpoint directory (config.json + one or more .safetensors files), memory-mapped."""

from __future__ import annotations

import json
import math
import mmap
from pathlib import Path

import ml_dtypes
import numpy as np

from .base import is_multimodal
from .errors import CheckpointError
from .hf_config import read_text_config
from .safetensors_header import TensorEntry, read_header

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Where the text model lives inside the published layouts, most specific first: Gemma 3/4 multimodal
# (new and old transformers layouts), a bare language model, a *ForCausalLM, or a bare *Model.
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.", "")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")

# The model computes in floats; anything else (int32, fp8, ...) means a wrong or pre-quantized file.
FLOAT_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}


def detect_prefix(raw_names: list[str]) -> str:
    """The prefix in front of the text model's tensor names (possibly empty)."""
    for prefix in TEXT_PREFIXES[:-1]:
        if any(n.startswith(prefix + "layers.") or n == prefix + "embed_tokens.weight" for n in raw_names):
            return prefix
    return ""


class SafetensorsSource:
    """Text-model tensors of a safetensors checkpoint directory, read one at a time through mmap."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.config: dict = read_text_config(self.path / "config.json")
        raw = _read_entries(self.path)
        self._entries = _canonical_entries(raw)
        self._maps: dict[Path, mmap.mmap] = {}

    def names(self) -> list[str]:
        """Canonical names of every text-model tensor."""
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape as stored (HF layout)."""
        return self._entry(name).shape

    def file_of(self, name: str) -> Path:
        """The .safetensors file holding `name`."""
        return self._entry(name).file

    def read(self, name: str) -> np.ndarray:
        """A read-only view of one tensor in its stored dtype; only its own pages are touched."""
        entry = self._entry(name)
        dtype = FLOAT_DTYPES[entry.dtype]
        count = math.prod(entry.shape)
        if count == 0:
            return np.empty(entry.shape, dtype)
        buffer = self._map(entry.file)
        return np.frombuffer(buffer, dtype=dtype, count=count, offset=entry.start).reshape(entry.shape)

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this checkpoint") from None

    def _map(self, file: Path) -> mmap.mmap:
        # One read-only map per file, kept for the source's lifetime; arrays handed out keep it alive too.
        if file not in self._maps:
            with file.open("rb") as handle:
                self._maps[file] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[file]

    def __repr__(self) -> str:
        return f"SafetensorsSource({str(self.path)!r}, {len(self._entries)} tensors)"


def _read_entries(directory: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint under its raw name, from the index's shards or the lone file(s)."""
    index = directory / INDEX_FILE
    if index.exists():
        return _read_sharded(index)
    single = directory / SINGLE_FILE
    files = [single] if single.exists() else sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no {INDEX_FILE}, {SINGLE_FILE} or other .safetensors file")
    entries: dict[str, TensorEntry] = {}
    for file in files:
        for name, entry in read_header(file).items():
            if name in entries:
                raise CheckpointError(f"tensor {name!r} appears in both {entries[name].file} and {file}")
            entries[name] = entry
    return entries


def _read_sharded(index: Path) -> dict[str, TensorEntry]:
    """Tensors of a sharded checkpoint, each taken from the shard the index names for it."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a readable safetensors index ({exc!r})") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: `weight_map` must map tensor names to shard file names")

    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    entries: dict[str, TensorEntry] = {}
    for shard, names in by_shard.items():
        file = index.parent / shard
        if not file.is_file():
            raise CheckpointError(
                f"{index}: shard {shard} is missing from {index.parent} (it holds tensor {names[0]!r}"
                + (f" and {len(names) - 1} more)" if len(names) > 1 else ")")
            )
        header = read_header(file)
        for name in names:
            if name not in header:
                raise CheckpointError(f"{index}: tensor {name!r} is mapped to {file}, whose header lacks it")
            entries[name] = header[name]
    return entries


def _canonical_entries(raw: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """Drop vision/audio tensors, strip the text prefix, and refuse non-float text tensors."""
    prefix = detect_prefix(list(raw))
    entries: dict[str, TensorEntry] = {}
    for raw_name, entry in raw.items():
        if is_multimodal(raw_name):
            continue
        if raw_name in LM_HEAD_NAMES:
            name = "lm_head.weight"
        elif raw_name.startswith(prefix):
            name = raw_name[len(prefix) :]
        else:
            # Outside the text model's namespace: kept verbatim so check_tensors reports it as unexpected.
            name = raw_name
        if name in entries:
            raise CheckpointError(
                f"tensor {raw_name!r} in {entry.file} and {entries[name].raw_name!r} in "
                f"{entries[name].file} both map to {name!r}"
            )
        if entry.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{entry.file}: tensor {raw_name!r} has dtype {entry.dtype}; expected F32, F16 or BF16"
            )
        entries[name] = entry
    return entries
