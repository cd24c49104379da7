"""Parsing and checking one safetensors file's header, without touching its tensor data."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError

# The format's own cap (safetensors refuses larger headers); it also stops a garbage length from
# making us read gigabytes as "JSON".
MAX_HEADER_BYTES = 100 * 1024 * 1024

# Bytes per element of every dtype the format defines; the sub-byte float types are skipped in the
# size check, since their byte count is not a whole number of elements.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
SUB_BYTE_DTYPES = frozenset({"F4", "F6_E2M3", "F6_E3M2"})


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: absolute byte offsets into `file`."""

    file: Path
    raw_name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Every tensor the header of `file` declares, checked against the file's real size.

    A header that claims bytes past the end of the file (a truncated download) is reported here, at
    open time, naming the first tensor that does not fit.
    """
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{file}: malformed safetensors header (file is only {size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len == 0 or header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{file}: malformed safetensors header (declared header length {header_len}, "
                    f"file size {size})"
                )
            raw = handle.read(header_len)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: safetensors file is missing") from None
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read ({exc})") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: malformed safetensors header (not JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: malformed safetensors header (not a JSON object)")

    data_start = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry = _entry(file, name, info, data_start)
        if entry.end > size:
            raise CheckpointError(
                f"{file}: tensor {name!r} ends at byte {entry.end} but the file has only {size} bytes "
                "(truncated download?)"
            )
        entries[name] = entry
    return entries


def _entry(file: Path, name: str, info: object, data_start: int) -> TensorEntry:
    """Validate one header record and turn it into absolute offsets."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{file}: malformed safetensors header for tensor {name!r}: {why}")

    if not isinstance(info, dict):
        raise bad("record is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or (dtype not in DTYPE_BYTES and dtype not in SUB_BYTE_DTYPES):
        raise bad(f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise bad(f"bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"bad data_offsets {offsets!r}")
    begin, end = offsets
    if dtype in DTYPE_BYTES and end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise bad(f"{end - begin} bytes for shape {shape} of {dtype}")
    return TensorEntry(file, name, dtype, tuple(shape), data_start + begin, data_start + end)
