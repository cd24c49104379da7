"""Prompt-lookup drafts: the definition (a scan of the whole history) and the scheduler's incremental index,
which must propose exactly the same drafts."""

from __future__ import annotations

import numpy as np


def test_prompt_lookup_draft_follows_the_latest_longest_match():
    from scheduler.speculation import propose_draft

    assert propose_draft([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert propose_draft([5, 6, 7, 5, 6, 8, 5, 6], 2) == [8, 5]  # the latest occurrence of [5, 6]
    assert propose_draft([1, 2, 3, 4, 9, 2, 3, 4], 2) == [9, 2]  # longest suffix (2, 3, 4) wins over (4,)
    assert propose_draft([1, 2, 3, 4], 3) == []
    assert propose_draft([7, 7], 4) == [7]
    assert propose_draft([1, 2], 0) == [] and propose_draft([], 3) == []


def test_draft_index_grown_token_by_token_drafts_what_the_full_scan_drafts():
    """The scheduler's incremental index (a prompt, then generated tokens a few at a time) proposes exactly
    propose_draft's draft at every length, on repetitive and on random histories."""
    from scheduler.speculation import DraftIndex, propose_draft

    rng = np.random.default_rng(5)
    for vocab in (3, 12, 1000):
        history = [int(t) for t in rng.integers(0, vocab, size=300)]
        index = DraftIndex()
        index.extend(history[:40])
        done = 40
        while done < len(history):
            for max_tokens in (0, 1, 2, 7):
                assert index.draft(max_tokens) == propose_draft(history[:done], max_tokens), (vocab, done)
            step = int(rng.integers(1, 4))
            index.extend(history[done:done + step])
            done += step
    assert DraftIndex().draft(3) == []
