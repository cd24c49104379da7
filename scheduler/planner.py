"""The plan of one scheduler iteration (`StepPlan`): which waiting requests are admitted into free slots (with
their cached prefixes, `KVCacheManager`), which prefill chunks run within the prefill budget, and whether the
decoding streams take a decode step or a speculative verify step. It reads the engine's shapes (chunk sizes,
slots, which programs are compiled) and calls nothing on it.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from core.engine import FOLLOWING
from core.sampling import batch_needs_full
from scheduler.plan import PrefillChunk, StepPlan, StepRow
from scheduler.sequence import SeqState, Sequence
from scheduler.speculation import DraftRate, speculation_allowed

if TYPE_CHECKING:
    from core.engine import Engine
    from scheduler.adapters import AdapterSlots
    from scheduler.admission import Admission
    from scheduler.kv_manager import KVCacheManager

__all__ = ["Planner", "StepTimes"]

ROWS_VERIFY_COST_PRIOR = 1.5
ROW_PREFILL_CHUNKS = 4  # prefills with at most this many smallest chunks left advance in the batched call
# A piece is padded up to the chunk size covering it only while the padding is at most this share of it:
# padded positions cost full compute on CPU, so a larger waste is better split into smaller chunks.
MAX_PADDING_SHARE = 0.25
# While a decode step carries a short prefill's chunk, chunks of long prompts wait for a later iteration, at
# most this many in a row: executed in the same iteration, a long chunk (a 512-token chunk: 0.35-1.6 s on a
# 2-core CPU) holds back the carried prompt's first token and every stream's next one, where the carry step
# alone costs 0.07-0.17 s. A short prefill needs at most ROW_PREFILL_CHUNKS carries, so one completes within
# the wait; the bound keeps a stream of short turns from starving a long prompt.
MAX_DEFERRED_LONG = ROW_PREFILL_CHUNKS
# The batched prefill costs about a full row of every slot, so it runs only when this share of the slots
# (and at least 2 prefills) would use it.
MIN_ROW_PREFILL_SHARE = 0.5
# A step kind's time is the median of its last this many measurements: one slow step (a GC pause, the host
# busy elsewhere; 1 in ~20 batched verify steps took 1.4-1.7x the others on the Zen 5 host) does not move it,
# where a moving average let each such step raise the verify figure by 10-15% and, when the drafts' margin was
# thinner than that, decline verify steps until the stale-figure retry.
STEP_TIME_WINDOW = 5
# A batched verify judged too dear is retried after this many decode steps without one: a single slow
# measurement (a restarted server loading programs beside the first wave) would otherwise stand for good,
# since only a verify step corrects it. The retry's time replaces the stale figure; at worst (verify never
# pays) it costs ~one extra verify pass every this many steps.
VERIFY_RETRY_STEPS = 32


class StepTimes:
    """Wall seconds of recent decode steps and batched verify steps (the median of each kind's last
    STEP_TIME_WINDOW), for the choice between them."""

    def __init__(self) -> None:
        self.recent: dict[str, deque[float]] = {kind: deque(maxlen=STEP_TIME_WINDOW)
                                                for kind in ("decode", "verify_rows")}
        self.decodes_since_verify = 0  # decode steps recorded since the last batched verify step

    @property
    def seconds(self) -> dict[str, float | None]:
        """Each kind's figure: the median of its recent steps (None until one was measured)."""
        return {kind: statistics.median(times) if times else None for kind, times in self.recent.items()}

    def record(self, kind: str, seconds: float) -> None:
        if kind == "verify_rows":
            if self.verify_stale():
                self.recent[kind].clear()  # a retry: the stale figures are replaced, not pooled with
            self.decodes_since_verify = 0
        elif kind == "decode":
            self.decodes_since_verify += 1
        self.recent[kind].append(seconds)

    def verify_stale(self) -> bool:
        """Whether the batched verify's time is old enough to measure again (see VERIFY_RETRY_STEPS)."""
        return bool(self.recent["verify_rows"]) and self.decodes_since_verify >= VERIFY_RETRY_STEPS

    def rows_verify_cost(self) -> float:
        """A batched verify step's time over a decode step's: measured once both ran, else a prior (about 1.5
        on a 2-core CPU at 8 slots x 3 tokens)."""
        figures = self.seconds
        decode, verify = figures["decode"], figures["verify_rows"]
        return verify / decode if decode and verify else ROWS_VERIFY_COST_PRIOR


class Planner:
    """Builds each iteration's `StepPlan`. ``prefilling`` holds the admitted sequences whose prompts are not
    all computed yet (the scheduler's update step removes those that finish)."""

    def __init__(self, engine: Engine, kv: KVCacheManager, admission: Admission, prefill_budget: int,
                 speculative: bool, times: StepTimes, adapters: AdapterSlots, drafts: DraftRate) -> None:
        self.engine = engine
        self.kv = kv
        self.admission = admission
        self.adapters = adapters
        self.prefill_budget = prefill_budget
        self.speculative = speculative
        self.times = times
        self.drafts = drafts  # the pooled acceptance of recent drafts (the scheduler records each verify step)
        self.prefilling: deque[Sequence] = deque()
        self.deferred_long = 0  # iterations in a row whose long prompts waited for a carried prefill

    def plan(self) -> StepPlan:
        plan = StepPlan()
        for seq in self.prefilling:
            if seq.awaiting is not None:
                self.kv.resolve(seq, plan.cache_ops)
        while self.kv.has_free_slot():
            seq = self.admission.pick(lambda s: self.adapters.fits(s.request.adapter))
            if seq is None:
                break
            seq.adapter_slot = self.adapters.acquire(seq.request.adapter)
            self.kv.place(seq, plan.cache_ops)
            seq.admitted_at = time.perf_counter()
            plan.admitted.append(seq)
            self.prefilling.append(seq)
        self._plan_decode(plan)  # first: whether a decode step runs decides whether it carries a chunk
        self._plan_prefill(plan)
        return plan

    def _plan_prefill(self, plan: StepPlan) -> None:
        """Prefill chunks within the budget, the least remaining work first (a turn after a cache hit, or a
        request that waited for a shared prefix, is not queued behind a long new prompt); a chunk ends at a
        message boundary when that adds no padded call. One padded call for a whole piece when that wastes
        little (padding costs full compute on CPU), else the largest full chunk; a tail shorter than the
        smallest chunk runs padded in it. Once something is planned, what is left of the budget is not spent
        on smallest chunks cut from a piece that fills a larger chunk (per token they cost about twice the
        larger ones on CPU): the next iteration takes it in larger ones. While a short prefill is carried,
        long prompts wait (at most MAX_DEFERRED_LONG iterations in a row)."""
        budget = self._plan_rows(plan, self.prefill_budget)
        sizes = self.engine.config.chunk_sizes
        in_rows = {chunk.seq.id for chunk in plan.rows}
        ready = [seq for seq in self.prefilling if seq.awaiting is None and seq.id not in in_rows]
        if self._plan_carried(plan, ready):  # the other short prefills wait for the next steps' carries
            ready = [seq for seq in ready if not self._short(seq)]
            if ready and self.deferred_long < MAX_DEFERRED_LONG:
                self.deferred_long += 1
                return
        self.deferred_long = 0
        for seq in sorted(ready, key=lambda s: len(s.prompt) - s.cursor):
            cursor = seq.cursor
            while budget > 0 and cursor < len(seq.prompt):
                piece = min(seq.next_boundary(cursor, sizes[0]) - cursor, sizes[-1])
                covering = next(size for size in sizes if size >= piece)
                fitting = [size for size in sizes if size <= min(piece, budget)]
                if covering <= budget and (not fitting or covering - piece <= piece * MAX_PADDING_SHARE):
                    n, cost = piece, covering
                elif fitting and not (fitting[-1] == sizes[0] and len(sizes) > 1 and piece >= sizes[1]
                                      and (plan.chunks or plan.rows)):
                    n = cost = fitting[-1]
                else:  # only the smallest chunk fits what is left of the budget: a later iteration does better
                    return
                plan.chunks.append(PrefillChunk(seq, cursor, np.asarray(seq.prompt[cursor:cursor + n], np.int32)))
                budget -= cost
                cursor += n
            if budget <= 0:
                return

    def _short(self, seq: Sequence) -> bool:
        """Whether a prefill has at most a few smallest chunks left (a chat turn after a cache hit)."""
        return len(seq.prompt) - seq.cursor <= ROW_PREFILL_CHUNKS * self.engine.row_chunk

    def _plan_carried(self, plan: StepPlan, ready: list[Sequence]) -> bool:
        """The decode step takes along the next piece of the short prefill admitted first (a chat turn's new
        tokens after a cache hit), as many tokens as the largest carry size takes, padded to the smallest carry
        size covering them whose program is loaded: in the same pass it costs its extra rows, where a call of
        its own reads every weight again (`Engine.decode_with_chunk`; default model, 2-core CPU: 90 ms for both
        vs 53 + 64 ms). Returns whether it does: then the other short prefills wait for later steps' carries,
        first come first served (a step's wait costs them less than a call of their own costs every stream);
        long prompts keep their large chunks, in the iterations after (`MAX_DEFERRED_LONG`)."""
        short = [seq for seq in ready if self._short(seq)]
        if not plan.decode or not self.engine.chunk_in_decode or not short:
            return False
        seq = min(short, key=lambda s: s.admitted_at)
        left, sizes = len(seq.prompt) - seq.cursor, self.engine.carry_sizes
        covering = self.engine.carry_width(min(left, sizes[-1]))
        starts = [row.start for row in plan.decode]
        for width in reversed([size for size in sizes if size <= covering]):  # a restart loads the wider later
            end = seq.cursor + min(left, width)
            if self.engine.compiled_for("decode_chunk", [*starts, end - 1], width):
                plan.carried = PrefillChunk(seq, seq.cursor, np.asarray(seq.prompt[seq.cursor:end], np.int32))
                return True
        return False

    def _plan_rows(self, plan: StepPlan, budget: int) -> int:
        """Advance many short prefills (at most a few smallest chunks left, e.g. chat turns after a prefix-cache
        hit) together: one batched call takes up to one smallest chunk of each, and samples the first tokens
        of those it completes. The call costs about S x chunk tokens whatever the count, so it runs only when
        at least half the slots would use it."""
        width, rows = self.engine.row_chunk, self.engine.num_slots
        short = [seq for seq in self.prefilling if seq.awaiting is None and self._short(seq)]
        if len(short) < max(2, rows * MIN_ROW_PREFILL_SHARE):
            return budget
        ends = [min(len(seq.prompt), seq.cursor + width) - 1 for seq in short]
        if not self.engine.compiled_for("prefill_rows", ends):  # still compiling after start-up
            return budget
        plan.rows = [PrefillChunk(seq, seq.cursor, np.asarray(seq.prompt[seq.cursor:seq.cursor + width], np.int32))
                     for seq in short]
        return max(0, budget - width * rows)  # may exceed a small budget: it replaces that many separate calls

    def _plan_decode(self, plan: StepPlan) -> None:
        running = [slot.sequence for slot in self.kv.slots
                   if slot.sequence is not None and slot.sequence.state is SeqState.DECODING]
        if not running:
            return
        # A lone stream verifies on its own (more drafts per pass) once that program is loaded; until then (a
        # restarted server's first wave ends with its slowest stream alone) the batched verify serves it.
        lone = running[0] if len(running) == 1 else None
        declined: dict[int, list[int]] = {}
        lone_verifies = lone is not None and self._may_speculate(lone)
        if self._carry_waiting():  # a decode step takes the chunk along (`_plan_carried`); a verify step cannot
            pass
        elif lone_verifies and self.engine.compiled_for("verify", [self.kv.held(lone)]):
            plan.verify = self._speculate(lone)
        else:
            weighed, worth = self._speculate_rows(running)
            plan.verify_rows = weighed if worth else []
            declined = {row.seq.id: row.inputs[1:] for row in weighed if not worth}
        if plan.verify is None and not plan.verify_rows:
            plan.decode = [StepRow(seq, [seq.generated[-1]], self.kv.held(seq), declined.get(seq.id, []))
                           for seq in running]

    def _carry_waiting(self) -> bool:
        """Whether a short prefill (a chat turn's new tokens after a cache hit) waits that a decode step would
        take along. Then the streams decode rather than verify: the carried chunk rides in the decode pass,
        where on its own it costs a pass over every weight and its stream's first token waits for it."""
        return self.engine.chunk_in_decode and any(seq.awaiting is None and self._short(seq)
                                                   for seq in self.prefilling)

    def follow_on(self, plan: StepPlan, arrivals: bool) -> StepPlan | None:
        """The next iteration's plan, built before ``plan``'s tokens are read, when it can only be a decode
        step of the same streams: nothing to prefill, nothing that could be admitted (``arrivals``: requests
        not yet taken from the inbox), no stream that may speculate, none constrained or with DRY (their next
        step depends on host state after this token), and the fused program loaded. Each row's input is
        FOLLOWING (the token ``plan`` samples for it, read on the device). A stream that this token ends costs
        one wasted row; one its max_tokens or slot length is sure to end is left out. None otherwise."""
        if not plan.decode or plan.carried is not None or plan.chunks or plan.rows or self.prefilling:
            return None
        if (arrivals or self.admission.waiting) and self.kv.has_free_slot():
            return None
        seqs = [row.seq for row in plan.decode]
        if any(seq.request.constraint is not None or seq.dry is not None for seq in seqs):
            return None
        if all(self._may_speculate(seq) for seq in seqs) and (len(seqs) == 1 or self.engine.rows_verify_exact):
            return None  # _plan_decode weighs a verify step for them
        rows = [StepRow(row.seq, [FOLLOWING], row.start + 1) for row in plan.decode
                if len(row.seq.generated) + 1 < row.seq.max_tokens and row.start + 1 < self.engine.max_len]
        needs_full = batch_needs_full(row.seq.request.sampling for row in rows)
        if not rows or not self.engine.fused_ready(np.array([row.start for row in rows]), needs_full):
            return None
        return StepPlan(decode=rows)

    def _may_speculate(self, seq: Sequence) -> bool:
        request = seq.request
        return self.speculative and speculation_allowed(request.sampling, request.constraint is not None,
                                                        request.want_logprobs)

    def _speculate(self, seq: Sequence) -> StepRow | None:
        """A verify step for a lone eligible stream (its program loaded), if the context suggests a draft;
        None: decode as usual."""
        if self.engine.config.verify_tokens < 2:
            return None
        start = self.kv.held(seq)
        # verify_room keeps the chunk inside one attention bucket (so also within max_len)
        room = min(self.engine.verify_room(start) - 1, seq.max_tokens - len(seq.generated) - 1)
        draft = seq.draft(room)
        return StepRow(seq, [seq.generated[-1], *draft], start) if draft else None

    def _speculate_rows(self, running: list[Sequence]) -> tuple[list[StepRow], bool]:
        """A batched verify step for several streams that may speculate, each with its prompt-lookup draft (or none),
        and whether to run it: when the drafts' expected accepted tokens per second beat a decode step's, or to
        measure the verify step again once its figure is stale. ([], False): no verify step was weighed."""
        if not self.engine.rows_verify_exact or not all(self._may_speculate(seq) for seq in running):
            return [], False
        starts = [self.kv.held(seq) for seq in running]
        if not self.engine.compiled_for("verify_rows", starts):  # still compiling after start-up
            return [], False
        drafts = [seq.draft(min(room, seq.max_tokens - len(seq.generated)) - 1)
                  for seq, room in zip(running, self.engine.rows_verify_room(starts), strict=True)]
        prior = self.drafts.rate
        expected = sum(sum(seq.draft_acceptance(prior) ** i for i in range(len(draft) + 1))
                       for seq, draft in zip(running, drafts, strict=True))
        worth = expected > len(running) * self.times.rows_verify_cost()
        retry = expected > len(running) and self.times.verify_stale()  # some draft, and an old figure
        rows = [StepRow(seq, [seq.generated[-1], *draft], start)
                for seq, draft, start in zip(running, drafts, starts, strict=True)]
        return rows, worth or retry
