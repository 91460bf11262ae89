"""Token logprobs in OpenAI's two shapes: chat's ``logprobs.content`` and the legacy completions'
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``.

A token's text is its bytes decoded on their own (a token holding part of a character shows
U+FFFD there; ``bytes`` has the exact bytes, as OpenAI's does for the same reason).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from exo_tui.inference.generate import Listed
from exo_tui.inference.sampling import TokenLogprobs
from exo_tui.models.detokenizer import StreamingDetokenizer
from exo_tui.models.tokenizer import Tokenizer

FLOOR = -9999.0  # JSON has no -Infinity: a token the model rules out (a -inf logit) gets OpenAI's floor


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def _text(tokenizer: Tokenizer, token: int) -> str:
    return tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def _entry(tokenizer: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": _value(logprob), "bytes": list(raw)}


def chat_logprobs(tokenizer: Tokenizer, listed: Sequence[Listed]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or of one streamed chunk)."""
    content = []
    for _, lp in listed:
        entry = _entry(tokenizer, lp.token, lp.logprob)
        entry["top_logprobs"] = [_entry(tokenizer, t, v) for t, v in lp.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def prompt_listed(tokenizer: Tokenizer, prompt_ids: Sequence[int], scores: Sequence[TokenLogprobs]) -> list[Listed]:
    """An echoed prompt's tokens as :data:`Listed` (where each one's text begins in the prompt's
    text, its logprobs); the first token, which nothing before it predicts, has a NaN logprob
    (null in the JSON)."""
    detok = StreamingDetokenizer(tokenizer, skip_special=False)
    out: list[Listed] = []
    at = 0
    for i, token in enumerate(prompt_ids):
        out.append((at, scores[i - 1] if i else TokenLogprobs(int(token), math.nan)))
        at += len(detok.add(token))
    return out


def completion_logprobs(tokenizer: Tokenizer, listed: Sequence[Listed], offset: int = 0) -> dict[str, Any]:
    """``choices[i].logprobs`` of a completion (or of one streamed chunk); ``offset``: where the
    answer begins in the choice's text (the echoed prompt's length). Each ``top_logprobs`` map
    holds the likeliest tokens and the chosen one: up to ``logprobs`` + 1, as OpenAI's; an echoed
    prompt's first token has null for both."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for at, lp in listed:
        text = _text(tokenizer, lp.token)
        tokens.append(text)
        offsets.append(offset + at)
        if math.isnan(lp.logprob):
            values.append(None)
            tops.append(None)
            continue
        values.append(_value(lp.logprob))
        top = {_text(tokenizer, t): _value(v) for t, v in lp.top}
        top.setdefault(text, _value(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
