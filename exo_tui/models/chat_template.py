"""The model's chat template (``tokenizer.chat_template``), rendered with Jinja2 in a sandbox.

Templates are code from the model file, so they run in Jinja2's immutable sandbox, with the
names Hugging Face templates expect: ``messages``, ``add_generation_prompt``, ``bos_token``,
``eos_token``, ``raise_exception``, ``strftime_now``, ``tools`` and a ``tojson`` filter that
keeps non-ASCII text. A file without a template gets ChatML.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exo_tui.models.gguf_file import GGUFModel
    from exo_tui.models.tokenizer import Tokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(Exception):
    """The chat template cannot be used or rendered; the message names the model file."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


class _TemplateRaised(Exception):
    pass


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _text_of_parts(parts: list[Any], i: int) -> str:
    """OpenAI-style content parts (``[{"type": "text", "text": ...}]``) as one string."""
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(f"message {i} has a content part of type {kind!r}: exo-tui models read text parts only")
    return "".join(texts)


class ChatTemplate:
    def __init__(
        self,
        source: str | None,
        *,
        bos_token: str = "",
        eos_token: str = "",
        origin: str = "the model file",
    ) -> None:
        """``source``: the Jinja2 text (None or empty: ChatML). ``origin`` names the file in errors."""
        from jinja2 import TemplateError

        self.is_fallback = not source
        self.source = source or CHATML_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin
        try:
            self._template = _environment().from_string(self.source)
        except TemplateError as exc:
            line = getattr(exc, "lineno", None)
            where = f" (line {line})" if line else ""
            raise ChatTemplateError(
                f"the chat template of {origin} does not parse{where}: {exc}; "
                "fix tokenizer.chat_template in the file or use another model file"
            ) from exc

    @classmethod
    def from_gguf(cls, model: GGUFModel, tokenizer: Tokenizer | None = None) -> ChatTemplate:
        """The template stored in the file, with its BOS/EOS token texts."""
        source = model.field("tokenizer.chat_template")
        bos = eos = ""
        bos_id = model.field("tokenizer.ggml.bos_token_id")
        eos_id = model.field("tokenizer.ggml.eos_token_id")
        if tokenizer is not None:
            bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
            eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        else:
            if bos_id is not None:
                bos = str(model.field_item("tokenizer.ggml.tokens", int(bos_id)) or "")
            if eos_id is not None:
                eos = str(model.field_item("tokenizer.ggml.tokens", int(eos_id)) or "")
        return cls(str(source) if source else None, bos_token=bos, eos_token=eos, origin=str(model.path))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and ``content``).

        ``extra`` values (``tools``, ``date_string``, ...) are passed to the template as well.
        """
        return self._render(_normalized(messages), add_generation_prompt, extra)

    def render_marked(
        self,
        messages: Sequence[Mapping[str, Any]],
        spells_control: Callable[[str], bool],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> tuple[str, list[tuple[int, int]]]:
        """``(prompt text, where the messages' contents are in it)``, for a tokenizer that must read
        control tokens only in the template's own markup. ``spells_control(text)``: whether a text
        spells a control token; only then are the contents' places found (a second rendering with
        a unique mark in place of each content). :class:`ChatTemplateError` when such a content
        cannot be told apart from the markup (the template changes it beyond trimming)."""
        msgs = _normalized(messages)
        text = self._render(msgs, add_generation_prompt, extra)
        risky = [i for i, m in enumerate(msgs) if isinstance(m["content"], str) and spells_control(m["content"])]
        if not risky:
            return text, []
        nonce = secrets.token_hex(8)
        marks = {f"\ue000{nonce}{i}\ue001": i for i in risky}  # private-use characters: never in a template
        original = list(msgs)
        for mark, i in marks.items():
            msgs[i] = {**msgs[i], "content": mark}
        skeleton = self._render(msgs, add_generation_prompt, extra)
        contents = {mark: original[i]["content"] for mark, i in marks.items()}
        for trim in (False, True):  # templates often trim a message's text
            out, spans, at = [], [], 0
            for piece, found in _split_marks(skeleton, marks):
                out.append(piece)
                at += len(piece)
                if found is not None:
                    content = contents[found].strip() if trim else contents[found]
                    out.append(content)
                    spans.append((at, at + len(content)))
                    at += len(content)
            if "".join(out) == text:
                return text, spans
        first = risky[0]
        raise ChatTemplateError(
            f"message {first} spells a control token of the model in its text, and the chat template of "
            f"{self.origin} changes message text, so it cannot be kept apart from the template's own markup: "
            "remove the control token from the message"
        )

    def _render(self, msgs: list[dict[str, Any]], add_generation_prompt: bool, extra: dict[str, Any]) -> str:
        from jinja2 import TemplateError
        from jinja2.exceptions import SecurityError

        context: dict[str, Any] = {
            "tools": None,
            **extra,
            "messages": msgs,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        try:
            return self._template.render(**context)
        except _TemplateRaised as exc:
            raise ChatTemplateError(f"the chat template of {self.origin} refused the conversation: {exc}") from exc
        except SecurityError as exc:
            raise ChatTemplateError(
                f"the chat template of {self.origin} tried an unsafe operation ({exc}); it was stopped: "
                "use another model file or replace its template"
            ) from exc
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(
                f"the chat template of {self.origin} failed ({type(exc).__name__}: {exc}); "
                "check the messages (roles, order) or use another model file"
            ) from exc


def _normalized(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template reads them: text parts joined into one string."""
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"message {i} has no role: each message needs a 'role' and a 'content'")
        content = m.get("content")
        if isinstance(content, list):
            content = _text_of_parts(content, i)
        elif content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"message {i} ({m['role']}) has content of type {type(content).__name__}: use text")
        msgs.append({**m, "content": content})
    return msgs


def _split_marks(skeleton: str, marks: Mapping[str, int]) -> list[tuple[str, str | None]]:
    """The skeleton as (text before, the mark after it or None) pairs, in order."""
    pattern = re.compile("|".join(map(re.escape, marks)))
    out: list[tuple[str, str | None]] = []
    at = 0
    for m in pattern.finditer(skeleton):
        out.append((skeleton[at:m.start()], m.group()))
        at = m.end()
    out.append((skeleton[at:], None))
    return out
