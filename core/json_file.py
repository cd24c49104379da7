"""Small files the caches keep beside their entries (a manifest, a memo, an exported program): read
leniently, replaced atomically, so a crash or a damaged file costs only recomputing what it remembered."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def read_json_dict(path: Path) -> dict[str, Any]:
    """The JSON object stored at ``path``; {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_json_object(path: Path) -> dict[str, Any]:
    """The JSON object stored at ``path``, strictly: FileNotFoundError when it is missing, ValueError saying
    why when it is unreadable or not an object (for files a user supplies, where a silent {} would mislead)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    return data


def write_json_atomic(path: Path, data: dict[str, Any]) -> bool:
    """Replace ``path`` with ``data`` through a temporary file; False (and a log line) when it cannot be
    written, e.g. a read-only cache."""
    return write_bytes_atomic(path, json.dumps(data, indent=0, sort_keys=True).encode())


def write_bytes_atomic(path: Path, data: bytes) -> bool:
    """Replace ``path`` with ``data`` through a temporary file (a crash never leaves half a file); False (and
    a log line) when it cannot be written."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("%s not written: %s", path, e)
        tmp.unlink(missing_ok=True)
        return False
    return True
