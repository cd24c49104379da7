"""What a request asks its output to match: `ConstraintSpec` and its errors.

A tools spec describes the call format of `scheduler.tool_protocol`: one call per turn, its arguments valid
under the function's ``parameters``; with ``tool_choice="auto"`` the model may answer instead, in free text
or, when the request also sets an answer format (``response_format``), in a document of that schema.
``tool_choice="none"`` (or no tools with "auto") is no tools constraint: `ConstraintSpec.tools` returns None.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ConstraintSpec",
    "UnsupportedConstraintError",
    "canonical_json",
    "regex_literal",
]

KINDS = ("json_schema", "json_object", "regex", "choice", "tools")
# OpenAI's rule for function names; it also keeps names safe to splice into grammar literals.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_PARALLEL_CALLS = 4  # calls in one output with parallel tool calls: enough for agents, bounded for small models
# OpenAI: a function without `parameters` takes none.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class GrammarBusyError(RuntimeError):
    """Every grammar compile worker is taken (HTTP 429): nothing about the schema was decided."""


class UnsupportedConstraintError(ValueError):
    """A constraint we will not enforce exactly (unsupported feature, invalid or oversize input).

    Raised before any token is generated; the server answers HTTP 400. ``feature`` names what was
    refused, e.g. ``"uniqueItems"``, ``"format: color"``, ``"regex"``, ``"schema size"``.
    """

    def __init__(self, feature: str, detail: str = "") -> None:
        self.feature = feature
        self.detail = detail
        super().__init__(f"unsupported constraint: {feature}" + (f" ({detail})" if detail else ""))


def canonical_json(value: Any) -> str:
    """Compact JSON text. Key order is kept: it is meaningful (properties are generated in that order)."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise UnsupportedConstraintError("schema", f"not serializable as JSON: {e}") from None


def regex_literal(text: str) -> str:
    """A regex matching exactly ``text``, in syntax both llguidance and outlines-core (Rust regex) and
    Python's re read the same way: ASCII punctuation/space/controls as ``\\xNN``, the rest literal."""
    return "".join(c if not c.isascii() or c.isalnum() else f"\\x{ord(c):02X}" for c in text)


def not_containing_regex(marker: str) -> str:
    """A regex for any text (possibly empty) that nowhere contains ``marker``. Needs a marker whose first
    character occurs only there (as "<tool_call>"), so a failed partial match restarts only at that character."""
    first, rest = marker[0], marker[1:]
    if first in rest or len(marker) < 2:
        raise ValueError("the marker's first character must not recur in it")
    lit, other = regex_literal, f"[^{regex_literal(first)}]"
    partial = [lit(rest[:j]) for j in range(len(rest))]  # what of the rest matched so far: "", "t", "to", ...
    restart = "(?:" + "|".join(partial) + ")" + lit(first)  # a partial match broken by the first character again
    deviate = "(?:" + "|".join(f"{lit(rest[:j])}[^{lit(first)}{lit(rest[j])}]" for j in range(len(rest))) + ")"
    excursion = f"{lit(first)}(?:{restart})*{deviate}"
    tail = f"(?:{lit(first)}(?:{restart})*(?:{'|'.join(partial)}))?"
    return f"(?:{other}|{excursion})*{tail}"


@dataclass(frozen=True)
class ConstraintSpec:
    """A hashable description of one output constraint; equal specs share a compiled grammar.

    ``value`` is the canonical payload: compact JSON (schemas, choices, tools) or the regex itself.
    Build specs with the classmethods, not the constructor.
    """

    kind: str
    value: str
    # OpenAI's `strict` flag. Enforcement is the same either way (exact, or refused), so it is not
    # part of equality and both spellings share one cache entry.
    strict: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}")

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | type, strict: bool = True) -> ConstraintSpec:
        """A JSON schema (a dict, a boolean schema, or a pydantic model class)."""
        if isinstance(schema, type):
            from pydantic import BaseModel

            if not issubclass(schema, BaseModel):
                raise UnsupportedConstraintError("schema", f"{schema.__name__} is not a pydantic model")
            schema = schema.model_json_schema()
        if not isinstance(schema, dict | bool):
            raise UnsupportedConstraintError("schema", "a JSON schema must be an object or a boolean")
        return cls("json_schema", canonical_json(schema), strict)

    @classmethod
    def json_object(cls) -> ConstraintSpec:
        """Any JSON object (OpenAI ``response_format={"type": "json_object"}``)."""
        return cls("json_object", '{"type":"object"}')

    @classmethod
    def regex(cls, pattern: str) -> ConstraintSpec:
        """The whole output matches ``pattern`` (Rust regex syntax, implicitly anchored)."""
        if not isinstance(pattern, str):
            raise UnsupportedConstraintError("regex", "the pattern must be a string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> ConstraintSpec:
        """The whole output is exactly one of ``options``."""
        if isinstance(options, str) or not options or not all(isinstance(o, str) for o in options):
            raise UnsupportedConstraintError("choice", "choices must be a non-empty list of strings")
        return cls("choice", canonical_json(list(dict.fromkeys(options))))

    @classmethod
    def tools(
        cls, tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] = "auto",
        answer: ConstraintSpec | None = None, parallel: bool = False,
    ) -> ConstraintSpec | None:
        """OpenAI ``tools`` + ``tool_choice``; None when the output is unconstrained ("none", or "auto"
        without tools). Descriptions do not shape the grammar and are dropped from the spec. ``answer`` (a
        json_schema or json_object spec): what an answer that is not a call must be, in "auto" mode (the
        grammar admits exactly a call or such a document); None: free text. ``parallel``: up to
        `MAX_PARALLEL_CALLS` calls in one output, each after the first preceded by the call marker."""
        if tool_choice == "none":
            return answer
        functions = _normalize_tools(tools or [])
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
            allowed = tool_choice.get("allowed_tools", tool_choice)  # Chat Completions nests it, Responses not
            names = [_choice_name(t) for t in allowed.get("tools") or []]
            mode = allowed.get("mode")
            if mode not in ("auto", "required") or not names:
                raise UnsupportedConstraintError("tool_choice", f"malformed tool_choice {tool_choice!r:.200}")
            functions = [f for f in functions if f["name"] in names]
            if unknown := set(names) - {f["name"] for f in functions}:
                raise UnsupportedConstraintError("tool_choice", f"unknown function {sorted(unknown)[0]!r}")
        elif isinstance(tool_choice, dict):
            name = _choice_name(tool_choice)
            functions = [f for f in functions if f["name"] == name]
            if not functions:
                raise UnsupportedConstraintError("tool_choice", f"unknown function {name!r}")
            mode = "required"
        elif tool_choice in ("auto", "required"):
            mode = tool_choice
        else:
            raise UnsupportedConstraintError("tool_choice", f"unknown tool_choice {tool_choice!r}")
        if not functions:
            if mode == "auto":
                return answer
            raise UnsupportedConstraintError("tool_choice", "tool_choice 'required' without tools")
        payload: dict[str, Any] = {"mode": mode, "functions": functions}
        if parallel:
            payload["parallel"] = True
        if answer is not None and answer.kind not in ("json_schema", "json_object"):
            raise UnsupportedConstraintError("tools with a regex or choice answer",
                                             "with tools, an answer format must be a JSON schema")
        if answer is not None and mode == "auto":
            payload["answer"] = answer.schema
        return cls("tools", canonical_json(payload))

    # ---- views ----------------------------------------------------------------------------------

    @property
    def schema(self) -> Any:
        """The JSON schema (json_schema / json_object), freshly parsed: callers may mutate it."""
        if self.kind not in ("json_schema", "json_object"):
            raise AttributeError(f"a {self.kind} constraint has no schema")
        return json.loads(self.value)

    @property
    def options(self) -> list[str]:
        if self.kind != "choice":
            raise AttributeError(f"a {self.kind} constraint has no options")
        return json.loads(self.value)

    @property
    def tool_mode(self) -> str:
        """Either "auto" or "required" (a named tool_choice is "required" with only that function)."""
        return self._tools()["mode"]

    @property
    def functions(self) -> list[dict[str, Any]]:
        """[{"name", "parameters"}] in declaration order."""
        return self._tools()["functions"]

    @property
    def parallel(self) -> bool:
        """Whether one output may hold several calls."""
        return bool(self._tools().get("parallel"))

    @property
    def answer_schema(self) -> Any:
        """The schema an answer (not a call) must match in auto mode; None: free text."""
        return self._tools().get("answer")

    def _tools(self) -> dict[str, Any]:
        if self.kind != "tools":
            raise AttributeError(f"a {self.kind} constraint has no tools")
        return json.loads(self.value)


def _choice_name(choice: Any) -> str:
    """The function a tool choice names: {"type": "function", "function": {"name"}} or the flat {"name"}."""
    name = (choice.get("function") or {}).get("name", choice.get("name")) if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not isinstance(name, str):
        raise UnsupportedConstraintError("tool_choice", f"malformed tool_choice {choice!r:.200}")
    return name


def _normalize_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """[{"name", "parameters"}] from Chat Completions tools (also the flat Responses-API shape)."""
    if not isinstance(tools, list):
        raise UnsupportedConstraintError("tools", "tools must be a list")
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise UnsupportedConstraintError("tools", f"only function tools are supported, got {tool!r:.80}")
        fn = tool.get("function", tool)
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise UnsupportedConstraintError("tools", f"invalid function name {name!r}")
        if any(f["name"] == name for f in out):
            raise UnsupportedConstraintError("tools", f"function {name!r} declared twice")
        params = fn.get("parameters")
        if params is None:
            params = _NO_PARAMETERS
        if not isinstance(params, dict | bool):
            raise UnsupportedConstraintError("tools", f"parameters of {name!r} must be a JSON schema")
        out.append({"name": name, "parameters": params})
    return out
