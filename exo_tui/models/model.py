"""A model opened for use: its GGUF file, config, tokenizer and chat template, loaded once."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from backends.base import ModelConfig
from exo_tui.models.chat_template import ChatTemplate
from exo_tui.models.gguf_file import GGUFModel
from exo_tui.models.registry import DEFAULT_MODEL, resolve_model
from exo_tui.models.tokenizer import Tokenizer


class Model:
    def __init__(self, name_or_path: str | Path | None = None) -> None:
        self.path = resolve_model(name_or_path)
        self.gguf = GGUFModel(self.path)
        # What the operator knows it by: the registered name (the default one when none was given),
        # or for a path the file's own name for its model (general.name).
        given = str(name_or_path or DEFAULT_MODEL)
        self.name = given if not Path(given).suffix else self.gguf.name

    @property
    def config(self) -> ModelConfig:
        return self.gguf.config

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf(self.gguf)

    @cached_property
    def template(self) -> ChatTemplate:
        return ChatTemplate.from_gguf(self.gguf)

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the rendered chat, ready for the assistant's answer."""
        text = self.template.render(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text)
