"""`AdapterLibrary`: the LoRA adapters agents name, read once per file version, and where an adapter named over
HTTP may come from (docs/lora.md, "Who may load what").

An agent's `adapter` is a PEFT directory. Agents from YAML files are trusted like the config itself: their
paths load as written (relative ones from the file's directory, `agents.registry.load_agent_file`). A path
that arrives over HTTP (the admin API, vLLM's load route) loads only when the operator named adapter
directories (`adapters.dirs`, `slotserve serve --adapter-dir`) and it lies inside one of them once resolved:
`..`, symlinks and absolute paths that leave them are refused, so a client can never make the server read an
arbitrary file. Every refusal and every malformed adapter is an `InvalidRequestError` naming the problem.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from agents.errors import InvalidRequestError
from core.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterError, LoraAdapter

__all__ = ["AdapterLibrary"]

Reader = Callable[[Path], LoraAdapter]  # core.lora.read_adapter bound to the model and the maximum rank


class AdapterLibrary:
    def __init__(self, read: Reader | None, dirs: Sequence[str | Path] = ()) -> None:
        """``read``: reads and checks one adapter directory (None: this server runs no adapters); ``dirs``: the
        directories adapters named over HTTP must lie in (none: loading at run time is off)."""
        self._read = read
        self.dirs = [Path(d).resolve() for d in dirs]
        self._lock = threading.Lock()
        self._cache: dict[Path, tuple[tuple[int, ...], LoraAdapter]] = {}

    @property
    def enabled(self) -> bool:
        return self._read is not None

    def allowed_path(self, path: str) -> Path:
        """``path`` (from a client) resolved inside an adapter directory, or InvalidRequestError."""
        if not self.dirs:
            raise _refused("loading adapters at run time is off on this server: the operator names adapter "
                           "directories with adapters.dirs or slotserve serve --adapter-dir")
        given = Path(path)
        for candidate in [given] if given.is_absolute() else [d / given for d in self.dirs]:
            resolved = candidate.resolve()
            if any(resolved.is_relative_to(d) for d in self.dirs):
                return resolved
        raise _refused(f"adapter path {path!r} is not inside an adapter directory of this server")

    def load(self, path: str, trusted: bool) -> LoraAdapter:
        """The adapter at ``path`` (``trusted``: from a config file, any path), read and checked against the
        model; re-read when its files change. InvalidRequestError when it is refused or malformed."""
        if self._read is None:
            raise _refused("this server runs no LoRA adapters (adapters.slots is 0)")
        directory = Path(path).resolve() if trusted else self.allowed_path(path)
        version = _version(directory)
        with self._lock:
            cached = self._cache.get(directory)
            if cached is not None and cached[0] == version:
                return cached[1]
        try:
            adapter = self._read(directory)
        except AdapterError as e:
            raise InvalidRequestError(str(e), "adapter", code="invalid_adapter") from None
        with self._lock:
            self._cache[directory] = (version, adapter)
        return adapter

    def forget(self, path: str) -> None:
        """Drop a path's adapter from memory (its agent was deleted); a later load reads it again."""
        with self._lock:
            self._cache.pop(Path(path).resolve(), None)


def _version(directory: Path) -> tuple[int, ...]:
    """What tells a re-written adapter from the one read before: its files' sizes and modification times."""
    stamp: list[int] = []
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        try:
            info = (directory / name).stat()
            stamp += [info.st_size, info.st_mtime_ns]
        except OSError:
            stamp += [-1, -1]
    return tuple(stamp)


def _refused(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, "adapter", code="invalid_adapter")
