"""A request's state inside the scheduler, from queued to finished."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum

from core.dry import RepeatLimit
from core.tokenizer import IncrementalDetokenizer
from scheduler.budget_close import BudgetClose
from scheduler.request import GenerationRequest, RequestHandle
from scheduler.speculation import PRIOR_WEIGHT, DraftIndex
from scheduler.stop_strings import StopMatcher


class SeqState(Enum):
    """Where an admitted sequence stands; a queued one has no state yet (`Sequence.state` is None)."""

    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass
class Sequence:
    id: int
    request: GenerationRequest
    handle: RequestHandle
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopMatcher | None
    max_tokens: int  # the request's max_tokens, capped by the slot length
    seed: int
    state: SeqState | None = None  # None while queued (no slot); `KVCacheManager.place` sets PREFILLING
    slot: int | None = None
    cursor: int = 0  # next prompt position to prefill
    cached_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    # In-flight sharing: another sequence is prefilling this prompt's first `awaited` tokens; this one waits
    # for them and copies them instead of computing them again.
    awaiting: Sequence | None = None
    awaited: int = 0
    draft_index: DraftIndex | None = None  # prompt + generated, indexed for prompt-lookup drafts (on first use)
    drafted: int = 0  # speculative draft tokens verified for this sequence
    accepted: int = 0  # of those, accepted
    budget: BudgetClose | None = None  # closing the document within max_tokens (constrained requests only)
    dry: RepeatLimit | None = None  # the DRY penalty's breaker limit over prompt + generated (DRY requests only)
    adapter_slot: int | None = None  # the engine adapter slot it holds while admitted (`AdapterSlots`)

    def draft(self, max_tokens: int) -> list[int]:
        """Prompt-lookup draft for what follows prompt + generated (scheduler/speculation.py)."""
        if self.draft_index is None:
            self.draft_index = DraftIndex()
            self.draft_index.extend(self.prompt)
        self.draft_index.extend(self.generated[len(self.draft_index.tokens) - len(self.prompt):])
        return self.draft_index.draft(max_tokens)

    def draft_acceptance(self, prior: float) -> float:
        """Estimated chance that a drafted token is accepted: this sequence's record, starting from ``prior``
        (`scheduler.speculation.DraftRate`: what recent streams' drafts did) worth PRIOR_WEIGHT drafts."""
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.drafted + PRIOR_WEIGHT)

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def group(self) -> str:
        return self.request.group

    @property
    def adapter_name(self) -> str | None:
        """Its adapter's directory name, for people (None: the base model)."""
        adapter = self.request.adapter
        return None if adapter is None else adapter.path.name

    @property
    def scope(self) -> Hashable:
        """The cache scope its KV is shared in: the request's, and under an adapter that adapter's (KV computed
        under one adapter is never reused under another, or without one)."""
        adapter = self.request.adapter
        return self.request.cache_scope if adapter is None else (self.request.cache_scope, adapter.fingerprint)

    def next_boundary(self, after: int, min_piece: int) -> int:
        """Where the prefill chunk from `after` ends: the first message boundary with at least `min_piece`
        prompt tokens on each side of it (a shorter piece would cost a padded call of its own), else the end."""
        end = len(self.prompt)
        return min((b for b in self.request.boundaries if after + min_piece <= b <= end - min_piece), default=end)
