"""Exported programs kept on disk: each step's traced and lowered module (`jax.export`), so that a restart
neither traces nor lowers the model again.

Tracing and lowering a decode or prefill step holds the GIL for most of a second, and a start-up with warm
caches is GIL-bound: this is most of what a restart spends on its programs besides loading the compiled
executables from the XLA cache. Every program goes through its exported module, on a first start as on a
restart, so both compile the same module (the same XLA cache entry, the same executable bit for bit).

An entry is named by its key: everything that fixes the module (the step function and its static arguments,
the abstract arguments' shapes, dtypes and tree, the source of the `core` package, the versions of Python,
jax, jaxlib, numpy and ml_dtypes, the backend, and the jax settings that change tracing), so a stale entry
is never looked up. Its bytes carry a SHA-256 of the serialized module; an entry that fails it, or that
does not deserialize, is deleted and the program is exported again. Writes are atomic.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import jax
from jax import export

from core.json_file import write_bytes_atomic

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what an entry holds changes
MAGIC = b"slotserve-exported\n"
ENTRY_SUFFIX = ".jaxexport"
# jax settings that change what a traced program computes (the rest: caches, logging, debugging aids).
_TRACING_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion",
                     "jax_numpy_rank_promotion", "jax_threefry_partitionable", "jax_softmax_custom_jvp",
                     "jax_high_dynamic_range_gumbel", "jax_default_prng_impl", "jax_random_seed_offset",
                     "jax_explicit_x64_dtypes")
_CORE = Path(__file__).resolve().parent


@cache
def _register_pytree_types() -> None:
    """Exported modules record their argument trees; named tuples among them need a serialized name."""
    from core.sampling import DryState, SamplerState

    export.register_namedtuple_serialization(SamplerState, serialized_name="slotserve.SamplerState")
    export.register_namedtuple_serialization(DryState, serialized_name="slotserve.DryState")


@cache
def environment_fingerprint() -> str:
    """What every entry depends on besides its own function: the `core` sources, versions, backend, settings."""
    import jaxlib
    import ml_dtypes
    import numpy as np

    digest = hashlib.sha256(source_digest(_CORE).encode())
    settings = {name: str(jax.config.values.get(name)) for name in _TRACING_SETTINGS}
    versions = [sys.version, platform.machine(), jax.__version__, jaxlib.__version__, np.__version__,
                ml_dtypes.__version__, jax.default_backend()]
    digest.update(json.dumps({"format": FORMAT, "versions": versions, "settings": settings}).encode())
    return digest.hexdigest()


def source_digest(directory: Path) -> str:
    """A SHA-256 over the names and bytes of every Python file below ``directory``."""
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*.py")):
        digest.update(f"{path.relative_to(directory)}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def program_key(identity: str, args: tuple[Any, ...]) -> str:
    """An entry's key: the program's ``identity`` (its function and static arguments, as a string), the
    abstract arguments and the environment."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    avals = [f"{leaf.shape}:{leaf.dtype}" for leaf in leaves]
    text = json.dumps({"identity": identity, "tree": str(tree), "avals": avals, "env": environment_fingerprint()})
    return hashlib.sha256(text.encode()).hexdigest()[:40]


class ProgramStore:
    """A directory of exported programs. ``hits`` and ``exports`` count what this process read and wrote."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.hits = 0
        self.exports = 0

    def path_for(self, key: str) -> Path:
        return self.directory / f"{key}{ENTRY_SUFFIX}"

    def exported(self, key: str, make: Callable[[], export.Exported]) -> tuple[export.Exported, bool]:
        """The entry for ``key``, or ``make()`` stored under it; and whether it came from the store."""
        _register_pytree_types()
        path = self.path_for(key)
        found = self._read(path)
        if found is not None:
            self.hits += 1
            return found, True
        exported = make()
        payload = exported.serialize()
        write_bytes_atomic(path, MAGIC + hashlib.sha256(payload).digest() + bytes(payload))
        self.exports += 1
        return exported, False

    def _read(self, path: Path) -> export.Exported | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("exported program %s unreadable (%s): exporting it again", path.name, e)
            return None
        head, payload = data[:len(MAGIC) + 32], data[len(MAGIC) + 32:]
        if head[:len(MAGIC)] == MAGIC and head[len(MAGIC):] == hashlib.sha256(payload).digest():
            try:
                return export.deserialize(bytearray(payload))
            except Exception as e:  # a bad payload under a good checksum: written by an incompatible version
                log.warning("exported program %s does not deserialize (%s): exporting it again", path.name, e)
        else:
            log.warning("exported program %s is damaged: deleted, it will be exported again", path.name)
        path.unlink(missing_ok=True)
        return None
