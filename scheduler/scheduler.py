"""Continuous batching of many sessions over the engine's KV slots, with prefix caching.

One thread owns the engine. Each iteration takes new submissions, drops cancelled requests, and then runs
the algorithm in three visible parts:

- plan (`_schedule`): waiting requests are admitted into free slots, fair across request groups, with their cached
  prefixes (`KVCacheManager`: own slot, another slot, the host tier, or a wait for an in-flight prefill);
  at most `prefill_budget` tokens of prefill are planned (so a long prompt delays running streams by one
  chunk at most); then one batched decode step, or a speculative verify step, for the decoding streams;
- execute (`scheduler.executor.execute`): the one place the engine is called;
- update (`_update`): computed tokens are appended to their slots, generated tokens are delivered, and
  finished sequences free their slots.

Events are handed to each request's handle once per iteration.
"""

from __future__ import annotations

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
from scheduler.budget_close import BudgetClose
from scheduler.executor import execute
from scheduler.host_tier import HostTier
from scheduler.kv_manager import CacheConfig, KVCacheManager
from scheduler.plan import PrefillChunk, StepOutcome, StepPlan, StepRow
from scheduler.request import (
    EngineFailedError,
    Event,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    QueueFullError,
    RequestHandle,
    TokenEvent,
    Usage,
    generation_room,
)
from scheduler.sequence import SeqState, Sequence
from scheduler.slots import Slot
from scheduler.snapshot import SchedulerSnapshot, SnapshotPublisher
from scheduler.speculation import speculation_allowed
from scheduler.stop_strings import StopMatcher

log = logging.getLogger(__name__)
ROWS_VERIFY_COST_PRIOR = 1.5
MASK_FILLS_KEPT = 4096  # grammar-mask fill timings kept for /metrics (a few minutes of constrained decoding)
ROW_PREFILL_CHUNKS = 4  # prefills with at most this many smallest chunks left advance in the batched call
# A piece is padded up to the chunk size covering it only while the padding is at most this share of it:
# padded positions cost full compute on CPU, so a larger waste is better split into smaller chunks.
MAX_PADDING_SHARE = 0.25
# The batched prefill costs about a full row of every slot, so it runs only when this share of the slots
# (and at least 2 prefills) would use it.
MIN_ROW_PREFILL_SHARE = 0.5
# Step times are smoothed (exponential moving average, this weight on the newest) so one slow step (a GC
# pause, a compile after start-up) does not flip the speculation decision.
STEP_TIME_SMOOTHING = 0.2
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
    # A lone plain-greedy stream runs prompt-lookup speculative steps (engine.verify) instead of decode steps:
    # same tokens, often several per step (scheduler/speculation.py). Several plain-greedy streams share a
    # batched verify step (engine.verify_rows, where the engine has that program and its products are exact)
    # when their drafts promise more tokens per second than a decode step.
    speculative: bool = True


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
    speculative_steps: int = 0  # verify steps (each also counted in decode_steps)
    batched_speculative_steps: int = 0  # of those, batched over several streams (engine.verify_rows)
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
        self.prefill_budget = self.config.prefill_budget or max(engine.config.chunk_sizes)
        self.kv = KVCacheManager(engine.num_slots, CacheConfig(
            prefix_caching=self.config.prefix_caching, host_tier_bytes=self.config.host_tier_bytes,
            min_snapshot_tokens=self.config.min_snapshot_tokens, min_wait_tokens=self.config.min_wait_tokens))
        self.stats = SchedulerStats()
        self.iteration = 0
        self._inbox: queue.Queue[Sequence] = queue.Queue()
        self._waiting: dict[str, deque[Sequence]] = {}
        self._pass: dict[str, float] = {}  # stride scheduling across groups
        self._prefilling: deque[Sequence] = deque()
        self._outbox: dict[RequestHandle, list[Event]] = {}
        self._lock = threading.Lock()
        self._waiting_count = 0
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # Wall seconds of recent decode steps and batched verify steps (moving averages), for the choice
        # between them; None until measured.
        self._step_seconds: dict[str, float | None] = {"decode": None, "verify_rows": None}
        # The latest batched grammar-mask fills, (seconds, constrained rows): read by /metrics.
        self.mask_fills: deque[tuple[float, int]] = deque(maxlen=MASK_FILLS_KEPT)
        self.failure: str | None = None  # why the engine loop died, once it has
        self.on_failure: Callable[[str], None] | None = None  # called on the engine thread after it died
        # The live slot snapshot (scheduler/snapshot.py): published by the engine thread a few times a second.
        self.snapshots = SnapshotPublisher()
        self._breaker_tables: BreakerTables | None = None  # DRY sequence breakers as token ids, on first use
        self._breaker_lock = threading.Lock()

    @property
    def slots(self) -> list[Slot]:
        return self.kv.slots

    @property
    def host(self) -> HostTier:
        return self.kv.host

    @property
    def snapshot(self) -> SchedulerSnapshot | None:
        """The latest published slot snapshot (any thread; never locks the engine)."""
        return self.snapshots.latest

    def counters(self) -> dict[str, int]:
        """Every counter: the scheduler's and the KV-cache manager's reuse counts."""
        return {**self.stats.as_dict(), **asdict(self.kv.stats)}

    # ---- caller side (any thread) ----------------------------------------------------------
    def submit(self, request: GenerationRequest, loop=None) -> RequestHandle:
        if self.failure is not None:
            raise EngineFailedError(f"the engine loop died ({self.failure})")
        generation_room(len(request.prompt_ids), self.engine.max_len)
        vocab = self.engine.cfg.vocab_size
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        handle = RequestHandle(request, loop)
        with self._lock:
            if self._waiting_count >= self.config.max_waiting:
                self.stats.rejected_queue_full += 1
                raise QueueFullError(f"{self._waiting_count} requests are already waiting; try again later")
            self._waiting_count += 1
            seq_id = self._next_id
            self._next_id += 1
        seed = request.sampling.seed
        seq = Sequence(
            id=seq_id, request=request, handle=handle,
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
        return self._waiting_count

    @property
    def prefilling(self) -> int:
        return len(self._prefilling)

    @property
    def running(self) -> int:
        return sum(slot.busy for slot in self.slots)

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._has_work():
                    try:
                        self._inbox_to_waiting(self._inbox.get(timeout=IDLE_POLL_S))
                    except queue.Empty:
                        self.snapshots.when_idle(self)
                        continue
                self.step()
        except BaseException as e:  # noqa: BLE001 - the loop is dead: say why, end every stream, tell the owner
            self.failure = f"{type(e).__name__}: {e}"
            log.exception("the engine loop died")
        finally:
            self._shutdown()
        if self.failure is not None and self.on_failure is not None:
            self.on_failure(self.failure)

    def _has_work(self) -> bool:
        return bool(self._waiting_count or self.running or not self._inbox.empty())

    def run_until_idle(self, max_iterations: int = 1_000_000) -> None:
        """Drive the loop on the calling thread until nothing is left (tests, offline use)."""
        for _ in range(max_iterations):
            if not self._has_work():
                return
            self.step()
        raise RuntimeError("scheduler did not become idle")

    def step(self) -> None:
        """One iteration: plan, execute on the engine, update, deliver events."""
        self._drain_inbox()
        self._reap_cancelled()
        plan = self._schedule()
        outcome = execute(self.engine, self.kv.host, plan)
        self._update(plan, outcome)
        self.stats.iterations += 1
        self.iteration += 1
        outbox, self._outbox = self._outbox, {}
        for handle, events in outbox.items():
            handle._deliver(events)
        self.snapshots.after_step(self, plan)

    def _emit(self, seq: Sequence, event: Event) -> None:
        self._outbox.setdefault(seq.handle, []).append(event)

    def _drain_inbox(self) -> None:
        while True:
            try:
                self._inbox_to_waiting(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _inbox_to_waiting(self, seq: Sequence) -> None:
        group = seq.group
        if group not in self._waiting or not self._waiting[group]:
            # A newly active group joins at the current minimum pass, not at zero (no banked credit).
            active = [self._pass[g] for g, q in self._waiting.items() if q]
            self._pass[group] = max(self._pass.get(group, 0.0), min(active, default=0.0))
        self._waiting.setdefault(group, deque()).append(seq)

    def _reap_cancelled(self) -> None:
        for q in self._waiting.values():
            for seq in [s for s in q if s.handle.cancelled.is_set()]:
                q.remove(seq)
                with self._lock:
                    self._waiting_count -= 1
                self._finish(seq, FinishReason.CANCELLED)
        for slot in self.slots:
            if slot.sequence is not None and slot.sequence.handle.cancelled.is_set():
                self._finish(slot.sequence, FinishReason.CANCELLED)

    # ---- plan --------------------------------------------------------------------------------
    def _schedule(self) -> StepPlan:
        plan = StepPlan()
        for seq in self._prefilling:
            if seq.awaiting is not None:
                self.kv.resolve(seq, plan.cache_ops)
        while self.kv.has_free_slot():
            seq = self._pick_next()
            if seq is None:
                break
            self.kv.place(seq, plan.cache_ops)
            seq.admitted_at = time.perf_counter()
            plan.admitted.append(seq)
            self._prefilling.append(seq)
            self.stats.requests_admitted += 1
            self.stats.prompt_tokens += len(seq.prompt)
        self._plan_prefill(plan)
        self._plan_decode(plan)
        return plan

    def _pick_next(self) -> Sequence | None:
        """Stride scheduling: the group with the smallest pass goes next; its pass grows by 1/priority."""
        candidates = [g for g, q in self._waiting.items() if q]
        if not candidates:
            return None
        group = min(candidates, key=lambda g: (self._pass[g], g))
        seq = self._waiting[group].popleft()
        self._pass[group] += 1.0 / seq.request.priority
        with self._lock:
            self._waiting_count -= 1
        return seq

    def _plan_prefill(self, plan: StepPlan) -> None:
        """Prefill chunks within the budget, the least remaining work first (a turn after a cache hit, or a
        request that waited for a shared prefix, is not queued behind a long new prompt); a chunk ends at a
        message boundary when that adds no padded call. One padded call for a whole piece when that wastes
        little (padding costs full compute on CPU), else the largest full chunk; a tail shorter than the
        smallest chunk runs padded in it."""
        budget = self._plan_rows(plan, self.prefill_budget)
        sizes = self.engine.config.chunk_sizes
        in_rows = {chunk.seq.id for chunk in plan.rows}
        ready = [seq for seq in self._prefilling if seq.awaiting is None and seq.id not in in_rows]
        for seq in sorted(ready, key=lambda s: len(s.prompt) - s.cursor):
            cursor = seq.cursor
            while budget > 0 and cursor < len(seq.prompt):
                piece = min(seq.next_boundary(cursor, sizes[0]) - cursor, sizes[-1])
                covering = next(size for size in sizes if size >= piece)
                fitting = [size for size in sizes if size <= min(piece, budget)]
                if covering <= budget and (not fitting or covering - piece <= piece * MAX_PADDING_SHARE):
                    n, cost = piece, covering
                elif fitting:
                    n = cost = fitting[-1]
                else:
                    return
                plan.chunks.append(PrefillChunk(seq, cursor, np.asarray(seq.prompt[cursor:cursor + n], np.int32)))
                budget -= cost
                cursor += n
            if budget <= 0:
                return

    def _plan_rows(self, plan: StepPlan, budget: int) -> int:
        """Advance many short prefills (at most a few smallest chunks left, e.g. chat turns after a prefix-cache
        hit) together: one batched call takes up to one smallest chunk of each, and samples the first tokens
        of those it completes. The call costs about S x chunk tokens whatever the count, so it runs only when
        at least half the slots would use it."""
        width, rows = self.engine.row_chunk, self.engine.num_slots
        short = [seq for seq in self._prefilling
                 if seq.awaiting is None and len(seq.prompt) - seq.cursor <= ROW_PREFILL_CHUNKS * width]
        if len(short) < max(2, rows * MIN_ROW_PREFILL_SHARE):
            return budget
        ends = [min(len(seq.prompt), seq.cursor + width) - 1 for seq in short]
        if not self.engine.compiled_for("prefill_rows", ends):  # still compiling after start-up
            return budget
        plan.rows = [PrefillChunk(seq, seq.cursor, np.asarray(seq.prompt[seq.cursor:seq.cursor + width], np.int32))
                     for seq in short]
        return max(0, budget - width * rows)  # may exceed a small budget: it replaces that many separate calls

    def _plan_decode(self, plan: StepPlan) -> None:
        running = [slot.sequence for slot in self.slots
                   if slot.sequence is not None and slot.sequence.state is SeqState.DECODING]
        if not running:
            return
        if len(running) == 1:
            plan.verify = self._speculate(running[0])
        else:
            plan.verify_rows = self._speculate_rows(running)
        if plan.verify is None and not plan.verify_rows:
            plan.decode = [StepRow(seq, [seq.generated[-1]], self.kv.held(seq)) for seq in running]

    def _may_speculate(self, seq: Sequence) -> bool:
        request = seq.request
        return self.config.speculative and speculation_allowed(request.sampling, request.constraint is not None,
                                                               request.want_logprobs)

    def _speculate(self, seq: Sequence) -> StepRow | None:
        """A verify step for a lone eligible stream, if the context suggests a draft; None: decode as usual."""
        if self.engine.config.verify_tokens < 2 or not self._may_speculate(seq):
            return None
        start = self.kv.held(seq)
        if not self.engine.compiled_for("verify", [start]):  # still compiling after start-up
            return None
        # verify_room keeps the chunk inside one attention bucket (so also within max_len)
        room = min(self.engine.verify_room(start) - 1, seq.max_tokens - len(seq.generated) - 1)
        draft = seq.draft(room)
        return StepRow(seq, [seq.generated[-1], *draft], start) if draft else None

    def _speculate_rows(self, running: list[Sequence]) -> list[StepRow]:
        """A batched verify step for several plain-greedy streams, each with its prompt-lookup draft (or none),
        when the drafts' expected accepted tokens per second beat a decode step's; []: decode as usual."""
        if not self.engine.rows_verify_exact or not all(self._may_speculate(seq) for seq in running):
            return []
        starts = [self.kv.held(seq) for seq in running]
        if not self.engine.compiled_for("verify_rows", starts):  # still compiling after start-up
            return []
        drafts = [seq.draft(min(room, seq.max_tokens - len(seq.generated)) - 1)
                  for seq, room in zip(running, self.engine.rows_verify_room(starts), strict=True)]
        expected = sum(sum(seq.draft_acceptance ** i for i in range(len(draft) + 1))
                       for seq, draft in zip(running, drafts, strict=True))
        if expected <= len(running) * self._rows_verify_cost():
            return []
        return [StepRow(seq, [seq.generated[-1], *draft], start)
                for seq, draft, start in zip(running, drafts, starts, strict=True)]

    def _rows_verify_cost(self) -> float:
        """A batched verify step's time over a decode step's: measured once both ran, else a prior (about 1.5
        on a 2-core CPU at 8 slots x 3 tokens)."""
        decode, verify = self._step_seconds["decode"], self._step_seconds["verify_rows"]
        return verify / decode if decode and verify else ROWS_VERIFY_COST_PRIOR

    # ---- update ------------------------------------------------------------------------------
    def _update(self, plan: StepPlan, outcome: StepOutcome) -> None:
        if plan.rows:
            self.stats.batched_prefills += 1
            self.stats.prefill_chunks += 1
        self.stats.prefill_chunks += len(plan.chunks)
        for chunk in plan.rows + plan.chunks:
            seq = chunk.seq
            self.kv.extend(seq.slot, chunk.tokens.tolist())
            seq.cursor = chunk.end
            self.stats.prefill_tokens += len(chunk.tokens)
            if chunk.last:
                self._prefilling.remove(seq)
                seq.state = SeqState.DECODING
                self.stats.cached_tokens += seq.cached_tokens
                self.stats.cache_hit_requests += seq.cached_tokens > 0
                result, row = outcome.first[seq.id]
                self._accept(seq, result, row)
        self.mask_fills.extend(outcome.mask_fills)
        for kind, seconds in outcome.seconds.items():
            last = self._step_seconds[kind]
            self._step_seconds[kind] = seconds if last is None else (
                (1 - STEP_TIME_SMOOTHING) * last + STEP_TIME_SMOOTHING * seconds)
        if plan.decode:
            self.stats.decode_steps += 1
            for row in plan.decode:
                self.kv.extend(row.seq.slot, row.inputs)
                self._accept(row.seq, outcome.decoded, row.seq.slot)
        verified = [plan.verify] if plan.verify is not None else plan.verify_rows
        if verified:
            self.stats.decode_steps += 1
            self.stats.speculative_steps += 1
            self.stats.batched_speculative_steps += bool(plan.verify_rows)
            for row in verified:
                self._accept_verified(row, outcome.verified[row.seq.id])

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
        token = int(result.tokens[row])
        if token < 0:
            self._finish(seq, FinishReason.ERROR, "no token is allowed here (constraint dead end)")
            return
        seq.generated.append(token)
        if seq.dry is not None:
            seq.dry.push(token)
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        constraint = seq.request.constraint
        if constraint is not None and token not in self.stop_ids:
            if not constraint.consume(token):
                # The mask allowed it, so this means the grammar and the mask disagree: never pass it on.
                self._finish(seq, FinishReason.ERROR, f"grammar rejected token {token}: {constraint.error}")
                return
            if constraint.keys is not None:
                constraint.keys.feed_token(token)
        if token in self.stop_ids and not seq.request.ignore_eos:
            self._finish(seq, FinishReason.STOP)
            return
        text = seq.detokenizer.push(token)
        stopped = False
        if seq.stop_matcher is not None:
            text, stopped = seq.stop_matcher.push(text)
        event = TokenEvent(token_id=token, text=text, iteration=self.iteration)
        if seq.request.sampling.logprobs or seq.request.want_logprobs:
            event.logprob = float(result.logprobs[row])
            top = seq.request.sampling.logprobs
            event.top_logprobs = [(int(i), float(lp)) for i, lp in
                                  zip(result.top_ids[row][:top], result.top_logprobs[row][:top], strict=True)]
        self._emit(seq, event)
        if stopped or (constraint is not None and constraint.is_finished()):
            self._finish(seq, FinishReason.STOP)
        elif len(seq.generated) >= seq.max_tokens or self.kv.held(seq) >= self.engine.max_len:
            self._finish(seq, FinishReason.LENGTH)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        tail = ""
        if reason in (FinishReason.STOP, FinishReason.LENGTH) and not (seq.stop_matcher and seq.stop_matcher.stopped):
            tail = seq.detokenizer.flush()
            if seq.stop_matcher is not None:
                tail, stopped = seq.stop_matcher.push(tail)
                tail += "" if stopped else seq.stop_matcher.flush()
                reason = FinishReason.STOP if stopped else reason
        now = time.perf_counter()
        timings = {"total_s": now - seq.arrival}
        if seq.admitted_at is not None:
            timings["queue_s"] = seq.admitted_at - seq.arrival
        if seq.first_token_at is not None:
            timings["ttft_s"] = seq.first_token_at - seq.arrival
            if len(seq.generated) > 1:
                timings["decode_tokens_per_s"] = (len(seq.generated) - 1) / max(now - seq.first_token_at, 1e-9)
        usage = Usage(prompt_tokens=len(seq.prompt), cached_tokens=seq.cached_tokens,
                      completion_tokens=len(seq.generated))
        matched = seq.stop_matcher.matched if seq.stop_matcher is not None else None
        closed = seq.budget is not None and seq.budget.closing and reason is FinishReason.STOP
        self.stats.budget_closed += closed
        self._emit(seq, FinishEvent(reason=reason, usage=usage, text=tail, error=error, timings=timings,
                                    stop_sequence=matched, budget_closed=closed))
        if seq.slot is not None:
            self.kv.release(seq)
            if seq in self._prefilling:
                self._prefilling.remove(seq)
        seq.state = SeqState.FINISHED
        self.stats.requests_finished += 1
        self.stats.cancelled += reason is FinishReason.CANCELLED

    def _shutdown(self) -> None:
        """Engine thread exit: end every stream with a finish event (an error one if the loop died)."""
        reason, why = ((FinishReason.ERROR, f"the engine loop died ({self.failure})") if self.failure is not None
                       else (FinishReason.CANCELLED, "server shutting down"))
        self._drain_inbox()
        for q in self._waiting.values():
            while q:
                with self._lock:
                    self._waiting_count -= 1
                self._finish(q.popleft(), reason, why)
        for slot in self.slots:
            if slot.sequence is not None:
                self._finish(slot.sequence, reason, why)
        outbox, self._outbox = self._outbox, {}
        for handle, events in outbox.items():
            handle._deliver(events)
