"""The one GGUF header reader: a llama.cpp GGUF file's key/value metadata and tensor directory.

gguf.GGUFReader builds several numpy views per element of every metadata array, which takes ~13-15 s for
Gemma's 262k-token vocabulary (tokens, scores, token types). This walks the header with struct instead,
well under a second with every array read in full, so both the model loader (config keys, tensors) and
the tokenizer (the whole ``tokenizer.ggml.*`` vocabulary) read the file through it. Tensor data is not
read here: each tensor's `data` is a read-only view of the memory-mapped file, shaped as gguf.GGUFReader
shapes it (plain float and integer types as their dtype, quantized ones as uint8 blocks per row).

Only little-endian files of GGUF version 2 or 3 are read (what llama.cpp writes on every common host).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

__all__ = ["GGUFHeader", "GGUFTensor", "SkippedStrings", "read_gguf_header"]

# gguf.GGUFValueType ids -> struct formats for the fixed-size scalar types.
_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numbers; every other type is blocks of bytes (as gguf.GGUFReader has it).
_PLAIN_DTYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the directory: shape in GGUF order (ne, fastest-varying dimension first), data_offset
    from the start of the file, data a read-only view of the file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int
    data: np.ndarray


@dataclass(frozen=True)
class SkippedStrings:
    """The value of a string array not read (``read_gguf_header(..., string_arrays=False)``): its length."""

    count: int


@dataclass(frozen=True)
class GGUFHeader:
    """metadata: key -> value (str, int, float, bool, or a list of those), in file order; spans: key -> the
    (start, end) byte range of its whole entry in the file (key, type and value); tensors in file order."""

    metadata: dict[str, Any]
    spans: dict[str, tuple[int, int]]
    tensors: list[GGUFTensor]


def read_gguf_header(path: str | Path, string_arrays: bool = True) -> GGUFHeader:
    """The metadata and tensor directory of the GGUF file at `path`; ValueError (or struct.error, on a file
    cut short inside its header) when it is not a readable GGUF. ``string_arrays=False``: arrays of strings
    (the vocabulary, the merges) are stepped over and stand as `SkippedStrings`, for a reader that needs
    the model's keys and tensors only (decoding 262k strings is most of the header's time)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version} (big-endian or v1?)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        off = 24
        metadata: dict[str, Any] = {}
        spans: dict[str, tuple[int, int]] = {}
        for _ in range(n_kv):
            start = off
            key, off = _read_str(buf, off)
            (vtype,) = struct.unpack_from("<I", buf, off)
            metadata[key], off = _read_value(buf, off + 4, vtype, string_arrays)
            spans[key] = (start, off)
        directory = []
        for _ in range(n_tensors):
            name, off = _read_str(buf, off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            raw_type, offset = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            directory.append((name, dims, raw_type, offset))
        size = len(buf)

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: invalid general.alignment {alignment!r} (must be a power of two)")
    data_start = -(-off // alignment) * alignment
    tensors: list[GGUFTensor] = []
    if directory:
        data = np.memmap(path, mode="r")
        seen: set[str] = set()
        for name, dims, raw_type, offset in directory:
            if name in seen:
                raise ValueError(f"{path}: duplicated tensor {name!r}")
            seen.add(name)
            tensor_type = GGMLQuantizationType(raw_type)
            n_elements = int(np.prod(dims))
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            n_bytes = n_elements * type_size // block_size
            np_shape = tuple(reversed(dims))
            dtype = _PLAIN_DTYPES.get(tensor_type)
            if dtype is None:
                dtype, np_shape = np.uint8, quant_shape_to_byte_shape(np_shape, tensor_type)
            begin = data_start + offset
            if begin + n_bytes > size:
                raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
            view = data[begin:begin + n_bytes].view(dtype).reshape(np_shape)
            tensors.append(GGUFTensor(name, tensor_type, tuple(dims), begin, view))
    return GGUFHeader(metadata, spans, tensors)


def _read_str(buf: mmap.mmap, off: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    off += 8
    # surrogateescape keeps a malformed token round-trippable instead of failing the whole load.
    return buf[off : off + n].decode("utf-8", "surrogateescape"), off + n


def _read_value(buf: mmap.mmap, off: int, vtype: int, string_arrays: bool = True) -> tuple[Any, int]:
    if vtype == _STRING:
        return _read_str(buf, off)
    if vtype in _SCALAR_FMT:
        fmt = "<" + _SCALAR_FMT[vtype]
        return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)
    if vtype != _ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype}")
    itype, count = struct.unpack_from("<IQ", buf, off)
    off += 12
    if itype in _SCALAR_FMT:  # one bulk unpack instead of `count` calls
        fmt = f"<{count}{_SCALAR_FMT[itype]}"
        return list(struct.unpack_from(fmt, buf, off)), off + struct.calcsize(fmt)
    if itype == _STRING and not string_arrays:
        for _ in range(count):
            off += 8 + struct.unpack_from("<Q", buf, off)[0]
        if off > len(buf):
            raise ValueError("a string array runs past the end of the file")
        return SkippedStrings(count), off
    items = []
    for _ in range(count):
        item, off = _read_value(buf, off, itype)
        items.append(item)
    return items, off
