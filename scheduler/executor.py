"""The one place the scheduler calls the engine: run a `StepPlan` and return what it produced.

Order within an iteration: cache operations (each planned against the slots as the previous ones left them),
sampling state for newly admitted sequences, the batched prefill, single-slot prefill chunks, then one decode
or verify step. Grammar masks for constrained rows are filled on the host while the device computes the
step they are for; a decode step with no constrained row samples inside the decode program where the engine
has one (`Engine.dispatch_decode_sample`), and its tokens are read by `finish_decode` once the scheduler has
had the chance to queue the next step behind it (`dispatch_follow_on`).
"""

from __future__ import annotations

import time

import numpy as np

from core.engine import FOLLOWING, Engine, SampleResult
from core.sampling import SlotRequest, batch_needs_full
from scheduler.disk_tier import DiskTier
from scheduler.grammar import fill_masks
from scheduler.host_tier import HostTier
from scheduler.plan import CopyPrefix, PrefillChunk, RestoreFromHost, SaveToHost, StepOutcome, StepPlan
from scheduler.sequence import Sequence
from scheduler.slots import Slot


def execute(engine: Engine, host: HostTier, plan: StepPlan) -> StepOutcome:
    out = StepOutcome()
    for op in plan.cache_ops:
        if isinstance(op, SaveToHost):
            # the copy off the device is not waited for: the host tier stores the run as it lands
            host.insert(op.scope, op.tokens, engine.save_slot(op.slot, op.start, len(op.tokens), wait=False))
        elif isinstance(op, CopyPrefix):
            engine.copy_prefix(op.src, op.dst, op.n)
        elif isinstance(op, RestoreFromHost):
            engine.restore_slot(op.slot, op.snapshot)
    for seq in plan.admitted:
        engine.use_adapter(seq.slot, seq.adapter_slot)
    if plan.admitted:
        engine.begin_requests([SlotRequest(seq.slot, seq.request.sampling, seq.prompt, seq.seed,
                                           seq.dry.table.single if seq.dry is not None else None,
                                           seq.request.reports_logprobs) for seq in plan.admitted])
    if plan.rows:
        _prefill_rows(engine, plan, out)
    for chunk in plan.chunks:
        _first_token(engine, chunk, engine.prefill_chunk(chunk.seq.slot, chunk.tokens, chunk.start), out)
    if plan.decode:
        _decode(engine, plan, out)
    if plan.verify is not None:
        row = plan.verify
        out.verified[row.seq.id] = engine.verify(row.seq.slot, row.inputs, row.start, len(row.seq.generated))
    if plan.verify_rows:
        begin, ran = time.perf_counter(), engine.programs.programs_run()
        tokens = engine.verify_rows([(row.seq.slot, row.inputs, row.start) for row in plan.verify_rows],
                                    [len(row.seq.generated) for row in plan.verify_rows])
        _record_time(engine, out, "verify_rows", begin, ran)
        for row in plan.verify_rows:
            out.verified[row.seq.id] = tokens[row.seq.slot]
    return out


def persist_slot(engine: Engine, disk: DiskTier, slot: Slot, boundaries: tuple[int, ...] = ()) -> int:
    """Queue what the disk tier lacks of a slot's KV, with tails at ``boundaries`` (positions where a later
    prompt may diverge). Only the read of the slot is queued here, behind the device's work; its copy to the
    host and the files are made on the disk tier's thread (a finished stream's last token is not held back
    by the copy: ~5 ms a save off a TPU v5e, benchmarks/slot_save.py). Returns the files queued."""
    tokens = tuple(slot.tokens)
    return disk.store_missing(slot.scope, tokens,
                              lambda start: engine.save_slot(slot.index, start, len(tokens), wait=False), boundaries)


def mask_buffer(engine: Engine, rows: int) -> np.ndarray:
    """All tokens allowed ([rows, ceil(V/32)] uint32); constrained rows are overwritten by fill_masks."""
    return np.full((rows, -(-engine.cfg.vocab_size // 32)), 0xFFFFFFFF, np.uint32)


def constraint_masks(engine: Engine, rows: list[tuple[Sequence, int]], n_rows: int, out: StepOutcome
                     ) -> np.ndarray | None:
    """The allowed-token bitmask [n_rows, ceil(V/32)] for sequences at the given rows (None when none is
    constrained): each constrained row its grammar's mask, or only the token that closes its document within
    max_tokens (scheduler.budget_close); the fill's time goes into ``out``."""
    constrained = [(seq, row) for seq, row in rows if seq.request.constraint is not None]
    if not constrained:
        return None
    mask = mask_buffer(engine, n_rows)
    begin = time.perf_counter()
    fill_masks([(seq.request.constraint, row) for seq, row in constrained], mask)
    for seq, row in constrained:
        keys = seq.request.constraint.keys
        if keys is not None and keys.checks:
            keys.drop_repeats(mask[row])
        if seq.budget is not None:
            seq.budget.narrow(seq.request.constraint, len(seq.generated), seq.max_tokens, mask[row])
    out.mask_fills.append((time.perf_counter() - begin, len(constrained)))
    return mask


def _prefill_rows(engine: Engine, plan: StepPlan, out: StepOutcome) -> None:
    logits = engine.prefill_rows([(chunk.seq.slot, chunk.tokens, chunk.start) for chunk in plan.rows])
    done = [chunk.seq for chunk in plan.rows if chunk.last]
    if done:
        result = _sample_rows(engine, logits, done, np.zeros(engine.num_slots, np.int32), out)
        for seq in done:
            out.first[seq.id] = (result, seq.slot)


def _first_token(engine: Engine, chunk: PrefillChunk, logits, out: StepOutcome) -> None:
    """Sample a sequence's first token from its prompt's last chunk's logits [V] (nothing for other chunks)."""
    if chunk.last:
        mask = constraint_masks(engine, [(chunk.seq, 0)], 1, out)
        limit = chunk.seq.dry.limit if chunk.seq.dry is not None else 0
        out.first[chunk.seq.id] = (engine.sample_slot(chunk.seq.slot, logits, step=0, mask=mask,
                                                      dry_limit=limit), 0)


def _record_time(engine: Engine, out: StepOutcome, kind: str, begin: float, programs_ran: int) -> None:
    """A step's wall time, for the planner's cost estimates and the metrics, unless it was a program's first
    run (`ProgramTable.programs_run` moved): one-time set-up would make that step look several times dearer,
    and the planner would not try a batched verify again to correct it."""
    if engine.programs.programs_run() == programs_ran:
        out.seconds[kind] = time.perf_counter() - begin


def dispatch_follow_on(engine: Engine, plan: StepPlan, previous: StepOutcome) -> StepOutcome:
    """Queue ``plan``'s decode step (`Planner.follow_on`: every row's input is the token ``previous`` samples
    for it, read on the device) before ``previous``'s tokens are read; `finish_decode` reads its own."""
    out = StepOutcome()
    tokens, positions, active, steps = _decode_rows(engine, plan)
    seqs = [row.seq for row in plan.decode]
    out.pending = engine.dispatch_decode_sample(tokens, positions, active, steps,
                                                batch_needs_full(seq.request.sampling for seq in seqs),
                                                _dry_limits(engine, seqs), follows=previous.pending)
    return out


def finish_decode(engine: Engine, out: StepOutcome, follow_on: StepOutcome | None = None) -> None:
    """Wait for a dispatched decode step's tokens (`StepOutcome.pending`) and record its time; a follow-on
    step already queued behind it counts its time from here (the device starts it as this one ends)."""
    if out.pending is not None:
        out.decoded = out.pending.result()
        if out.began is not None:
            _record_time(engine, out, "decode", *out.began)
    if follow_on is not None:
        follow_on.began = (time.perf_counter(), engine.programs.programs_run())


def _decode_rows(engine: Engine, plan: StepPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A decode step's inputs, each [S]: tokens, positions, which slots are active, and how many tokens each
    has generated (an input of FOLLOWING is the token the previous step samples, one more than generated)."""
    s = engine.num_slots
    tokens, positions, steps = (np.zeros(s, np.int32) for _ in range(3))
    active = np.zeros(s, bool)
    for row in plan.decode:
        slot = row.seq.slot
        tokens[slot], positions[slot] = row.inputs[0], row.start
        steps[slot] = len(row.seq.generated) + (row.inputs[0] == FOLLOWING)
        active[slot] = True
    return tokens, positions, active, steps


def _decode(engine: Engine, plan: StepPlan, out: StepOutcome) -> None:
    begin, ran = time.perf_counter(), engine.programs.programs_run()
    tokens, positions, active, steps = _decode_rows(engine, plan)
    seqs = [row.seq for row in plan.decode]
    needs_full = batch_needs_full(seq.request.sampling for seq in seqs)
    carried = plan.carried
    if carried is not None:  # its time is not a decode step's (the speculation estimates compare those)
        logits, chunk_logits = engine.decode_with_chunk(tokens, positions, active, carried.seq.slot,
                                                        carried.tokens, carried.start)
        _first_token(engine, carried, chunk_logits, out)
        out.decoded = _sample_rows(engine, logits, seqs, steps, out)
        return
    if all(seq.request.constraint is None for seq in seqs) and engine.fused_ready(positions, needs_full):
        # read by finish_decode, after the scheduler may have queued the next step behind it
        out.pending = engine.dispatch_decode_sample(tokens, positions, active, steps, needs_full,
                                                    _dry_limits(engine, seqs))
        out.began = (begin, ran)
        return
    logits = engine.decode(tokens, positions, active)  # dispatched; the device computes meanwhile
    out.decoded = _sample_rows(engine, logits, seqs, steps, out)
    _record_time(engine, out, "decode", begin, ran)


def _sample_rows(engine: Engine, logits, seqs, steps: np.ndarray, out: StepOutcome) -> SampleResult:
    """Sample every listed sequence's row of logits [S, V] (masks filled while the logits compute; the fill's
    time is recorded in ``out``)."""
    active = np.zeros(engine.num_slots, bool)
    active[[seq.slot for seq in seqs]] = True
    mask = constraint_masks(engine, [(seq, seq.slot) for seq in seqs], engine.num_slots, out)
    return engine.sample(logits, active, steps, mask=mask, dry_limits=_dry_limits(engine, seqs),
                         needs_full=batch_needs_full(seq.request.sampling for seq in seqs))


def _dry_limits(engine: Engine, seqs: list[Sequence]) -> np.ndarray:
    """[S]: each DRY sequence's repeat limit at its slot (others 0, ignored)."""
    limits = np.zeros(engine.num_slots, np.int32)
    for seq in seqs:
        if seq.dry is not None:
            limits[seq.slot] = seq.dry.limit
    return limits
