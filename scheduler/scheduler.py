"""Continuous batching of many sessions over the engine's KV slots, with prefix caching.

One thread owns the engine. Each iteration takes new submissions, drops cancelled requests, and then runs
the algorithm in three visible parts:

- plan (`scheduler.planner`): waiting requests (`scheduler.admission`, fair across request groups) are
  admitted into free slots with their cached prefixes (`KVCacheManager`: own slot, another slot, the host
  tier, or a wait for an in-flight prefill); at most `prefill_budget` tokens of prefill are planned (so a long
  prompt delays running streams by one chunk at most); then one batched decode step, or a speculative verify
  step, for the decoding streams;
- execute (`scheduler.executor.execute`): the one place the engine is called;
- update (`_update`): computed tokens are appended to their slots, each generated token goes through
  `scheduler.output` (grammar, detokenizer, stop strings: go on or finish), and finished sequences free their
  slots.

This module owns the loop: the engine thread, the inbox of submissions, and delivery (events are handed to
each request's handle once per iteration).
"""

from __future__ import annotations

import itertools
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from core.dry import BreakerTables, RepeatLimit
from core.engine import Engine, SampleResult
from core.tokenizer import Tokenizer
from scheduler.adapters import AdapterSlots
from scheduler.admission import Admission
from scheduler.budget_close import BudgetClose
from scheduler.disk_tier import DiskTier
from scheduler.executor import dispatch_follow_on, execute, finish_decode, persist_slot
from scheduler.host_tier import HostTier
from scheduler.kv_manager import CacheConfig, KVCacheManager
from scheduler.output import accept, finish_event
from scheduler.plan import StepOutcome, StepPlan, StepRow
from scheduler.planner import Planner, StepTimes
from scheduler.request import (
    EngineFailedError,
    Event,
    FinishReason,
    GenerationRequest,
    QueueFullError,
    RequestHandle,
    generation_room,
)
from scheduler.sequence import SeqState, Sequence
from scheduler.slots import Slot
from scheduler.snapshot import SchedulerSnapshot, SnapshotPublisher
from scheduler.speculation import DraftRate
from scheduler.stop_strings import StopMatcher

log = logging.getLogger(__name__)
MASK_FILLS_KEPT = 4096  # grammar-mask fill timings kept for /metrics (a few minutes of constrained decoding)
IDLE_POLL_S = 0.05  # how long an idle engine loop blocks on its inbox before checking for a stop


@dataclass(frozen=True)
class SchedulerConfig:
    prefill_budget: int | None = None  # prefill tokens per iteration; None: the engine's largest chunk
    max_waiting: int = 256  # bounded admission queue; beyond it submit() raises QueueFullError
    # The prefix cache's knobs (scheduler.kv_manager.CacheConfig, where each is explained).
    prefix_caching: bool = CacheConfig.prefix_caching
    host_tier_bytes: int = CacheConfig.host_tier_bytes
    min_snapshot_tokens: int = CacheConfig.min_snapshot_tokens
    min_wait_tokens: int = CacheConfig.min_wait_tokens
    # A lone stream runs prompt-lookup speculative steps (engine.verify) instead of decode steps: same tokens,
    # often several per step, greedy or sampled (each position drawn with its own step's key), for requests
    # without penalties, grammar or logprobs (scheduler/speculation.py). Several such streams share a
    # batched verify step (engine.verify_rows, where the engine has that program and its products are exact)
    # when their drafts promise more tokens per second than a decode step.
    speculative: bool = True
    # Where the engine samples inside its decode program (EngineConfig.fused_sampling), a decode step of the
    # same streams is queued before the previous step's tokens are read, its inputs fed back on the device:
    # the host's work between steps (update, delivery, the next dispatch) overlaps the device. Same tokens.
    overlap_steps: bool = True
    # The disk tier under the host tier (scheduler/disk_tier.py): a directory, or None for none. Each finished
    # request's KV is queued for it, and a stop writes what the slots and the host tier hold, waiting at most
    # disk_tier_flush_s for the files.
    disk_tier_dir: str | None = None
    disk_tier_bytes: int = 8 * 2**30
    disk_tier_flush_s: float = 10.0


@dataclass
class SchedulerStats:
    iterations: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    prompt_tokens: int = 0  # requested
    prefill_tokens: int = 0  # computed
    cached_tokens: int = 0  # reused from a cache
    requests_admitted: int = 0
    requests_finished: int = 0
    cache_hit_requests: int = 0
    rejected_queue_full: int = 0
    cancelled: int = 0
    batched_prefills: int = 0  # calls that prefilled several short prompts at once (engine.prefill_rows)
    carried_chunks: int = 0  # prompt chunks a decode step took along (engine.decode_with_chunk)
    speculative_steps: int = 0  # verify steps (each also counted in decode_steps)
    batched_speculative_steps: int = 0  # of those, batched over several streams (engine.verify_rows)
    overlapped_steps: int = 0  # decode steps queued before the previous step's tokens were read
    draft_tokens: int = 0  # drafted tokens sent to verify steps
    accepted_draft_tokens: int = 0  # of those, accepted (tokens gained over plain decode steps)
    budget_closed: int = 0  # constrained outputs closed along their grammar to fit max_tokens (budget_close)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Scheduler:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, config: SchedulerConfig | None = None,
                 stop_ids: frozenset[int] | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config or SchedulerConfig()
        self.stop_ids = stop_ids if stop_ids is not None else frozenset(tokenizer.stop_ids)
        self.disk = (DiskTier(self.config.disk_tier_dir, self.config.disk_tier_bytes, engine.kv_identity())
                     if self.config.disk_tier_dir and self.config.prefix_caching else None)
        self.kv = KVCacheManager(engine.num_slots, CacheConfig(
            prefix_caching=self.config.prefix_caching, host_tier_bytes=self.config.host_tier_bytes,
            min_snapshot_tokens=self.config.min_snapshot_tokens, min_wait_tokens=self.config.min_wait_tokens),
            self.disk)
        self.admission = Admission(self.config.max_waiting)
        self.times = StepTimes()
        self.drafts = DraftRate()
        self.adapters = AdapterSlots(engine)
        self.planner = Planner(engine, self.kv, self.admission,
                               self.config.prefill_budget or max(engine.config.chunk_sizes),
                               self.config.speculative, self.times, self.adapters, self.drafts)
        self.stats = SchedulerStats()
        self.iteration = 0
        self._inbox: queue.Queue[Sequence] = queue.Queue()
        self._outbox: dict[RequestHandle, list[Event]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # The latest batched grammar-mask fills, (seconds, constrained rows): read by /metrics.
        self.mask_fills: deque[tuple[float, int]] = deque(maxlen=MASK_FILLS_KEPT)
        self.failure: str | None = None  # why the engine loop died, once it has
        self.on_failure: Callable[[str], None] | None = None  # called on the engine thread after it died
        # The live slot snapshot (scheduler/snapshot.py): published by the engine thread a few times a second.
        self.snapshots = SnapshotPublisher()
        self._breaker_tables: BreakerTables | None = None  # DRY sequence breakers as token ids, on first use
        self._breaker_lock = threading.Lock()
        # A decode step queued before the previous step's tokens were read (`step`): its plan and outcome.
        self._follow_on: tuple[StepPlan, StepOutcome] | None = None

    @property
    def slots(self) -> list[Slot]:
        return self.kv.slots

    @property
    def host(self) -> HostTier:
        return self.kv.host

    def disk_stats(self) -> dict[str, int] | None:
        """The disk tier's counters and sizes (None: no disk tier)."""
        return self.disk.stats() if self.disk is not None else None

    @property
    def snapshot(self) -> SchedulerSnapshot | None:
        """The latest published slot snapshot (any thread; never locks the engine)."""
        return self.snapshots.latest

    def counters(self) -> dict[str, int]:
        """Every counter: the scheduler's and the KV-cache manager's reuse counts."""
        return {**self.stats.as_dict(), **asdict(self.kv.stats)}

    def counter_values(self) -> dict[str, int]:
        """`counters()` without dataclasses.asdict's deep copy (the snapshot takes it a few times a second)."""
        return {**vars(self.stats), **vars(self.kv.stats)}

    # ---- caller side (any thread) ----------------------------------------------------------
    def submit(self, request: GenerationRequest, loop=None) -> RequestHandle:
        if self.failure is not None:
            raise EngineFailedError(f"the engine loop died ({self.failure})")
        generation_room(len(request.prompt_ids), self.engine.max_len)
        vocab = self.engine.cfg.vocab_size
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if request.adapter is not None and not self.adapters.count:
            raise ValueError("this server runs no LoRA adapters (engine.adapter_slots is 0)")
        handle = RequestHandle(request, loop)
        try:
            self.admission.reserve()
        except QueueFullError:
            self.stats.rejected_queue_full += 1
            raise
        seed = request.sampling.seed
        seq = Sequence(
            id=next(self._ids), request=request, handle=handle,
            detokenizer=self.tokenizer.detokenizer(skip_special=True),
            stop_matcher=StopMatcher(request.stop) if request.stop else None,
            max_tokens=request.max_tokens,
            seed=seed if seed is not None else random.getrandbits(31),
            budget=BudgetClose() if request.constraint is not None and request.close_within_budget else None,
            dry=self._repeat_limit(request),
        )
        self._inbox.put(seq)
        return handle

    def _repeat_limit(self, request: GenerationRequest) -> RepeatLimit | None:
        """The DRY breaker bookkeeping for a request with DRY on (its breakers' token table is built once per
        breaker list, on the caller's thread)."""
        sampling = request.sampling
        if not sampling.dry:
            return None
        with self._breaker_lock:
            if self._breaker_tables is None:
                tok = self.tokenizer
                self._breaker_tables = BreakerTables(tok.token_bytes, tok.vocab_size, tok.encode)
            table = self._breaker_tables.table(sampling.dry_sequence_breakers)
        return RepeatLimit(table, sampling.dry_penalty_last_n, request.prompt_ids)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="slotserve-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything still running or waiting, then stop the engine thread."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def waiting(self) -> int:
        return self.admission.waiting

    @property
    def prefilling(self) -> int:
        return len(self.planner.prefilling)

    @property
    def step_seconds(self) -> dict[str, float | None]:
        """The recent (median) wall time of decode steps and batched verify steps (None until one ran)."""
        return self.times.seconds

    def waiting_by_group(self) -> dict[str, int]:
        return self.admission.counts()

    @property
    def running(self) -> int:
        return sum(slot.busy for slot in self.slots)

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        busy = False
        self.engine.serving(False)  # quiet counts from the loop's start: first requests come right after
        try:
            while not self._stopping.is_set():
                if not self._has_work():
                    if busy:  # a background warm-up may load programs while nothing is served
                        busy = False
                        self.engine.serving(False)
                    try:
                        self.admission.add(self._inbox.get(timeout=IDLE_POLL_S))
                    except queue.Empty:
                        self.snapshots.when_idle(self)
                        continue
                if not busy:
                    busy = True
                    self.engine.serving(True)
                self.step()
        except BaseException as e:  # noqa: BLE001 - the loop is dead: say why, end every stream, tell the owner
            self.failure = f"{type(e).__name__}: {e}"
            log.exception("the engine loop died")
        finally:
            if busy:
                self.engine.serving(False)
            self._shutdown()
        if self.failure is not None and self.on_failure is not None:
            self.on_failure(self.failure)

    def _has_work(self) -> bool:
        return bool(self.admission.waiting or self.running or not self._inbox.empty())

    def run_until_idle(self, max_iterations: int = 1_000_000) -> None:
        """Drive the loop on the calling thread until nothing is left (tests, offline use)."""
        for _ in range(max_iterations):
            if not self._has_work():
                return
            self.step()
        raise RuntimeError("scheduler did not become idle")

    def step(self) -> None:
        """One iteration: plan, execute on the engine, update, deliver events. Where the next iteration can
        only be a decode step of the same streams (`Planner.follow_on`), that step is queued on the device
        before this one's tokens are read, and the next iteration starts from it instead of a plan."""
        self._drain_inbox()
        self._reap_cancelled()
        plan, outcome = self._take_follow_on()
        if plan is None:
            plan = self.planner.plan()
            self.stats.requests_admitted += len(plan.admitted)
            self.stats.prompt_tokens += sum(len(seq.prompt) for seq in plan.admitted)
            outcome = execute(self.engine, self.kv.host, plan)
        if self.config.overlap_steps and outcome.pending is not None:
            follow = self.planner.follow_on(plan, arrivals=not self._inbox.empty())
            if follow is not None:
                self._follow_on = (follow, dispatch_follow_on(self.engine, follow, outcome))
                self.stats.overlapped_steps += 1
        finish_decode(self.engine, outcome, self._follow_on[1] if self._follow_on is not None else None)
        self._update(plan, outcome)
        self.stats.iterations += 1
        self.iteration += 1
        outbox, self._outbox = self._outbox, {}
        for handle, events in outbox.items():
            handle._deliver(events)
        self.snapshots.after_step(self, plan)

    def _take_follow_on(self) -> tuple[StepPlan | None, StepOutcome | None]:
        """The queued follow-on step, its inputs now the tokens the previous iteration delivered; streams
        those tokens ended drop out of it ((None, None): none queued, or none of its streams is left)."""
        if self._follow_on is None:
            return None, None
        (plan, outcome), self._follow_on = self._follow_on, None
        plan.decode = [row for row in plan.decode if row.seq.state is SeqState.DECODING]
        if not plan.decode:
            return None, None
        for row in plan.decode:
            row.inputs = [row.seq.generated[-1]]
        return plan, outcome

    def _emit(self, seq: Sequence, event: Event) -> None:
        self._outbox.setdefault(seq.handle, []).append(event)

    def _drain_inbox(self) -> None:
        while True:
            try:
                self.admission.add(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _reap_cancelled(self) -> None:
        for seq in self.admission.take_cancelled():
            self._finish(seq, FinishReason.CANCELLED)
        for slot in self.slots:
            if slot.sequence is not None and slot.sequence.handle.cancelled.is_set():
                self._finish(slot.sequence, FinishReason.CANCELLED)

    # ---- update ------------------------------------------------------------------------------
    def _update(self, plan: StepPlan, outcome: StepOutcome) -> None:
        if plan.rows:
            self.stats.batched_prefills += 1
            self.stats.prefill_chunks += 1
        carried = [plan.carried] if plan.carried is not None else []
        self.stats.prefill_chunks += len(plan.chunks) + len(carried)
        self.stats.carried_chunks += len(carried)
        for chunk in plan.rows + plan.chunks + carried:
            seq = chunk.seq
            self.kv.extend(seq.slot, chunk.tokens.tolist())
            seq.cursor = chunk.end
            self.stats.prefill_tokens += len(chunk.tokens)
            if chunk.last:
                self.planner.prefilling.remove(seq)
                seq.state = SeqState.DECODING
                self.stats.cached_tokens += seq.cached_tokens
                self.stats.cache_hit_requests += seq.cached_tokens > 0
                result, row = outcome.first[seq.id]
                self._accept(seq, result, row)
        self.mask_fills.extend(outcome.mask_fills)
        for kind, seconds in outcome.seconds.items():
            self.times.record(kind, seconds)
        if plan.decode:
            self.stats.decode_steps += 1
            for row in plan.decode:
                self.kv.extend(row.seq.slot, row.inputs)
                self._accept(row.seq, outcome.decoded, row.seq.slot)
            self._record_declined(plan.decode, outcome.decoded)
        verified = [plan.verify] if plan.verify is not None else plan.verify_rows
        if verified:
            self.stats.decode_steps += 1
            self.stats.speculative_steps += 1
            self.stats.batched_speculative_steps += bool(plan.verify_rows)
            for row in verified:
                self._accept_verified(row, outcome.verified[row.seq.id])
            self.drafts.record(sum(len(row.inputs) - 1 for row in verified),
                               sum(len(outcome.verified[row.seq.id]) - 1 for row in verified))

    def _record_declined(self, rows: list[StepRow], decoded: SampleResult) -> None:
        """Drafts weighed for a verify step that was declined: whether each one's first token is the token the
        decode step gave, recorded as a verify step of one-token drafts would record it (the stream's own
        estimate and the pooled one), so the estimates follow the drafts while streams decode."""
        hits = [(row.seq, row.declined[0] == int(decoded.tokens[row.seq.slot])) for row in rows if row.declined]
        for seq, hit in hits:
            seq.drafted += 1
            seq.accepted += hit
        if hits:
            self.drafts.record(len(hits), sum(hit for _, hit in hits))

    def _accept_verified(self, row: StepRow, out: list[int]) -> None:
        """Deliver a verify step's tokens: out[i] follows row.inputs[i]; stops early if the sequence finishes."""
        seq = row.seq
        self.stats.draft_tokens += len(row.inputs) - 1
        self.stats.accepted_draft_tokens += len(out) - 1
        seq.drafted += len(row.inputs) - 1
        seq.accepted += len(out) - 1
        n = len(out)
        result = SampleResult(np.asarray(out, np.int32), np.zeros(n, np.float32), np.zeros((n, 0), np.int32),
                              np.zeros((n, 0), np.float32))
        for i, token in enumerate(row.inputs[:n]):
            self.kv.extend(seq.slot, [token])  # the token whose K/V this step wrote
            self._accept(seq, result, i)
            if seq.state is SeqState.FINISHED:
                break

    def _accept(self, seq: Sequence, result: SampleResult, row: int) -> None:
        verdict = accept(seq, result, row, self.stop_ids, self.iteration,
                         slot_full=self.kv.held(seq) >= self.engine.max_len)
        if verdict.event is not None:
            self._emit(seq, verdict.event)
        if verdict.finish is not None:
            self._finish(seq, verdict.finish, verdict.error)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        event = finish_event(seq, reason, error)
        self.stats.budget_closed += event.budget_closed
        self._emit(seq, event)
        if seq.slot is not None:
            # Message boundaries: the template's, and the prompt's end (the client may re-render the reply).
            self._persist(self.kv.slots[seq.slot], (*seq.request.boundaries, len(seq.prompt)))
            self.kv.release(seq)
            if seq in self.planner.prefilling:
                self.planner.prefilling.remove(seq)
        if seq.adapter_slot is not None:
            self.adapters.release(seq.adapter_slot)
            seq.adapter_slot = None
        seq.state = SeqState.FINISHED
        self.stats.requests_finished += 1
        self.stats.cancelled += event.reason is FinishReason.CANCELLED

    def _shutdown(self) -> None:
        """Engine thread exit: end every stream with a finish event (an error one if the loop died)."""
        reason, why = ((FinishReason.ERROR, f"the engine loop died ({self.failure})") if self.failure is not None
                       else (FinishReason.CANCELLED, "server shutting down"))
        self._drain_inbox()
        for seq in self.admission.drain():
            self._finish(seq, reason, why)
        for slot in self.slots:
            if slot.sequence is not None:
                self._finish(slot.sequence, reason, why)
        outbox, self._outbox = self._outbox, {}
        for handle, events in outbox.items():
            handle._deliver(events)
        if self.disk is not None and self.failure is None:
            self._persist_all()

    def _persist(self, slot: Slot, boundaries: tuple[int, ...] = ()) -> None:
        """Queue what the disk tier lacks of a slot's KV. Never fatal: a failure loses the files, not the
        request or the loop (and a dead loop's engine is not read at all)."""
        if self.disk is None or self.failure is not None:
            return
        try:
            persist_slot(self.engine, self.disk, slot, boundaries)
        except Exception:  # noqa: BLE001 - the disk tier is a cache
            log.exception("disk KV tier: keeping slot %d's KV failed", slot.index)

    def _persist_all(self) -> None:
        """Write what the slots and the host tier hold to the disk tier (what the disk lacks of it), within
        disk_tier_flush_s."""
        deadline = time.monotonic() + self.config.disk_tier_flush_s
        for slot in self.slots:
            if time.monotonic() < deadline:
                self._persist(slot)
        for scope, tokens, snapshot in self.kv.host.conversations():
            if time.monotonic() < deadline:
                self.disk.store_missing(scope, tokens, snapshot.suffix)
        if not self.disk.flush(max(0.0, deadline - time.monotonic())):
            log.warning("disk KV tier: not every file was written within %.1f s", self.config.disk_tier_flush_s)
        self.disk.close(0.0)
