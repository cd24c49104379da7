"""The persistent XLA compilation cache, checked before JAX reads it.

JAX keys each entry by everything that fixes the compiled program (the lowered module, compile options,
jaxlib and backend versions), so a stale entry is never looked up. A damaged one is: JAX writes entries in
place (a crash mid-write leaves a truncated file), and on an unreadable entry it warns, compiles the program
again and keeps the damaged file, since it never overwrites an existing key. So at start-up every entry is
checked first: one this cache has seen before must still have the SHA-256 recorded for it in
`MANIFEST`; a new one must decompress. Any other is deleted, so that this start compiles the program again
and JAX stores a good entry in its place.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import zlib
from pathlib import Path

from core.device import default_cache_dir
from core.json_file import read_json_dict, write_json_atomic

log = logging.getLogger(__name__)

MANIFEST = "slotserve-manifest.json"  # entry file name -> SHA-256 of its bytes when first seen whole
ENTRY_SUFFIX = "-cache"  # JAX's name for an entry file: <module>-<key>-cache


def enable_compile_cache(directory: Path | None = None) -> Path:
    """Persist compiled programs so that a restart does not pay the compile again (damaged entries are
    deleted first: `drop_damaged_entries`)."""
    import jax

    path = Path(directory) if directory else default_cache_dir() / "xla"
    path.mkdir(parents=True, exist_ok=True)
    drop_damaged_entries(path)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def drop_damaged_entries(path: Path) -> list[str]:
    """Delete every entry whose bytes differ from those recorded, or that is new and does not decompress;
    record the new good ones. Returns the names deleted."""
    recorded = read_json_dict(path / MANIFEST)
    kept: dict[str, str] = {}
    dropped: list[str] = []
    for entry in sorted(path.glob(f"*{ENTRY_SUFFIX}")):
        with contextlib.suppress(FileNotFoundError):  # another process sharing the cache removed it
            data = entry.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            known = recorded.get(entry.name)
            if digest == known or (known is None and _decompresses(data)):
                kept[entry.name] = digest
                continue
            log.warning("compiled program %s in the XLA cache is damaged: deleted, it will be compiled again",
                        entry.name)
            entry.unlink(missing_ok=True)
            dropped.append(entry.name)
    if kept != recorded:
        write_json_atomic(path / MANIFEST, kept)  # read-only: entries are decompressed every start
    return dropped


def _decompresses(data: bytes) -> bool:
    """Whether an entry decompresses as JAX wrote it (zstandard when installed, else zlib)."""
    try:
        import zstandard
    except ImportError:
        zstandard = None
    try:
        if zstandard is not None:
            zstandard.ZstdDecompressor().decompress(data)
        else:
            zlib.decompress(data)
    except Exception:  # zstandard.ZstdError, zlib.error: any failure means the entry cannot be used
        return False
    return True
