"""A request's text to token ids, without stalling the coordinator: :class:`Prompts`.

The coordinator's event loop also reads the nodes' heartbeats and tokens, so what a stranger's
prompt costs it is bounded (issue 43: a 3.9 MB prompt once held the loop for 2.9 s and 350 MB):

* a prompt that cannot fit the context is refused before it is tokenized: no token stands for
  more than the vocabulary's longest token's bytes, so ``characters / longest`` tokens at least
  (:meth:`~exo_tui.models.tokenizer.Tokenizer.fewest_tokens`). The body limit bounds the bytes.
* tokenizing runs on a worker thread, in the HF tokenizer's call that releases the GIL, and at
  most :data:`TOKENIZE_AT_ONCE` prompts are tokenized at once (the others wait their turn);
* text that is not Unicode (a lone surrogate) is refused naming its field.

Refusals are :class:`PromptRefused` (status 400, the field, a code); the OpenAI and the Ollama
routes answer them in their own error shapes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from exo_tui.api.generation import context_note
from exo_tui.cluster.view import ServingCluster
from exo_tui.models.model import Model
from exo_tui.models.tokenizer import BadText, PromptTooLong

TOKENIZE_AT_ONCE = 2


class PromptRefused(Exception):
    def __init__(self, message: str, *, param: str, code: str) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class Prompts:
    """Token ids of chats and texts for the routes of one app."""

    def __init__(self, coordinator: ServingCluster, at_once: int = TOKENIZE_AT_ONCE) -> None:
        self.coordinator = coordinator
        self._slots = asyncio.Semaphore(at_once)

    async def chat(self, model: Model, messages: list[dict[str, Any]], *, param: str = "messages") -> list[int]:
        """The rendered chat's ids (control tokens read in the template's markup only)."""
        limit = self.coordinator.context_length
        try:
            return await self._run(param, lambda: model.chat_prompt_ids(messages, limit))
        except PromptRefused:
            raise
        except Exception as exc:  # noqa: BLE001 - the chat template refused these messages (ChatTemplateError...)
            raise PromptRefused(f"the model's chat template cannot render these messages: {exc}", param=param,
                                code="invalid_messages") from exc

    async def text(self, model: Model, text: str, *, add_special: bool = True, param: str = "prompt",
                   room: int | None = None) -> list[int]:
        """``text``'s ids; ``room``: the tokens it may have (default: the context)."""
        limit = self.coordinator.context_length if room is None else room
        return await self._run(param, lambda: model.tokenizer.encode(text, add_special, limit=limit))

    async def _run(self, param: str, fn: Callable[[], list[int]]) -> list[int]:
        async with self._slots:
            try:
                return await asyncio.to_thread(fn)
            except BadText as exc:
                raise PromptRefused(str(exc) if exc.what else f"{param}: {exc}", param=exc.what or param,
                                    code="invalid_prompt") from exc
            except PromptTooLong as exc:
                context = self.coordinator.context_length
                raise PromptRefused(
                    f"this model's maximum context length is {context} tokens; the prompt has at least "
                    f"{exc.at_least} (counted without tokenizing it): shorten it{context_note(self.coordinator)}",
                    param=param, code="context_length_exceeded") from exc
