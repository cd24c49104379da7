"""Conversation -> prompt token ids: `ChatTemplate` picks the checkpoint's Jinja template when it has one
(`agents.jinja_template`), else a built-in one: the plain-text transcript a base model continues well
(`agents.transcript_template`, the default) or Gemma's turn layout for an instruction-tuned checkpoint that
ships no template (`agents.gemma_template`).

Every path keeps user text out of control tokens and out of turn markers, and reports ``system_end``: the
number of leading
ids fixed by the agent's system prompt (and tools), which every session of the agent shares exactly, and
``boundaries``: where the system text and each message end, the points later turns and sessions resume at
(the scheduler ends prefill chunks there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents.gemma_template import render_gemma
from agents.jinja_template import SandboxedChatTemplate, checkpoint_template
from agents.messages import TemplateError
from agents.transcript_template import STOP_STRINGS, render_transcript
from core.tokenizer import Tokenizer

__all__ = ["BUILTIN_TEMPLATES", "ChatTemplate", "PromptTooLongError", "RenderedPrompt", "TemplateError"]

# name -> (renderer, the stop strings that end the model's turn besides its EOS tokens)
BUILTIN_TEMPLATES = {"transcript": (render_transcript, STOP_STRINGS), "gemma-turns": (render_gemma, ())}
DEFAULT_BUILTIN = "transcript"

_PREVIEW_TOKENS = 256


@dataclass(frozen=True)
class RenderedPrompt:
    """Prompt ids for the model; ``ids[:system_end]`` depends only on the agent's system prompt/tools.

    ``text_preview`` is the decoded prompt, control tokens included, with the middle of a long prompt
    left out (for logs and debugging; never fed back to the tokenizer)."""

    ids: list[int]
    system_end: int
    text_preview: str
    boundaries: tuple[int, ...] = ()  # sorted positions in (0, len(ids)) where a message ends
    stop: tuple[str, ...] = ()  # text that ends the model's turn under this template (besides EOS)


class PromptTooLongError(ValueError):
    """The prompt exceeds the agent's context_limit (the server answers 400)."""

    def __init__(self, n_tokens: int, limit: int) -> None:
        self.n_tokens = n_tokens
        self.limit = limit
        super().__init__(f"the prompt has {n_tokens} tokens; this agent accepts at most {limit}")


class ChatTemplate:
    """Renders conversations for one tokenizer.

    ``template``: a Jinja source to use; None takes the tokenizer config's ``chat_template``, and the
    ``builtin`` template (a name of BUILTIN_TEMPLATES) when there is none (e.g. the base Gemma 3 270M).
    """

    def __init__(self, tokenizer: Tokenizer, template: str | None = None, builtin: str = DEFAULT_BUILTIN) -> None:
        if builtin not in BUILTIN_TEMPLATES:
            raise ValueError(f"unknown built-in chat template {builtin!r}; one of {sorted(BUILTIN_TEMPLATES)}")
        self.tokenizer = tokenizer
        source = template if template is not None else checkpoint_template(tokenizer.config)
        self._jinja = SandboxedChatTemplate(source) if source else None
        self._builtin, self.stop = BUILTIN_TEMPLATES[builtin] if self._jinja is None else (None, ())
        self.kind = "jinja" if self._jinja is not None else builtin  # "jinja" or the built-in's name

    def render(
        self,
        system_prompt: str,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        max_prompt_tokens: int | None = None,
    ) -> RenderedPrompt:
        """The prompt for ``system_prompt`` + ``messages`` (OpenAI-style), ending with the model's turn
        opener when ``add_generation_prompt``. ``tools`` are described to the model in the system part.
        Raises `TemplateError` / `MessageError` (both ValueError) for unrenderable input and
        `PromptTooLongError` past ``max_prompt_tokens`` (the agent's context_limit)."""
        if self._jinja is not None:
            ids, system_end, boundaries = self._jinja.render(
                self.tokenizer, system_prompt, messages, tools=tools, add_generation_prompt=add_generation_prompt
            )
        else:
            ids, system_end, boundaries = self._builtin(
                self.tokenizer, system_prompt, messages, tools=tools, add_generation_prompt=add_generation_prompt
            )
        return self._finish(ids, system_end, max_prompt_tokens, boundaries, self.stop)

    def render_completion(self, prompt: str, *, max_prompt_tokens: int | None = None) -> RenderedPrompt:
        """The plain completions API: BOS (when the vocabulary has one) + the text, parsing off."""
        bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        return self._finish(bos + self.tokenizer.encode(prompt, parse_special=False), 0, max_prompt_tokens)

    def _finish(self, ids: list[int], system_end: int, max_prompt_tokens: int | None,
                boundaries: list[int] = (), stop: tuple[str, ...] = ()) -> RenderedPrompt:
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            raise PromptTooLongError(len(ids), max_prompt_tokens)
        inside = tuple(sorted({b for b in (system_end, *boundaries) if 0 < b < len(ids)}))
        return RenderedPrompt(ids, system_end, self._preview(ids), inside, stop)

    def _preview(self, ids: list[int]) -> str:
        # Decode only the ends of a long prompt: the preview is for logs, and this runs per request.
        if len(ids) <= 2 * _PREVIEW_TOKENS:
            return self.tokenizer.decode(ids)
        head = self.tokenizer.decode(ids[:_PREVIEW_TOKENS])
        tail = self.tokenizer.decode(ids[-_PREVIEW_TOKENS:])
        return f"{head} ... [{len(ids) - 2 * _PREVIEW_TOKENS} tokens] ... {tail}"
