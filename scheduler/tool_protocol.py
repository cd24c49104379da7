"""The tool-call wire format the model writes: the facts the grammars enforce and the readers rely on.

Gemma 3 has no tool tokens, so the format is ours (the grammar of `ConstraintSpec.tools` enforces it, the
readers in `agents.tool_calls` turn it back into calls):

* ``tool_choice="required"`` or a named function: the whole output is one compact JSON object
  ``{"name":"<declared name>","arguments":{...}}``: `call_head`, the arguments' JSON, then ``}``.
* ``tool_choice="auto"``: free text that does not contain `TOOL_CALL_MARKER`, then optionally the marker
  and calls (the model may call after some text, as it would in a chat); or, when the request sets an
  answer schema, either a document of that schema or the marker and calls.
* parallel calls: each call after the first is preceded by the marker.
"""

from __future__ import annotations

import json
import re

__all__ = ["CALL_HEAD", "TOOL_CALL_MARKER", "call_head"]

TOOL_CALL_MARKER = "<tool_call>"
# The fixed head of a call object, as the grammar writes it (compact JSON, "name" first); group 1: the name's
# JSON string.
CALL_HEAD = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"arguments":')


def call_head(name: str) -> str:
    """What a call of function ``name`` begins with, up to its arguments: ``{"name":"<name>","arguments":``."""
    return '{"name":' + json.dumps(name, ensure_ascii=False) + ',"arguments":'
