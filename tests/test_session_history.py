"""A resent history is matched to the stored session (modulo surrounding whitespace and tool-call argument
formatting), only what is new is appended, and a contradicting resend is a 409 naming the first differing
message, never a silent duplicate."""

from __future__ import annotations

import pytest

from agents.errors import HistoryConflictError
from agents.history import merge_history

SYSTEM = {"role": "system", "content": "You plan trips."}
U1 = {"role": "user", "content": "Paris?"}
A1 = {"role": "assistant", "content": "Paris is lovely in May."}
U2 = {"role": "user", "content": "And Rome?"}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_new_messages_only_are_appended_as_they_are():
    assert merge_history([], [SYSTEM, U1]) == [SYSTEM, U1]
    assert merge_history([SYSTEM, U1, A1], [U2]) == [U2]
    assert merge_history([U1, A1], [U1]) == [U1]  # one message: a new one, even if it repeats the first


def test_a_resent_history_appends_only_what_is_new_even_when_whitespace_changed():
    history = [SYSTEM, U1, {**A1, "content": "  Paris is lovely in May.\n"}, U2, CALL, RESULT]
    resent = [SYSTEM, U1, A1, {**U2, "content": "And Rome? "},
              {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {"name": "weather",
                                                                            "arguments": '{ "city":"Rome" }'}}]},
              RESULT, {"role": "user", "content": "Thanks!"}]
    assert merge_history(history, resent) == [{"role": "user", "content": "Thanks!"}]


def test_a_contradicting_resend_is_refused_naming_the_message():
    history = [SYSTEM, U1, A1]
    with pytest.raises(HistoryConflictError) as info:
        merge_history(history, [SYSTEM, U1, {**A1, "content": "Rome is better."}, U2])
    assert info.value.index == 2 and "messages[2]" in str(info.value)
    with pytest.raises(HistoryConflictError) as info:
        merge_history(history, [{"role": "system", "content": "You are someone else."}, U1, A1, U2])
    assert info.value.index == 0
    with pytest.raises(HistoryConflictError):  # a system message the session never had
        merge_history([U1, A1], [SYSTEM, U1, A1, U2])
    with pytest.raises(HistoryConflictError, match="without a new message"):
        merge_history(history, [SYSTEM, U1, A1])
    with pytest.raises(HistoryConflictError):  # a tool call with other arguments
        merge_history([U1, CALL, RESULT], [U1, {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {
            "name": "weather", "arguments": '{"city": "Oslo"}'}}]}, RESULT, U2])
