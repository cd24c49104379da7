"""Disk tier of the prefix cache: KV runs in files that outlive the process and can be shared by replicas.

A conversation's KV is cut into blocks of `BLOCK` positions, each block one file named by a hash chain: the
chain starts from everything that makes KV differ besides the tokens (the engine's identity: model, weights,
precision, KV dtype, max_len and the `core` sources; and the cache scope: agent, cache salt, adapter) and
takes in each block's tokens, so a file's name says which prefix it belongs to and a lookup walks the
prompt block by block, one `stat` each. The run past the last full block is kept as a tail file named by
the chain so far and its own tokens; a lookup probes the tail lengths the prompt allows, longest first.

Files are encoded and written by a background thread (the engine thread only copies the KV off the device), each as a
temporary file renamed into place, so a reader sees a whole entry or none, and two processes writing the
same entry each write a whole one. Every file carries its format, the engine identity, its positions, its
tokens and a checksum: a damaged, truncated or foreign file is deleted and counts as a miss, never served.
Checksums guard against damage, not against someone who can write the directory: it is trusted like the
model files (created 0700, files 0600; docs/reliability.md).

The directory holds at most `budget_bytes`; over it, the least recently used files go (a read or a write
sets a file's mtime, so replicas sharing the directory age files together).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy, so np.dtype("bfloat16") reads accelerators' KV
import numpy as np

from core.engine import SlotSnapshot

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the file layout changes: files of another format are never read
BLOCK = 64  # positions per full-block file
SUFFIX = ".kv"
MAGIC = b"SSKV"
_HEAD = struct.Struct("<4sII")  # magic, format, header length
DIGEST_BYTES = 32  # blake2b over everything before it
WRITE_QUEUE = 256  # pending file writes; beyond it new ones are dropped (counted), never the engine blocked
# Snapshots still on their way off the device that the queue may hold: each keeps its copy's device buffer (up to
# a whole slot's KV, ~150 MB for the E2B) until the writer reads it; beyond this the caller waits for the copy.
COPIES_IN_FLIGHT = 4
STALE_TEMP_S = 600.0  # a temporary file this old was left by a killed writer (a live one renames in ms)
Arrays = dict[str, dict[str, np.ndarray]]


def chain_start(identity: str, scope: Hashable) -> bytes:
    """The chain's first link: the engine identity and the cache scope (made of strings, numbers, None)."""
    return hashlib.blake2b(json.dumps([FORMAT, identity, repr(scope)]).encode(), digest_size=20).digest()


def chain_next(link: bytes, tokens: Sequence[int], tail: bool = False) -> bytes:
    """The link after a run of tokens: a full block's (tail False) or a tail's."""
    body = np.asarray(tokens, dtype=np.int64).tobytes()
    return hashlib.blake2b(link + (b"t" if tail else b"b") + body, digest_size=20).digest()


class DiskTier:
    """KV runs in ``directory`` under one engine ``identity``; ``budget_bytes`` bounds the directory."""

    def __init__(self, directory: Path | str, budget_bytes: int, identity: str) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self.identity = identity
        self._lock = threading.Lock()
        self._in_flight: set[int] = set()  # ids of queued snapshots not yet read by the writer
        self._counts = {"hits": 0, "misses": 0, "writes": 0, "evictions": 0, "damaged": 0, "dropped": 0,
                        "write_errors": 0}
        self._bytes, self._entries = self._scan_totals()
        # (path, start, tokens, snapshot): sliced, encoded and written on the writer thread; None: stop
        self._queue: queue.Queue[tuple[Path, int, tuple[int, ...], SlotSnapshot] | None] = queue.Queue(WRITE_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="slotserve-kv-disk", daemon=True)
        self._writer.start()

    # ---- lookups (engine thread) -------------------------------------------------------------
    def match(self, scope: Hashable, tokens: Sequence[int]) -> int:
        """How many leading positions of ``tokens`` the directory holds under ``scope`` (files exist; their
        contents are checked when fetched)."""
        return self._walk(scope, tokens)[0]

    def fetch(self, scope: Hashable, tokens: Sequence[int], start: int, end: int) -> SlotSnapshot | None:
        """The KV of positions [start, end) of ``tokens``, or None when a file on the way is missing or bad
        (bad files are deleted)."""
        held, files = self._walk(scope, tokens)
        pieces: list[Arrays] = []
        for path, lo, hi in files if 0 <= start < end <= held else ():
            if lo < end and hi > start:
                arrays = self._read(path, lo, tokens[lo:hi])
                if arrays is None:
                    break
                a, b = max(start, lo) - lo, min(end, hi) - lo
                pieces.append({k: {n: arr[a:b] for n, arr in e.items()} for k, e in arrays.items()})
        else:
            if pieces:
                self._count("hits")
                layers = {k: {n: np.concatenate([p[k][n] for p in pieces]) for n in e}
                          for k, e in pieces[0].items()}
                return SlotSnapshot(start=start, end=end, layers=layers)
        self._count("misses")
        return None

    def store_missing(self, scope: Hashable, tokens: Sequence[int], read: Callable[[int], SlotSnapshot],
                      boundaries: Sequence[int] = ()) -> int:
        """Queue what the disk lacks of ``tokens``'s KV: the full blocks not on disk and the tails (at the end
        and at each of ``boundaries``), read by ``read(start)`` as a snapshot of positions
        [start, len(tokens)). Runs shorter than a block are not kept (cheaper to recompute). Returns the
        files queued."""
        if len(tokens) < BLOCK or (not boundaries and self._walk(scope, tokens)[0] == len(tokens)):
            return 0
        start = self._walk(scope, tokens, tails=False)[0]
        if start == len(tokens):
            return 0
        return self.store(scope, tokens, read(start), boundaries)

    # ---- stores (engine thread queues, the writer thread writes) ------------------------------
    def store(self, scope: Hashable, tokens: Sequence[int], snapshot: SlotSnapshot,
              boundaries: Sequence[int] = ()) -> int:
        """Queue the files for ``tokens``'s positions that ``snapshot`` holds (it must start at a block
        boundary and end at len(tokens)): each full block not yet on disk, the tail, and a tail ending at
        each of ``boundaries`` (message boundaries: where a later prompt may diverge, as when a client
        re-renders the assistant's message differently). Returns the files queued."""
        if snapshot.start % BLOCK or snapshot.end != len(tokens):
            raise ValueError(f"a store covers [block start, len(tokens)); got [{snapshot.start}, {snapshot.end})")
        if not snapshot.ready:
            with self._lock:
                room = len(self._in_flight) < COPIES_IN_FLIGHT
                if room:
                    self._in_flight.add(id(snapshot))
            if not room:
                snapshot.layers  # noqa: B018 - made on this thread: device memory stays bounded
        queued = self._store_runs(scope, tokens, snapshot, boundaries)
        if not queued:
            self._settled(snapshot)
        return queued

    def _store_runs(self, scope: Hashable, tokens: Sequence[int], snapshot: SlotSnapshot,
                    boundaries: Sequence[int]) -> int:
        link = chain_start(self.identity, scope)
        queued = 0
        for lo in range(0, len(tokens), BLOCK):
            hi = min(lo + BLOCK, len(tokens))
            full = hi - lo == BLOCK
            if lo >= snapshot.start:
                ends = {b for b in boundaries if lo < b < hi} | ({hi} if not full else set())
                for end in sorted(ends):  # tails
                    queued += self._enqueue_run(self._path(chain_next(link, tokens[lo:end], tail=True)),
                                                tokens, lo, end, snapshot)
                path = self._path(chain_next(link, tokens[lo:hi]))
                if full and not path.exists():
                    queued += self._enqueue_run(path, tokens, lo, hi, snapshot)
            link = chain_next(link, tokens[lo:hi])
        return queued

    def _enqueue_run(self, path: Path, tokens: Sequence[int], lo: int, hi: int, snapshot: SlotSnapshot) -> int:
        """Queue positions [lo, hi) of ``snapshot``; its arrays are read on the writer thread (a snapshot still
        on its way off the device is waited for there, not by the engine thread)."""
        return self._enqueue((path, lo, tuple(tokens[lo:hi]), snapshot))

    def _settled(self, snapshot: SlotSnapshot) -> None:
        """``snapshot`` no longer holds a copy in flight for this tier (read, failed, or none of it queued)."""
        with self._lock:
            self._in_flight.discard(id(snapshot))

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued file is written (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=0.1)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "bytes_used": self._bytes, "entries": self._entries,
                    "budget_bytes": self.budget_bytes, "pending": self._queue.unfinished_tasks}

    # ---- the chain -----------------------------------------------------------------------------
    def _path(self, name: bytes) -> Path:
        return self.directory / f"{name.hex()}{SUFFIX}"

    def _walk(self, scope: Hashable, tokens: Sequence[int], tails: bool = True
              ) -> tuple[int, list[tuple[Path, int, int]]]:
        """Positions of ``tokens`` held, and the files holding them in order: full blocks, then a tail."""
        link, depth, files = chain_start(self.identity, scope), 0, []
        while depth + BLOCK <= len(tokens):
            name = chain_next(link, tokens[depth:depth + BLOCK])
            path = self._path(name)
            if not path.exists():
                break
            files.append((path, depth, depth + BLOCK))
            link, depth = name, depth + BLOCK
        if tails:
            for end in range(min(depth + BLOCK - 1, len(tokens)), depth, -1):  # the longest tail first
                path = self._path(chain_next(link, tokens[depth:end], tail=True))
                if path.exists():
                    files.append((path, depth, end))
                    return end, files
        return depth, files

    # ---- files -------------------------------------------------------------------------------
    def _encode(self, start: int, tokens: Sequence[int], arrays: Arrays) -> bytes:
        names = [(k, n) for k in sorted(arrays) for n in sorted(arrays[k])]
        meta = {"identity": self.identity, "start": start, "tokens": [int(t) for t in tokens],
                # By name: an extension dtype's .str ("<V2" for bfloat16) reads back as raw bytes.
                "arrays": [[k, n, arrays[k][n].dtype.name, list(arrays[k][n].shape)] for k, n in names]}
        header = json.dumps(meta).encode()
        body = b"".join([_HEAD.pack(MAGIC, FORMAT, len(header)), header]
                        + [np.ascontiguousarray(arrays[k][n]).tobytes() for k, n in names])
        return body + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()

    def _read(self, path: Path, start: int, tokens: Sequence[int]) -> Arrays | None:
        """A file's arrays, cut to ``len(tokens)`` positions, if it is whole and for this run; else None
        (and the file is deleted, unless it vanished meanwhile)."""
        try:
            data = path.read_bytes()
        except OSError:
            return None
        arrays = self._decode(data, start, tokens)
        if arrays is None:
            log.warning("disk KV tier: %s is damaged or foreign; deleted", path.name)
            self._count("damaged")
            self._delete(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)
        return arrays

    def _decode(self, data: bytes, start: int, tokens: Sequence[int]) -> Arrays | None:
        if len(data) < _HEAD.size + DIGEST_BYTES:
            return None
        body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
        if hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest:
            return None
        magic, fmt, size = _HEAD.unpack_from(body)
        if magic != MAGIC or fmt != FORMAT:
            return None
        try:
            meta = json.loads(body[_HEAD.size:_HEAD.size + size])
        except ValueError:
            return None
        n = len(tokens)
        if (meta.get("identity") != self.identity or meta.get("start") != start
                or meta.get("tokens", [])[:n] != [int(t) for t in tokens] or len(meta["tokens"]) < n):
            return None
        arrays: Arrays = {}
        offset = _HEAD.size + size
        for key, name, dtype, shape in meta["arrays"]:
            try:
                kind = np.dtype(dtype)
            except TypeError:  # a dtype this process does not know
                return None
            if kind.type is np.void:  # raw bytes: how a version that wrote dtype.str saved bfloat16 ("<V2")
                return None
            array = np.frombuffer(body, kind, int(np.prod(shape)), offset).reshape(shape)
            offset += array.nbytes
            arrays.setdefault(key, {})[name] = array[:n]
        return arrays if offset == len(body) else None

    def _enqueue(self, item: tuple[Path, int, tuple[int, ...], SlotSnapshot]) -> int:
        try:
            self._queue.put_nowait(item)
            return 1
        except queue.Full:
            self._count("dropped")
            return 0

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                path, start, tokens, snapshot = item
                cut = start - snapshot.start
                try:
                    layers = snapshot.layers
                finally:
                    self._settled(snapshot)
                arrays = {k: {n: a[cut:cut + len(tokens)] for n, a in e.items()} for k, e in layers.items()}
                self._write(path, self._encode(start, tokens, arrays))
            except Exception:  # noqa: BLE001 - a failed write (disk full, permissions) loses only that entry
                log.exception("disk KV tier: writing an entry failed")
                self._count("write_errors")
            finally:
                self._queue.task_done()

    def _write(self, path: Path, data: bytes) -> None:
        temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        existed = path.exists()
        old = path.stat().st_size if existed else 0
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._counts["writes"] += 1
            self._bytes += len(data) - old
            self._entries += 0 if existed else 1
        if self._bytes > self.budget_bytes:
            self._evict(keep=path)

    def _evict(self, keep: Path) -> None:
        """Delete the least recently used files until the directory fits the budget (rescanned: other
        processes write here too)."""
        files = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(SUFFIX) and entry.path != str(keep):
                try:
                    stat = entry.stat()
                except OSError:
                    continue
                files.append((stat.st_mtime_ns, stat.st_size, Path(entry.path)))
        total = sum(size for _, size, _ in files) + (keep.stat().st_size if keep.exists() else 0)
        removed = 0
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total <= self.budget_bytes:
                break
            if self._delete(path):
                total -= size
                removed += 1
        with self._lock:
            self._bytes, self._entries = total, len(files) + 1 - removed
            self._counts["evictions"] += removed

    def _delete(self, path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False

    def _scan_totals(self) -> tuple[int, int]:
        total = count = 0
        for entry in os.scandir(self.directory):
            if entry.name.endswith(SUFFIX):
                try:
                    total += entry.stat().st_size
                    count += 1
                except OSError:
                    continue
            elif entry.name.endswith(".tmp") and _older_than(entry, STALE_TEMP_S):  # left by a killed writer
                Path(entry.path).unlink(missing_ok=True)
        return total, count

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1


def _older_than(entry: os.DirEntry, seconds: float) -> bool:
    try:
        return time.time() - entry.stat().st_mtime > seconds
    except OSError:
        return False
