"""A checkpoint's own Jinja chat template, rendered in a sandbox without letting content forge turns.

Rendering a template to one string and tokenizing it with special-token parsing on (what
``apply_chat_template`` does) lets a user who types "<end_of_turn>" close their own turn. Instead:

1. every message content is replaced by a unique random sentinel (ASCII letters and digits only, so it
   survives ``trim`` and ``tojson`` unchanged) before rendering;
2. the output is split at the sentinels: the template's literal parts are tokenized with special-token
   parsing on (they are the template's own control tokens), each content with parsing off, and the ids
   are spliced together.

Strings that a template may print other than contents (names, tool definitions, tool-call arguments)
are not spliced: a request whose such strings contain control-token text is refused instead. A template
that mangles a sentinel (e.g. ``content | upper``) is refused too, rather than rendered unsafely.

The environment mirrors transformers' (`ImmutableSandboxedEnvironment`, trim_blocks, lstrip_blocks,
loopcontrols, ``raise_exception``, ``tojson``, ``strftime_now``), except that touching an unsafe
attribute (``''.__class__``) raises at once instead of yielding an undefined value.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from agents.messages import TemplateError, normalize_messages
from agents.prompt_text import leading_system_count
from core.tokenizer import Tokenizer

__all__ = ["SandboxedChatTemplate", "checkpoint_template"]

_SEPARATOR = "\n\n"


def checkpoint_template(config: dict[str, Any]) -> str | None:
    """The chat template in a tokenizer_config (a string, or a list of named templates: "default")."""
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value.strip() else None


class _StrictSandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' tojson: plain json.dumps (jinja's own HTML-escapes "<", which changes the prompt).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class SandboxedChatTemplate:
    """One compiled template; `render` is safe to call concurrently."""

    def __init__(self, source: str) -> None:
        env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateError(f"invalid chat template: {e}") from e
        self.source = source

    def render(
        self,
        tok: Tokenizer,
        system_prompt: str,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> tuple[list[int], int, list[int]]:
        """(prompt ids, system_end, boundaries): system_end ends right after the agent's system prompt's ids;
        boundaries are where each message's content ends."""
        messages = normalize_messages(messages)
        nonce = secrets.token_hex(8)
        contents: list[list[str]] = []  # per sentinel: pieces tokenized separately (parsing off)

        def sentinel(pieces: list[str]) -> str:
            contents.append(pieces)
            return f"SLOTSERVE{nonce}C{len(contents) - 1}E"

        # The agent's prompt and the client's leading system messages form one system message (most
        # templates accept only one, first); its pieces stay separate so the agent part is a prefix.
        lead = leading_system_count(messages)
        system_pieces: list[str] = []
        for text in [system_prompt, *(m["content"] for m in messages[:lead])]:
            if text:
                system_pieces += [_SEPARATOR, text] if system_pieces else [text]
        agent_pieces = 1 if system_prompt else 0

        context_messages = []
        if system_pieces:
            context_messages.append({"role": "system", "content": sentinel(system_pieces)})
        for i, m in enumerate(messages[lead:], start=lead):
            _check_plain(tok, {k: v for k, v in m.items() if k not in ("role", "content")}, f"messages[{i}]")
            context_messages.append({**m, "role": "system" if m["role"] == "developer" else m["role"],
                                     "content": sentinel([m["content"]])})
        if tools:
            _check_plain(tok, tools, "tools")
        try:
            text = self._template.render(
                messages=context_messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                **_special_tokens(tok.config),
            )
        except SecurityError as e:
            raise TemplateError(f"the chat template tried something the sandbox forbids: {e}") from e
        except TemplateError:
            raise
        except Exception as e:  # the template is foreign code: any failure is a render failure
            raise TemplateError(f"the chat template failed: {type(e).__name__}: {e}") from e
        return _splice(tok, text, nonce, contents, agent_pieces)


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """bos_token etc. as strings (tokenizer_config may store them as serialized AddedTokens)."""
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def _check_plain(tok: Tokenizer, value: Any, where: str) -> None:
    """Refuse control-token text in strings that are printed by the template, not spliced."""
    for s in _strings(value):
        if set(tok.encode(s, parse_special=True)) & tok.special_ids:
            raise TemplateError(f"{where} contains control-token text, which this chat template cannot render safely")


def _splice(
    tok: Tokenizer, text: str, nonce: str, contents: list[list[str]], agent_pieces: int
) -> tuple[list[int], int, list[int]]:
    parts = re.split(f"SLOTSERVE{nonce}C(\\d+)E", text)
    ids: list[int] = []
    boundaries: list[int] = []
    system_end = 0
    seen_other = False
    for n, part in enumerate(parts):
        if n % 2 == 0:  # template literal: its control tokens are real
            if nonce.lower() in part.lower():
                raise TemplateError("the chat template transforms message contents; it cannot be rendered safely")
            ids += tok.encode(part, parse_special=True)
            continue
        index = int(part)
        if index >= len(contents):
            raise TemplateError("the chat template produced an unknown placeholder")
        for k, piece in enumerate(contents[index]):
            ids += tok.encode(piece, parse_special=False)
            # Sentinel 0 is the system message and its first piece the agent's prompt; it is a shared
            # prefix only if no other content came before it.
            if index == 0 and k == 0 and agent_pieces and not seen_other:
                system_end = len(ids)
        seen_other = seen_other or index != 0
        boundaries.append(len(ids))
    return ids, system_end, boundaries
