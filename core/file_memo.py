"""Values computed from a file's bytes (a content hash, a cache key), remembered beside the file's stats.

A restart asks again for the same values of the same unchanged files: reading a 250 MB checkpoint to hash
it, or parsing a GGUF header of 262k vocabulary strings to key its tokenizer, costs seconds each time. A
remembered value is used while the file's size, modification and change times and inode are the ones it
was computed from (rewriting a file changes its change time even when its modification time is restored).
The memo is one small JSON file per cache directory, replaced atomically; a damaged or unwritable memo
only means computing again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from core.json_file import read_json_dict, write_json_atomic

MEMO_FILE = "file-memo.json"  # "<kind>:<resolved path>" -> {"stats": [...], "value": str}
_HASH_CHUNK = 1 << 20


def remembered(path: Path, kind: str, compute: Callable[[], str], memo_dir: Path | None) -> str:
    """``compute()`` for the file at ``path``, or the value remembered in ``memo_dir`` for this ``kind`` of
    value while the file is unchanged. No ``memo_dir``: always computed."""
    if memo_dir is None:
        return compute()
    entry, stats = f"{kind}:{path.resolve()}", file_stats(path)
    memo = read_json_dict(memo_dir / MEMO_FILE)
    known = memo.get(entry)
    if isinstance(known, dict) and known.get("stats") == stats and isinstance(known.get("value"), str):
        return known["value"]
    value = compute()
    memo[entry] = {"stats": stats, "value": value}
    write_json_atomic(memo_dir / MEMO_FILE, memo)
    return value


def file_stats(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def content_hash(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
