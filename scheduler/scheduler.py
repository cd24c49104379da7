"""Continuous batching of many sessions over the engine's KV slots, with prefix caching.

One thread owns the engine. Each iteration: take new submissions, drop cancelled requests, admit
waiting requests into free slots (fair across agents), run at most `prefill_budget` tokens of
prefill (so a long prompt delays running streams by one chunk at most), then one batched decode
step for every decoding slot. Events are handed to each request's handle once per iteration.

Prefix caching: a request resumes from the longest usable prefix found in its own slot, another
slot (device copy) or the host tier (restore). Sliding-window layers keep only the last `window`
positions, so a slot holding `held` tokens can resume only at n >= held - 1 (or anywhere while
nothing has wrapped); the host tier therefore stores snapshots at exact prefix boundaries: where
callers hint (the end of a shared system prompt) and whole conversations evicted from a slot.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from core.engine import Engine, SampleResult, SlotSnapshot
from core.sampling import batch_needs_full
from core.tokenizer import Tokenizer
from scheduler.grammar import fill_masks
from scheduler.host_tier import HostTier
from scheduler.request import (
    ContextLengthError,
    Event,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    QueueFullError,
    RequestHandle,
    TokenEvent,
    Usage,
)
from scheduler.sequence import SeqState, Sequence
from scheduler.slots import Slot, common_prefix
from scheduler.speculation import speculation_allowed
from scheduler.stop_strings import StopMatcher

log = logging.getLogger(__name__)
ROWS_VERIFY_COST_PRIOR = 1.5


@dataclass(frozen=True)
class SchedulerConfig:
    prefill_budget: int | None = None  # prefill tokens per iteration; None: the engine's largest chunk
    max_waiting: int = 256  # bounded admission queue; beyond it submit() raises QueueFullError
    prefix_caching: bool = True
    host_tier_bytes: int = 2 * 2**30
    min_snapshot_tokens: int = 16  # contexts shorter than this are cheaper to recompute than to store
    # A lone plain-greedy stream runs prompt-lookup speculative steps (engine.verify) instead of decode steps:
    # same tokens, often several per step (scheduler/speculation.py). Several plain-greedy streams share a
    # batched verify step (engine.verify_rows, where the engine's products are exact) when their drafts
    # promise more tokens per second than a decode step.
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
    slot_reuses: int = 0
    device_copies: int = 0
    host_restores: int = 0
    host_saves: int = 0
    rejected_queue_full: int = 0
    cancelled: int = 0
    batched_prefills: int = 0  # calls that prefilled several short prompts at once (engine.prefill_rows)
    speculative_steps: int = 0  # verify steps (each also counted in decode_steps)
    batched_speculative_steps: int = 0  # of those, batched over several streams (engine.verify_rows)
    draft_tokens: int = 0  # drafted tokens sent to verify steps
    accepted_draft_tokens: int = 0  # of those, accepted (tokens gained over plain decode steps)

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
        self.slots = [Slot(i) for i in range(engine.num_slots)]
        self.host = HostTier[SlotSnapshot](self.config.host_tier_bytes)
        self.stats = SchedulerStats()
        self.iteration = 0
        self._inbox: queue.Queue[Sequence] = queue.Queue()
        self._waiting: dict[str, deque[Sequence]] = {}
        self._pass: dict[str, float] = {}  # stride scheduling across agents
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

    # ---- caller side (any thread) ----------------------------------------------------------
    def submit(self, request: GenerationRequest, loop=None) -> RequestHandle:
        if len(request.prompt_ids) >= self.engine.max_len:
            raise ContextLengthError(
                f"prompt of {len(request.prompt_ids)} tokens exceeds the context length "
                f"({self.engine.max_len} positions including at least one generated token)")
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
        seed = request.seed if request.seed is not None else request.sampling.seed
        seq = Sequence(
            id=seq_id, request=request, handle=handle,
            detokenizer=self.tokenizer.detokenizer(skip_special=True),
            stop_matcher=StopMatcher(request.stop) if request.stop else None,
            max_tokens=request.max_tokens,
            seed=seed if seed is not None else random.getrandbits(31),
        )
        self._inbox.put(seq)
        return handle

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
                        self._inbox_to_waiting(self._inbox.get(timeout=0.05))
                    except queue.Empty:
                        continue
                self.step()
        finally:
            self._shutdown()

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
        """One iteration: admit, one prefill budget, one decode step, deliver events."""
        self._drain_inbox()
        self._reap_cancelled()
        self._admit()
        self._prefill()
        self._decode()
        self.stats.iterations += 1
        self.iteration += 1
        outbox, self._outbox = self._outbox, {}
        for handle, events in outbox.items():
            handle._deliver(events)

    def _emit(self, seq: Sequence, event: Event) -> None:
        self._outbox.setdefault(seq.handle, []).append(event)

    def _drain_inbox(self) -> None:
        while True:
            try:
                self._inbox_to_waiting(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _inbox_to_waiting(self, seq: Sequence) -> None:
        agent = seq.agent
        if agent not in self._waiting or not self._waiting[agent]:
            # A newly active agent joins at the current minimum pass, not at zero (no banked credit).
            active = [self._pass[a] for a, q in self._waiting.items() if q]
            self._pass[agent] = max(self._pass.get(agent, 0.0), min(active, default=0.0))
        self._waiting.setdefault(agent, deque()).append(seq)

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

    # ---- admission ---------------------------------------------------------------------------
    def _pick_next(self) -> Sequence | None:
        """Stride scheduling: the agent with the smallest pass goes next; its pass grows by 1/priority."""
        candidates = [a for a, q in self._waiting.items() if q]
        if not candidates:
            return None
        agent = min(candidates, key=lambda a: (self._pass[a], a))
        seq = self._waiting[agent].popleft()
        self._pass[agent] += 1.0 / seq.request.priority
        with self._lock:
            self._waiting_count -= 1
        return seq

    def _admit(self) -> None:
        while any(not slot.busy for slot in self.slots):
            seq = self._pick_next()
            if seq is None:
                return
            self._place(seq)

    def _usable(self, slot: Slot, prompt: tuple[int, ...]) -> int:
        """Prompt positions this slot can serve: the common prefix, short of the last prompt token
        (whose logits must be computed), and only where the slot's ring still allows resuming."""
        n = min(common_prefix(slot.tokens, prompt), len(prompt) - 1)
        return n if n > 0 and self.engine.can_resume(n, slot.held) else 0

    def _place(self, seq: Sequence) -> None:
        prompt = seq.prompt
        session = seq.request.session
        free = [s for s in self.slots if not s.busy]
        caching = self.config.prefix_caching
        usable = {s.index: self._usable(s, prompt) for s in self.slots} if caching else {}

        affine = [s for s in free if session is not None and s.session == session]
        if affine:
            target = affine[0]
        elif caching and max(usable[s.index] for s in free) > 0:
            target = max(free, key=lambda s: (usable[s.index], -s.last_used))
        else:
            target = min(free, key=lambda s: (s.held > 0, s.last_used))

        own = usable.get(target.index, 0)
        donor = max((s for s in self.slots if s is not target), key=lambda s: usable.get(s.index, 0), default=None)
        donor_n = usable.get(donor.index, 0) if donor is not None else 0
        host_hit = self.host.lookup(prompt) if caching else None
        host_n = min(host_hit[0], len(prompt) - 1) if host_hit else 0

        cursor = max(own, donor_n, host_n)
        if not (cursor == own and session is not None and target.session == session):
            self._save_to_host(target)  # another conversation is about to be overwritten: keep it on the host
        if cursor == 0:
            pass
        elif cursor == own:
            self.stats.slot_reuses += 1
        elif cursor == donor_n:
            self.engine.copy_prefix(donor.index, target.index, donor_n, donor.held)
            self.stats.device_copies += 1
        else:
            self.engine.restore_slot(target.index, host_hit[1])
            self.stats.host_restores += 1
        target.tokens = list(prompt[:cursor])
        target.session = session
        target.sequence = seq
        target.last_used = time.perf_counter()

        seq.slot = target.index
        seq.admitted_at = time.perf_counter()
        seq.cursor = seq.cached_tokens = cursor
        seq.state = SeqState.PREFILLING
        seq.snapshot_points = sorted(
            h for h in set(seq.request.cache_hints)
            if cursor < h <= len(prompt) and h >= self.config.min_snapshot_tokens and caching
            and not self.host.contains(prompt[:h])
        )
        self.engine.begin_request(target.index, seq.request.sampling, list(prompt), seq.seed)
        self._prefilling.append(seq)
        self.stats.requests_admitted += 1
        self.stats.prompt_tokens += len(prompt)
        self.stats.cached_tokens += cursor
        self.stats.cache_hit_requests += cursor > 0

    def _mask_buffer(self, rows: int) -> np.ndarray:
        """All tokens allowed ([rows, ceil(V/32)] uint32); constrained rows are overwritten by fill_masks."""
        words = -(-self.engine.cfg.vocab_size // 32)
        return np.full((rows, words), 0xFFFFFFFF, np.uint32)

    def _save_to_host(self, slot: Slot) -> None:
        if (not self.config.prefix_caching or slot.held < self.config.min_snapshot_tokens
                or self.host.contains(slot.tokens)):
            return
        if self.host.put(list(slot.tokens), self.engine.save_slot(slot.index, 0, slot.held)):
            self.stats.host_saves += 1

    # ---- prefill -----------------------------------------------------------------------------
    def _prefill(self) -> None:
        budget = self._prefill_together(self.prefill_budget)
        sizes = self.engine.config.chunk_sizes
        while budget > 0 and self._prefilling:
            seq = self._prefilling[0]
            slot = self.slots[seq.slot]
            boundary = seq.snapshot_points[0] if seq.snapshot_points else len(seq.prompt)
            piece = min(boundary - seq.cursor, sizes[-1])
            # One padded call for the whole piece when that wastes little (padding costs full compute on CPU),
            # else the largest full chunk; a tail shorter than the smallest chunk runs padded in it.
            covering = next(size for size in sizes if size >= piece)
            fitting = [size for size in sizes if size <= min(piece, budget)]
            if covering <= budget and (not fitting or covering - piece <= piece // 4):
                n, cost = piece, covering
            elif fitting:
                n = cost = fitting[-1]
            else:
                break
            tokens = np.asarray(seq.prompt[seq.cursor:seq.cursor + n], np.int32)
            logits = self.engine.prefill_chunk(slot.index, tokens, seq.cursor)
            budget -= cost
            seq.cursor += n
            slot.tokens.extend(seq.prompt[seq.cursor - n:seq.cursor])
            self.stats.prefill_chunks += 1
            self.stats.prefill_tokens += n
            if seq.snapshot_points and seq.cursor == seq.snapshot_points[0]:
                seq.snapshot_points.pop(0)
                if self.host.put(list(seq.prompt[:seq.cursor]), self.engine.save_slot(slot.index, 0, seq.cursor)):
                    self.stats.host_saves += 1
            if seq.cursor == len(seq.prompt):
                self._prefilling.popleft()
                seq.state = SeqState.DECODING
                mask = None
                if seq.request.constraint is not None:
                    mask = self._mask_buffer(1)
                    fill_masks([(seq.request.constraint, 0)], mask)
                self._accept(seq, self.engine.sample_slot(slot.index, logits, step=0, mask=mask), 0)

    def _prefill_together(self, budget: int) -> int:
        """Finish many short prompts (at most the smallest chunk left, e.g. chat turns after a prefix-cache
        hit) in one batched call and sample their first tokens together. The call costs about S x chunk
        tokens whatever the count, so it runs only when at least half the slots would use it."""
        width, rows = self.engine.row_chunk, self.engine.num_slots
        cost = width * rows
        short = [seq for seq in self._prefilling
                 if not seq.snapshot_points and len(seq.prompt) - seq.cursor <= width]
        if len(short) < max(2, rows // 2):
            return budget
        logits = self.engine.prefill_rows([(seq.slot, np.asarray(seq.prompt[seq.cursor:], np.int32), seq.cursor)
                                           for seq in short])
        self.stats.batched_prefills += 1
        self.stats.prefill_chunks += 1
        active = np.zeros(rows, bool)
        for seq in short:
            self.stats.prefill_tokens += len(seq.prompt) - seq.cursor
            self.slots[seq.slot].tokens.extend(seq.prompt[seq.cursor:])
            seq.cursor = len(seq.prompt)
            seq.state = SeqState.DECODING
            self._prefilling.remove(seq)
            active[seq.slot] = True
        constrained = [(q.request.constraint, q.slot) for q in short if q.request.constraint is not None]
        mask = None
        if constrained:
            mask = self._mask_buffer(rows)
            fill_masks(constrained, mask)
        result = self.engine.sample(logits, active, np.zeros(rows, np.int32), mask=mask,
                                    needs_full=batch_needs_full(q.request.sampling for q in short))
        for seq in short:
            self._accept(seq, result, seq.slot)
        return max(0, budget - cost)  # may exceed a small budget: it replaces that many separate calls

    # ---- decode ------------------------------------------------------------------------------
    def _decode(self) -> None:
        running = [slot.sequence for slot in self.slots
                   if slot.sequence is not None and slot.sequence.state is SeqState.DECODING]
        if not running or (self._speculate(running[0]) if len(running) == 1 else self._speculate_rows(running)):
            return
        begin = time.perf_counter()
        s = self.engine.num_slots
        tokens, positions, steps = (np.zeros(s, np.int32) for _ in range(3))
        active = np.zeros(s, bool)
        for seq in running:
            tokens[seq.slot] = seq.generated[-1]
            positions[seq.slot] = self.slots[seq.slot].held
            steps[seq.slot] = len(seq.generated)
            active[seq.slot] = True
        logits = self.engine.decode(tokens, positions, active)  # dispatched; the device computes meanwhile
        constrained = [(q.request.constraint, q.slot) for q in running if q.request.constraint is not None]
        mask = None
        if constrained:  # fill the grammar masks on the host while the forward pass runs
            mask = self._mask_buffer(s)
            fill_masks(constrained, mask)
        result = self.engine.sample(logits, active, steps, mask=mask,
                                    needs_full=batch_needs_full(q.request.sampling for q in running))
        self._record_step("decode", begin)
        self.stats.decode_steps += 1
        for seq in running:
            self.slots[seq.slot].tokens.append(int(tokens[seq.slot]))
            self._accept(seq, result, seq.slot)

    def _record_step(self, kind: str, begin: float) -> None:
        seconds = time.perf_counter() - begin
        last = self._step_seconds[kind]
        self._step_seconds[kind] = seconds if last is None else 0.8 * last + 0.2 * seconds

    def _may_speculate(self, seq: Sequence) -> bool:
        request = seq.request
        return self.config.speculative and speculation_allowed(request.sampling, request.constraint is not None,
                                                               request.want_logprobs)

    def _speculate(self, seq: Sequence) -> bool:
        """One verify step for a lone eligible stream, if the context suggests a draft; False: decode as usual."""
        if self.engine.config.verify_tokens < 2 or not self._may_speculate(seq):
            return False
        slot = self.slots[seq.slot]
        start = slot.held
        # verify_room keeps the chunk inside one attention bucket (so also within max_len)
        room = min(self.engine.verify_room(start) - 1, seq.max_tokens - len(seq.generated) - 1)
        draft = seq.draft(room)
        if not draft:
            return False
        inputs = [seq.generated[-1], *draft]
        out = self.engine.verify(seq.slot, inputs, start)
        self.stats.decode_steps += 1
        self.stats.speculative_steps += 1
        self._accept_verified(seq, inputs, out)
        return True

    def _speculate_rows(self, running: list[Sequence]) -> bool:
        """One batched verify step for several plain-greedy streams, each with its prompt-lookup draft (or none),
        when the drafts' expected accepted tokens per second beat a decode step's; False: decode as usual."""
        if not self.engine.rows_verify_exact or not all(self._may_speculate(seq) for seq in running):
            return False
        starts = [self.slots[seq.slot].held for seq in running]
        drafts = [seq.draft(min(room, seq.max_tokens - len(seq.generated)) - 1)
                  for seq, room in zip(running, self.engine.rows_verify_room(starts), strict=True)]
        expected = sum(sum(seq.draft_acceptance ** i for i in range(len(draft) + 1))
                       for seq, draft in zip(running, drafts, strict=True))
        if expected <= len(running) * self._rows_verify_cost():
            return False
        begin = time.perf_counter()
        inputs = [[seq.generated[-1], *draft] for seq, draft in zip(running, drafts, strict=True)]
        out = self.engine.verify_rows([(seq.slot, row, start)
                                       for seq, row, start in zip(running, inputs, starts, strict=True)])
        self._record_step("verify_rows", begin)
        self.stats.decode_steps += 1
        self.stats.speculative_steps += 1
        self.stats.batched_speculative_steps += 1
        for seq, row in zip(running, inputs, strict=True):
            self._accept_verified(seq, row, out[seq.slot])
        return True

    def _rows_verify_cost(self) -> float:
        """A batched verify step's time over a decode step's: measured once both ran, else a prior (about 1.5
        on a 2-core CPU at 8 slots x 3 tokens)."""
        decode, verify = self._step_seconds["decode"], self._step_seconds["verify_rows"]
        return verify / decode if decode and verify else ROWS_VERIFY_COST_PRIOR

    def _accept_verified(self, seq: Sequence, inputs: list[int], out: list[int]) -> None:
        """Deliver a verify step's tokens: out[i] follows inputs[i]; stops early if the sequence finishes."""
        self.stats.draft_tokens += len(inputs) - 1
        self.stats.accepted_draft_tokens += len(out) - 1
        seq.drafted += len(inputs) - 1
        seq.accepted += len(out) - 1
        n = len(out)
        result = SampleResult(np.asarray(out, np.int32), np.zeros(n, np.float32), np.zeros((n, 0), np.int32),
                              np.zeros((n, 0), np.float32))
        slot = self.slots[seq.slot]
        for row, token in enumerate(inputs[:n]):
            slot.tokens.append(token)  # the token whose K/V this step wrote
            self._accept(seq, result, row)
            if seq.state is SeqState.FINISHED:
                break

    def _accept(self, seq: Sequence, result: SampleResult, row: int) -> None:
        token = int(result.tokens[row])
        if token < 0:
            self._finish(seq, FinishReason.ERROR, "no token is allowed here (constraint dead end)")
            return
        seq.generated.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        constraint = seq.request.constraint
        if constraint is not None and token not in self.stop_ids and not constraint.consume(token):
            # The mask allowed it, so this means the grammar and the mask disagree: never pass it on.
            self._finish(seq, FinishReason.ERROR, f"grammar rejected token {token}: {constraint.error}")
            return
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
        elif len(seq.generated) >= seq.max_tokens or self.slots[seq.slot].held >= self.engine.max_len:
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
        self._emit(seq, FinishEvent(reason=reason, usage=usage, text=tail, error=error, timings=timings))
        if seq.slot is not None:
            slot = self.slots[seq.slot]
            slot.sequence = None
            slot.last_used = now
            if seq in self._prefilling:
                self._prefilling.remove(seq)
                slot.tokens = slot.tokens[:seq.cursor]
        seq.state = SeqState.FINISHED
        self.stats.requests_finished += 1
        self.stats.cancelled += reason is FinishReason.CANCELLED

    def _shutdown(self) -> None:
        """Engine thread exit: end every stream cleanly."""
        self._drain_inbox()
        for q in self._waiting.values():
            while q:
                with self._lock:
                    self._waiting_count -= 1
                self._finish(q.popleft(), FinishReason.CANCELLED, "server shutting down")
        for slot in self.slots:
            if slot.sequence is not None:
                self._finish(slot.sequence, FinishReason.CANCELLED, "server shutting down")
        outbox, self._outbox = self._outbox, {}
        for handle, events in outbox.items():
            handle._deliver(events)
