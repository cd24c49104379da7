"""What a sampled token does to its sequence: the grammar advances, the text is detokenized and matched
against stop strings, and the sequence either goes on or finishes (and why). Also the finish event: the
text held back, the usage and the timings. No engine and no slots here: the scheduler applies the verdict
(KV, slots, delivery), so every rule can be tested on a sequence alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.request import FinishEvent, FinishReason, TokenEvent, Usage

if TYPE_CHECKING:
    from core.engine import SampleResult
    from scheduler.sequence import Sequence

__all__ = ["Verdict", "accept", "finish_event"]


@dataclass(frozen=True)
class Verdict:
    """The token's event (None when the token was refused or ends the output unseen), and the finish reason
    when the sequence ends here (with the error's text for ERROR)."""

    event: TokenEvent | None
    finish: FinishReason | None = None
    error: str | None = None


def accept(seq: Sequence, result: SampleResult, row: int, stop_ids: frozenset[int], iteration: int,
           slot_full: bool) -> Verdict:
    """Append row ``row`` of ``result`` to ``seq``. ``slot_full``: the slot holds its last position."""
    token = int(result.tokens[row])
    if token < 0:
        return Verdict(None, FinishReason.ERROR, "no token is allowed here (constraint dead end)")
    seq.generated.append(token)
    if seq.dry is not None:
        seq.dry.push(token)
    if seq.first_token_at is None:
        seq.first_token_at = time.perf_counter()
    constraint = seq.request.constraint
    if constraint is not None and token not in stop_ids:
        if not constraint.consume(token):
            # The mask allowed it, so this means the grammar and the mask disagree: never pass it on.
            return Verdict(None, FinishReason.ERROR, f"grammar rejected token {token}: {constraint.error}")
        if constraint.keys is not None:
            constraint.keys.feed_token(token)
    if token in stop_ids and not seq.request.ignore_eos:
        return Verdict(None, FinishReason.STOP)
    text = seq.detokenizer.push(token)
    stopped = False
    if seq.stop_matcher is not None:
        text, stopped = seq.stop_matcher.push(text)
    event = TokenEvent(token_id=token, text=text, iteration=iteration)
    if seq.request.reports_logprobs:
        event.logprob = float(result.logprobs[row])
        top = seq.request.sampling.logprobs
        event.top_logprobs = [(int(i), float(lp)) for i, lp in
                              zip(result.top_ids[row][:top], result.top_logprobs[row][:top], strict=True)]
    if stopped or (constraint is not None and constraint.is_finished()):
        return Verdict(event, FinishReason.STOP)
    if len(seq.generated) >= seq.max_tokens or slot_full:
        return Verdict(event, FinishReason.LENGTH)
    return Verdict(event)


def finish_event(seq: Sequence, reason: FinishReason, error: str | None = None) -> FinishEvent:
    """The event that ends ``seq``: the text the detokenizer and stop matcher still hold (a stop string found
    there turns LENGTH into STOP), usage, timings, whether the budget closed the output."""
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
    return FinishEvent(reason=reason, usage=usage, text=tail, error=error, timings=timings,
                       stop_sequence=matched, budget_closed=closed)
