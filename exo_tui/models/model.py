"""A model opened for use: its GGUF file, config, tokenizer and chat template, loaded once."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from backends.base import ModelConfig
from exo_tui.models.catalog import looks_like_path, resolve_model
from exo_tui.models.chat_template import ChatTemplate
from exo_tui.models.gguf_file import GGUFModel, ModelFileError
from exo_tui.models.registry import DEFAULT_MODEL, REGISTRY, RegisteredModel
from exo_tui.models.sampling_params import GGUF_SAMPLING_KEYS, with_defaults
from exo_tui.models.tokenizer import Tokenizer, check_text

log = logging.getLogger(__name__)


class Model:
    def __init__(self, name_or_path: str | Path | None = None, *, paths: Sequence[str] | None = None) -> None:
        """``paths``: the config's ``models.paths``, where catalog names are looked up too (None:
        the user's config's)."""
        self.path = resolve_model(name_or_path, paths)
        self.gguf = GGUFModel(self.path)
        # What the operator knows it by: the registered or catalog name (the default one when none
        # was given), or for a path the file's own name for its model (general.name).
        given = str(name_or_path or DEFAULT_MODEL)
        is_path = looks_like_path(given) or given.lower().endswith(".gguf") or Path(given).expanduser().exists()
        self.name = self.gguf.name if is_path else given
        self._registered = REGISTRY.get(given.lower()) or _registered_file(self.path)

    @property
    def config(self) -> ModelConfig:
        return self.gguf.config

    @cached_property
    def sampling(self) -> dict[str, Any]:
        """The sampling its makers recommend (a request's settings left out take these): the
        registry entry's, then the GGUF's own ``general.sampling.*`` fields over them. A value
        that sampling would refuse is left out, with a warning."""
        out: dict[str, Any] = dict(self._registered.sampling) if self._registered else {}
        for key, (name, kind) in GGUF_SAMPLING_KEYS.items():
            value = self.gguf.field(key)
            if value is None:
                continue
            try:
                out[name] = getattr(with_defaults({name: kind(value)}), name)
            except (TypeError, ValueError) as exc:
                log.warning("%s: ignoring %s = %r (%s)", self.path.name, key, value, exc)
        return out

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf(self.gguf)

    @cached_property
    def template(self) -> ChatTemplate:
        return ChatTemplate.from_gguf(self.gguf)

    def chat_prompt_ids(self, messages: list[dict[str, str]], limit: int | None = None) -> list[int]:
        """Token ids of the rendered chat, ready for the assistant's answer. Control tokens are
        read in the template's markup only: a message that spells one (``<|im_end|>``) is text.
        ``limit``: see :meth:`Tokenizer.encode` (``PromptTooLong`` before tokenizing);
        ``BadText`` names the message with a lone surrogate."""
        tok = self.tokenizer
        for i, m in enumerate(messages):
            if isinstance(m.get("content"), str):
                check_text(m["content"], f"messages[{i}].content")
        text, plain = self.template.render_marked(messages, tok.has_control_text, add_generation_prompt=True)
        return tok.encode(text, plain=plain, limit=limit)


def _registered_file(path: Path) -> RegisteredModel | None:
    """The registered model whose file ``path`` is (e.g. the default model linked into a store)."""
    for entry in REGISTRY.values():
        try:
            if resolve_model(entry.name).samefile(path):
                return entry
        except (OSError, ModelFileError):
            continue
    return None
