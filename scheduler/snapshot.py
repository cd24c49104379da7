"""What the engine is doing, as a value: the slot snapshot behind the live dashboard (`server/dashboard.py`).

The engine thread publishes an immutable `SchedulerSnapshot` at the end of an iteration, at most every
`SNAPSHOT_INTERVAL_S`, and once more when the loop goes idle after a change (so a finished request shows
its slot idle within one idle poll). Building one reads a few attributes per slot and per group queue, the
host tier's counters and the scheduler's: no device reads, no copies of token lists. Readers on any thread
read `Scheduler.snapshot` (one reference, replaced whole: atomic in CPython) and never lock the engine.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from scheduler.sequence import SeqState

if TYPE_CHECKING:
    from scheduler.adapters import AdapterSlots
    from scheduler.host_tier import HostTier
    from scheduler.plan import StepPlan
    from scheduler.slots import Slot

SNAPSHOT_INTERVAL_S = 0.25  # the engine publishes at most this often (4 per second)
HISTORY_S = 60.0  # cumulative prompt / cached token counts kept this long, for the last minute's hit ratio
HISTORY_EVERY_S = 1.0  # one history point per this many seconds at most


class SnapshotSource(Protocol):
    """What a snapshot reads (the scheduler provides it): the slots, the waiting queues' sizes, the counters,
    the host tier and the step times."""

    iteration: int

    @property
    def slots(self) -> list[Slot]: ...

    @property
    def host(self) -> HostTier: ...

    @property
    def adapters(self) -> AdapterSlots: ...

    @property
    def step_seconds(self) -> dict[str, float | None]: ...

    def waiting_by_group(self) -> dict[str, int]: ...

    def disk_stats(self) -> dict[str, int] | None: ...

    def counter_values(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class SlotView:
    """One slot. ``state``: idle, prefilling (``prefill_done`` of ``prompt_tokens`` positions hold KV, of which
    ``cached_tokens`` came from a cache and ``computed_tokens`` were prefilled), waiting (for another request's
    in-flight prefill of its prefix), decoding, or verifying (a speculative verify step). An idle slot shows
    the group and label of the request whose KV it still holds (reusable by the next with its affinity)."""

    index: int
    state: str
    group: str | None  # GenerationRequest.group
    label: str | None  # GenerationRequest.label
    held: int  # positions whose KV the slot holds
    adapter: str | None = None  # the LoRA adapter its KV is computed under (its directory's name)
    request: int | None = None  # the running sequence's id (scheduler-local)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    prefill_done: int = 0
    generated: int = 0
    max_tokens: int = 0
    tokens_per_s: float = 0.0  # generated tokens per second since the request's first token
    running_s: float = 0.0  # since the request arrived


@dataclass(frozen=True)
class SchedulerSnapshot:
    taken_at: float  # time.time()
    iteration: int
    slots: tuple[SlotView, ...]
    waiting: dict[str, int]  # group -> requests waiting for a slot (groups with none left out)
    counters: dict[str, int]  # Scheduler.counters()
    host: dict[str, int]  # HostTier.stats(): bytes, nodes, hits, ...
    disk: dict[str, int] | None  # DiskTier.stats() (None: no disk tier)
    decode_step_s: float | None  # the decode step's recent (median) wall time (None before one ran)
    verify_rows_step_s: float | None
    history: tuple[tuple[float, int, int], ...]  # (time.time(), prompt_tokens, cached_tokens) over HISTORY_S

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def take_snapshot(sched: SnapshotSource, plan: StepPlan | None, history: tuple = (),
                  counters: dict[str, int] | None = None) -> SchedulerSnapshot:
    """Build a snapshot on the engine thread (the only thread that may read slots and sequences);
    ``counters``: `counter_values()` when the caller already took them."""
    verifying: set[int] = set()
    if plan is not None:
        if plan.verify is not None:
            verifying.add(plan.verify.seq.id)
        verifying.update(row.seq.id for row in plan.verify_rows)
    now = time.perf_counter()
    views = []
    for slot in sched.slots:
        seq = slot.sequence
        if seq is None:
            views.append(SlotView(slot.index, "idle", slot.group, slot.label, len(slot.tokens), slot.adapter))
            continue
        n = len(seq.generated)
        if seq.state is SeqState.PREFILLING:
            state = "waiting" if seq.awaiting is not None else "prefilling"
        else:
            state = "verifying" if seq.id in verifying else "decoding"
        rate = (n - 1) / max(now - seq.first_token_at, 1e-9) if seq.first_token_at is not None and n > 1 else 0.0
        views.append(SlotView(
            slot.index, state, seq.group, seq.request.label, len(slot.tokens), seq.adapter_name, request=seq.id,
            prompt_tokens=len(seq.prompt), cached_tokens=seq.cached_tokens,
            computed_tokens=max(0, seq.cursor - seq.cached_tokens), prefill_done=seq.cursor, generated=n,
            max_tokens=seq.max_tokens, tokens_per_s=round(rate, 2), running_s=round(now - seq.arrival, 3)))
    steps = sched.step_seconds
    return SchedulerSnapshot(
        taken_at=time.time(), iteration=sched.iteration, slots=tuple(views), waiting=sched.waiting_by_group(),
        counters=counters if counters is not None else sched.counter_values(),
        # The breakdown walks the host tier's trees: only once some request has run under an adapter.
        host={**sched.host.stats(), "by_adapter": sched.adapters.host_bytes(sched.host.bytes_by_scope())
              if sched.adapters.seen else {}},
        disk=sched.disk_stats(),
        decode_step_s=steps.get("decode"),
        verify_rows_step_s=steps.get("verify_rows"), history=history)


class SnapshotPublisher:
    """Owned by the scheduler, called only on its engine thread; ``latest`` is what readers read.
    ``interval_s`` None turns publishing off (``latest`` stays None)."""

    def __init__(self, interval_s: float | None = SNAPSHOT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.latest: SchedulerSnapshot | None = None
        self.published = 0
        self._at = -math.inf
        self._stale = True
        self._history: deque[tuple[float, int, int]] = deque(maxlen=int(HISTORY_S / HISTORY_EVERY_S) + 2)

    def after_step(self, sched: SnapshotSource, plan: StepPlan | None) -> None:
        if self.interval_s is None:
            return
        if time.monotonic() - self._at >= self.interval_s:
            self.publish(sched, plan)
        else:
            self._stale = True

    def when_idle(self, sched: SnapshotSource) -> None:
        """The loop found nothing to do: publish the final state of the last iteration if not yet published."""
        if self._stale and self.interval_s is not None:
            self.publish(sched, None)

    def publish(self, sched: SnapshotSource, plan: StepPlan | None) -> None:
        self._at = time.monotonic()
        self._stale = False
        counters = sched.counter_values()
        wall = time.time()
        if not self._history or wall - self._history[-1][0] >= HISTORY_EVERY_S:
            self._history.append((wall, counters["prompt_tokens"], counters["cached_tokens"]))
        while self._history and wall - self._history[0][0] > HISTORY_S + HISTORY_EVERY_S:
            self._history.popleft()
        self.latest = take_snapshot(sched, plan, tuple(self._history), counters)
        self.published += 1
