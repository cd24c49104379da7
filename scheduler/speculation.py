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
    of history (max_ngram down to min_ngram); [] when no suffix recurs."""
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


def speculation_allowed(sampling: SamplingParams, constrained: bool, wants_logprobs: bool) -> bool:
    """Greedy verification reproduces plain decoding exactly only for plain greedy requests: sampling,
    penalties and logit bias change the token choice; grammar masks and logprobs need the sampler."""
    return (sampling.temperature == 0 and not sampling.needs_full and not sampling.logit_bias
            and not sampling.logprobs and not constrained and not wants_logprobs)
