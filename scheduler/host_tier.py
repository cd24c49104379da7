"""Host-memory tier of the prefix cache: KV snapshots keyed by the exact token prefix they cover.

When a slot is recycled, its KV state can be copied to host memory (a snapshot) so that a later request
whose prompt starts with the same tokens restores it instead of recomputing the prefill. A snapshot is only
valid for exactly the tokens it was computed from, so lookups return the longest stored key that is a
prefix of the new prompt; the caller prefills the rest.

Host memory is bounded by a byte budget with least-recently-used eviction. "Used" means stored or returned
by `lookup`; `contains` is a pure query and does not refresh an entry (so probing does not keep cold
entries alive). A snapshot's size is read from its `nbytes` once, at `put`.

All methods take one lock: the engine thread stores and looks up, the metrics endpoint reads `stats()`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np

from scheduler.prefix_index import Key, PrefixIndex, as_key


class HasNbytes(Protocol):
    @property
    def nbytes(self) -> int: ...


S = TypeVar("S", bound=HasNbytes)


class HostTier(Generic[S]):
    """Byte-budgeted LRU store of snapshots with longest-prefix lookup."""

    def __init__(self, budget_bytes: int) -> None:
        if not isinstance(budget_bytes, int | np.integer) or isinstance(budget_bytes, bool) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        self._budget = int(budget_bytes)
        self._index: PrefixIndex[S] = PrefixIndex()
        # key -> nbytes, least recently used first. The size is cached so accounting stays exact even if a
        # snapshot object's nbytes were to change after it was stored.
        self._lru: OrderedDict[Key, int] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._lock = threading.Lock()

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def entries(self) -> int:
        with self._lock:
            return len(self._lru)

    def __len__(self) -> int:
        return self.entries

    def put(self, tokens: Sequence[int] | np.ndarray, snapshot: S) -> bool:
        """Store `snapshot` under exactly `tokens`, replacing an entry with the same key and evicting LRU entries
        until it fits. Returns False, changing nothing (an existing entry under this key stays), if the snapshot
        alone exceeds the budget."""
        key = as_key(tokens)
        size = int(snapshot.nbytes)
        if size < 0:
            raise ValueError(f"snapshot.nbytes must be non-negative, got {size}")
        if size > self._budget:
            return False
        with self._lock:
            self._index.insert(key, snapshot)  # validates the key (empty -> ValueError) before any eviction
            old = self._lru.pop(key, None)
            if old is not None:
                self._bytes -= old
            while self._bytes + size > self._budget:
                victim, victim_size = self._lru.popitem(last=False)  # non-empty: size <= budget
                self._index.remove(victim)
                self._bytes -= victim_size
                self._evictions += 1
            self._lru[key] = size
            self._bytes += size
        return True

    def lookup(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, S] | None:
        """(matched length, snapshot) for the longest stored key that is a prefix of `tokens`, or None. A hit
        makes that entry the most recently used."""
        key = as_key(tokens)
        with self._lock:
            found = self._index.longest_prefix(key)
            if found is None:
                self._misses += 1
                return None
            self._hits += 1
            self._lru.move_to_end(key[: found[0]])
            return found

    def contains(self, tokens: Sequence[int] | np.ndarray) -> bool:
        """Whether exactly this key is stored. Does not touch the LRU order or the hit/miss counts."""
        key = as_key(tokens)
        with self._lock:
            return key in self._lru

    def discard(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Drop the entry stored under exactly this key, if any (not counted as an eviction)."""
        key = as_key(tokens)
        with self._lock:
            size = self._lru.pop(key, None)
            if size is not None:
                self._index.remove(key)
                self._bytes -= size

    def clear(self) -> None:
        """Drop every entry; the counters are kept."""
        with self._lock:
            self._index.clear()
            self._lru.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
                "bytes_used": self._bytes,
                "entries": len(self._lru),
                "budget_bytes": self._budget,
            }
