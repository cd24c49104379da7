"""Requests waiting for a slot: one queue per request group, taken in a fair share across groups.

The count of waiting requests is reserved when a request is submitted (any thread, under a lock, so the bound
on waiting requests holds even before the engine thread has seen it) and released when the request is
admitted, cancelled or ended. Queues are only touched on the engine thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler.request import QueueFullError

if TYPE_CHECKING:
    from scheduler.sequence import Sequence

__all__ = ["Admission"]


class Admission:
    """Stride scheduling across groups: the group with the smallest pass goes next and its pass grows by
    1/priority, so a group of priority 3 is admitted three times as often as one of priority 1 while both
    wait; a group that starts waiting joins at the smallest active pass (no credit banked while idle)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._queues: dict[str, deque[Sequence]] = {}
        self._passes: dict[str, float] = {}
        self._lock = threading.Lock()
        self._count = 0

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted, cancelled or ended (any thread)."""
        return self._count

    def reserve(self) -> None:
        """Count a new request (any thread); QueueFullError when ``limit`` are already waiting."""
        with self._lock:
            if self._count >= self.limit:
                raise QueueFullError(f"{self._count} requests are already waiting; try again later")
            self._count += 1

    def add(self, seq: Sequence) -> None:
        """Queue a reserved request in its group."""
        group = seq.group
        if not self._queues.get(group):
            active = [self._passes[g] for g, q in self._queues.items() if q]
            self._passes[group] = max(self._passes.get(group, 0.0), min(active, default=0.0))
        self._queues.setdefault(group, deque()).append(seq)

    def pick(self, admissible: Callable[[Sequence], bool] = lambda seq: True) -> Sequence | None:
        """The next request to admit, or None when none waits: the head of the group with the smallest pass
        among those whose head is ``admissible`` (one whose adapter finds no free slot waits)."""
        candidates = [g for g, q in self._queues.items() if q and admissible(q[0])]
        if not candidates:
            return None
        group = min(candidates, key=lambda g: (self._passes[g], g))
        seq = self._queues[group].popleft()
        self._passes[group] += 1.0 / seq.request.priority
        self._release(1)
        return seq

    def take_cancelled(self) -> list[Sequence]:
        """Remove and return the queued requests whose callers cancelled them."""
        taken = []
        for q in self._queues.values():
            for seq in [s for s in q if s.handle.cancelled.is_set()]:
                q.remove(seq)
                taken.append(seq)
        self._release(len(taken))
        return taken

    def drain(self) -> list[Sequence]:
        """Remove and return every queued request."""
        taken = [seq for q in self._queues.values() for seq in q]
        for q in self._queues.values():
            q.clear()
        self._release(len(taken))
        return taken

    def counts(self) -> dict[str, int]:
        """Group -> queued requests (groups with none left out)."""
        return {group: len(q) for group, q in self._queues.items() if q}

    def _release(self, n: int) -> None:
        if n:
            with self._lock:
                self._count -= n
