"""A KV slot as the scheduler sees it: the tokens whose KV it holds, the cache scope and affinity key they
belong to, and the sequence running in it."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from scheduler.sequence import Sequence


@dataclass
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)  # exactly the positions whose KV the slot holds
    scope: Hashable = None  # the cache scope of those tokens (GenerationRequest.cache_scope)
    affinity: str | None = None  # the affinity key of the request whose conversation the slot holds
    group: str | None = None  # that request's group and label (what the dashboard shows)
    label: str | None = None
    adapter: str | None = None  # the name of the LoRA adapter its KV was computed under
    sequence: Sequence | None = None  # the running sequence, if busy
    last_used: float = 0.0

    @property
    def busy(self) -> bool:
        return self.sequence is not None

    @property
    def held(self) -> int:
        return len(self.tokens)


def common_prefix(a: list[int] | np.ndarray, b: list[int] | np.ndarray) -> int:
    """Length of the longest common prefix of two token sequences (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n
