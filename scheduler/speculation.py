"""Prompt-lookup drafts for speculative decoding: agents' outputs copy their inputs (JSON keys, tool
arguments, code, quoted text), so the tokens that followed the latest earlier occurrence of the context's
last n tokens are a cheap, often right guess at what comes next."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from core.sampling import SamplingParams


def propose_draft(history: Sequence[int], max_tokens: int, max_ngram: int = 4, min_ngram: int = 1) -> list[int]:
    """Up to max_tokens tokens that followed the most recent earlier occurrence of the longest suffix n-gram
    of history (max_ngram down to min_ngram); [] when no suffix recurs. The definition, as a scan of the
    whole history; the scheduler drafts through `DraftIndex`, which the tests hold to this."""
    if max_tokens < 1 or len(history) < 2:
        return []
    tokens = np.asarray(history, np.int64)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # every n-gram that ends before the last token
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            follow = tokens[hits[-1] + n:hits[-1] + n + max_tokens]
            return [int(t) for t in follow]
    return []


class DraftIndex:
    """`propose_draft` kept up to date token by token: the latest start of every 1..max_ngram-gram that ends
    before the last token, so a draft costs a few dict lookups instead of a scan over the whole context
    (about 1 ms per stream per step at 8K tokens)."""

    def __init__(self, max_ngram: int = 4) -> None:
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            last = len(self.tokens) - 1
            for n in range(1, min(self.max_ngram, last) + 1):  # the n-grams that end just before `last`
                self._latest[n][tuple(self.tokens[last - n:last])] = last - n

    def draft(self, max_tokens: int) -> list[int]:
        """What propose_draft(self.tokens, max_tokens) returns."""
        length = len(self.tokens)
        if max_tokens < 1 or length < 2:
            return []
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            start = self._latest[n].get(tuple(self.tokens[length - n:]))
            if start is not None:
                return self.tokens[start + n:start + n + max_tokens]
        return []


def speculation_allowed(sampling: SamplingParams, constrained: bool, wants_logprobs: bool) -> bool:
    """A verify step draws each position's token as plain decoding would (`core.sampling.draw_tokens`: the
    request's temperature, top-k/top-p/min-p, logit bias and seed at that position's step) wherever that token
    depends on the logits and the step alone: not for penalties or DRY (they depend on the tokens before,
    counted by the sampler state), grammar masks (filled on the host token by token) or logprobs (reported
    by the sampler)."""
    return not (sampling.penalised or sampling.logprobs or constrained or wants_logprobs)


# A stream's own record counts against a prior worth this many drafted tokens (2 with an even prior is
# Laplace's rule).
PRIOR_WEIGHT = 2.0
# The pooled record fades by this factor per step recorded, so it describes about the last 20 steps' drafts.
POOLED_DECAY = 0.95


class DraftRate:
    """How often recent drafts were accepted, pooled over every stream (older verify steps fading): the prior
    a stream's own acceptance estimate starts from. Streams of one workload draft alike (an agent copying its
    JSON keys, a base model repeating its prompt), so a new stream is judged by its neighbours' record rather
    than an even chance; until a stream has its own, an even prior declined batched verify steps whose drafts
    were accepted three times in four (a wave of 8 greedy streams on the Intel AMX host)."""

    def __init__(self) -> None:
        self.drafted = 0.0
        self.accepted = 0.0

    def record(self, drafted: int, accepted: int) -> None:
        """One step's drafted and accepted tokens over its rows: a verify step's, or a decode step's declined
        drafts (their first tokens, checked against the tokens decoded)."""
        self.drafted = POOLED_DECAY * self.drafted + drafted
        self.accepted = POOLED_DECAY * self.accepted + accepted

    @property
    def rate(self) -> float:
        """The pooled chance that a drafted token is accepted (an even chance before any draft)."""
        return (self.accepted + 1) / (self.drafted + 2)
