"""One scheduler iteration as data: which cache operations run, which slots prefill which tokens, and which
decode or verify step runs. The scheduler builds a `StepPlan`, `scheduler.executor.execute` runs it on the
engine, and the scheduler's update step applies what came back (tokens, finished sequences)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from core.engine import PendingSample, SampleResult, SlotSnapshot

if TYPE_CHECKING:
    from scheduler.sequence import Sequence


@dataclass(frozen=True)
class SaveToHost:
    """Copy positions [start, len(tokens)) of a slot to the host tier under `scope` before it is overwritten."""

    slot: int
    scope: Hashable
    tokens: tuple[int, ...]
    start: int


@dataclass(frozen=True)
class CopyPrefix:
    """Slot dst takes positions [0, n) of slot src (on the device)."""

    src: int
    dst: int
    n: int


@dataclass(frozen=True)
class RestoreFromHost:
    """Write a host snapshot (positions [snapshot.start, snapshot.end)) into a slot."""

    slot: int
    snapshot: SlotSnapshot


CacheOp = SaveToHost | CopyPrefix | RestoreFromHost


@dataclass
class PrefillChunk:
    """Prompt positions [start, start + len(tokens)) of a sequence; `last`: it completes the prompt, so the
    first generated token is sampled from its logits."""

    seq: Sequence
    start: int
    tokens: np.ndarray

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def last(self) -> bool:
        return self.end == len(self.seq.prompt)


@dataclass
class StepRow:
    """One stream's input to a decode or verify step: its last generated token (plus, to verify, the drafted
    tokens after it), fed at positions start.. of its slot."""

    seq: Sequence
    inputs: list[int]
    start: int
    # A decode row's prompt-lookup draft that the planner weighed and did not verify: the scheduler checks its
    # first token against the token decoded, so acceptance estimates keep learning while verify steps are
    # declined (a judgement made on a stream's first, unlucky drafts would otherwise stand until a retry).
    declined: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    # Run in order, before any prefill or decode: each was planned against the slots as the ones before it
    # left them.
    cache_ops: list[CacheOp] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # sampling state to install in their slots
    rows: list[PrefillChunk] = field(default_factory=list)  # one batched prefill call (each completes a prompt)
    chunks: list[PrefillChunk] = field(default_factory=list)  # single-slot prefill calls, in order
    decode: list[StepRow] = field(default_factory=list)  # one batched decode step (one input each)
    carried: PrefillChunk | None = None  # a short prompt chunk the decode step takes along (same pass)
    verify: StepRow | None = None  # one speculative step for a lone stream
    verify_rows: list[StepRow] = field(default_factory=list)  # one batched speculative step

    @property
    def empty(self) -> bool:
        return not (self.cache_ops or self.admitted or self.rows or self.chunks or self.decode or self.carried
                    or self.verify or self.verify_rows)


@dataclass
class StepOutcome:
    """What executing a plan produced: the first token of every sequence whose prompt completed (sample result
    and row), the decode step's samples, and each verified stream's tokens (`Engine.verify`)."""

    first: dict[int, tuple[SampleResult, int]] = field(default_factory=dict)  # by sequence id
    decoded: SampleResult | None = None
    # A decode step dispatched whose tokens are not read yet (`executor.finish_decode` reads them into
    # `decoded`), and when its time started: (perf_counter, programs run then).
    pending: PendingSample | None = None
    began: tuple[float, int] | None = None
    verified: dict[int, list[int]] = field(default_factory=dict)  # by sequence id
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of the decode / verify_rows step
    mask_fills: list[tuple[float, int]] = field(default_factory=list)  # (seconds, constrained rows) per batched fill
