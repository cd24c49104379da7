"""The tool-call wire format read back as it streams (`ToolCallStream`) and when finished: the pieces a
stream gives out add up to exactly what the finished output parses to."""

from __future__ import annotations

import json

import pytest

from agents.tool_calls import CallPiece, ToolCallStream, parse_partial_calls, parse_tool_calls
from scheduler.grammar_spec import ConstraintSpec
from scheduler.tool_protocol import TOOL_CALL_MARKER

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '{"name":"get_weather","arguments":{"city":"Oslo \\u00e9"}}'


def feed(stream: ToolCallStream, text: str, size: int) -> list[str | CallPiece]:
    out: list[str | CallPiece] = []
    for i in range(0, len(text), size):
        out += stream.push(text[i:i + size])
    return out


@pytest.mark.parametrize("size", [1, 2, 5, 100])
@pytest.mark.parametrize("mode", ["auto", "required"])
def test_a_streamed_call_gives_its_head_then_arguments_that_add_up_to_the_parsed_call(mode, size):
    text = (TOOL_CALL_MARKER if mode == "auto" else "") + CALL
    stream = ToolCallStream(mode)
    pieces = feed(stream, text, size)
    spec = ConstraintSpec.tools(TOOLS, mode)
    [call] = parse_tool_calls(text, spec)
    pieces += stream.finish()
    assert not any(isinstance(p, str) for p in pieces)  # nothing of a call leaks as text
    head, *rest = pieces
    assert head.first and head.name == "get_weather" and head.arguments == ""
    arguments = "".join(p.arguments for p in rest)
    assert arguments == call["function"]["arguments"] == '{"city":"Oslo \\u00e9"}'
    assert json.loads(arguments) == {"city": "Oslo é"}
    if size == 1:
        assert len(rest) > 5  # given out while generated, not at the end


def test_text_flows_once_it_cannot_be_the_marker_and_is_held_while_it_can():
    stream = ToolCallStream("auto")
    assert stream.push("<to") == [] and stream.push("mato") == ["<tomato"] and stream.push("!") == ["!"]
    held = ToolCallStream("auto")
    assert held.push("<tool_") == [] and held.finish() == ["<tool_"]
    assert ToolCallStream(None).push("<tool_call>") == ["<tool_call>"]  # no tools: all text


def test_a_call_cut_short_is_the_call_it_was_becoming():
    text = TOOL_CALL_MARKER + '{"name":"get_weather","arguments":{"ci'
    stream = ToolCallStream("auto")
    pieces = feed(stream, text, 3) + stream.finish()
    assert "".join(p.arguments for p in pieces) == '{"ci'
    [partial] = parse_partial_calls(text, "auto")
    assert partial["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert parse_partial_calls(TOOL_CALL_MARKER + '{"na', "auto") == []
    with pytest.raises(ValueError):
        parse_tool_calls(text, ConstraintSpec.tools(TOOLS, "auto"))


def test_tools_with_an_answer_format_make_one_spec_and_none_leaves_the_format():
    answer = ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    spec = ConstraintSpec.tools(TOOLS, "auto", answer=answer)
    assert spec.kind == "tools" and spec.answer_schema == answer.schema
    assert ConstraintSpec.tools(TOOLS, "required", answer=answer).answer_schema is None  # must call
    assert ConstraintSpec.tools(TOOLS, "none", answer=answer) == answer
    assert ConstraintSpec.tools(None, "auto", answer=answer) == answer


TWO = '{"name":"get_weather","arguments":{"city":"Oslo"}}' + TOOL_CALL_MARKER + \
    '{"name":"get_weather","arguments":{"city":"a}\\"<tool_call>"}}'


@pytest.mark.parametrize("size", [1, 3, 100])
def test_parallel_calls_stream_as_separate_indexed_calls(size):
    stream = ToolCallStream("required")
    pieces = feed(stream, TWO, size) + stream.finish()
    heads = [p for p in pieces if p.first]
    assert [h.index for h in heads] == [0, 1] and heads[0].call_id != heads[1].call_id
    args = ["".join(p.arguments for p in pieces if p.index == i) for i in (0, 1)]
    assert args == ['{"city":"Oslo"}', '{"city":"a}\\"<tool_call>"}']  # a brace and the marker inside a string
    spec = ConstraintSpec.tools(TOOLS, "required", parallel=True)
    assert [c["function"]["arguments"] for c in parse_tool_calls(TWO, spec)] == args
    with pytest.raises(ValueError):  # without parallel calls, a second call is not a call output
        parse_tool_calls(TWO, ConstraintSpec.tools(TOOLS, "required"))


def test_in_auto_mode_a_call_may_follow_text_and_text_flows_until_the_marker_could_begin():
    text = "Let me look that up. " + TOOL_CALL_MARKER + CALL
    stream = ToolCallStream("auto", calls_after_text=True)
    assert stream.push("Let me look") == ["Let me look"]  # flows at once
    assert stream.push(" that up. <tool") == [" that up. "]  # "<tool" may begin the marker: held
    rest = stream.push(text[len("Let me look that up. <tool"):]) + stream.finish()
    assert rest[0].first and rest[0].name == "get_weather"
    spec = ConstraintSpec.tools(TOOLS, "auto")
    [call] = parse_tool_calls(text, spec)
    assert "".join(p.arguments for p in rest[1:]) == call["function"]["arguments"]
    held = ToolCallStream("auto", calls_after_text=True)
    assert held.push("a <to") == ["a "] and held.push("mato") == ["<tomato"]
