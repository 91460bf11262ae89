"""Where drafted tokens come from: sources a request composes, asked before each of its steps.

A :class:`DraftSource` looks at a request's tokens so far (prompt and answer) and proposes up to
``k`` tokens to follow; a verify step (:mod:`exo_tui.inference.speculative`) keeps those the model
agrees with. Two sources need no model:

* :class:`PromptLookup`: the last few tokens (an n-gram, the longest of ``max_ngram`` .. 2 that
  occurred before) looked up in the request's own tokens, and what followed their latest earlier
  occurrence proposed (llama.cpp's ``LlamaPromptLookupDecoding``, vLLM's n-gram speculator). An
  answer that quotes its prompt, or repeats itself, is drafted from there.
* :class:`Prediction`: OpenAI's Predicted Outputs, text the answer is expected to copy largely
  (code to edit): before the answer has tokens, the prediction's first ones; then the answer's
  last n-gram found in the prediction (nearest after the place the previous drafts came from) and
  what follows it there.

:class:`Drafter` asks its sources in order and takes the first proposal. A draft model would be
one more source: its :meth:`DraftSource.propose` returns tokens with their probabilities
(:class:`~exo_tui.inference.speculative.Draft`'s ``q``), and may await a node; the verify step
already checks such drafts with speculative sampling.
"""

from __future__ import annotations

import abc
import bisect
from collections.abc import Sequence

from exo_tui.inference.speculative import Draft

MAX_NGRAM = 3
MIN_NGRAM = 2  # a lookup's shortest n-gram: one token recurs too often in free text to predict what follows it


class DraftSource(abc.ABC):
    """Proposes tokens to follow a request's tokens."""

    name: str = ""
    cheap: bool = True
    """Its proposals cost next to nothing (a lookup): a stream not drafting now still asks it, and
    checks what it proposed against the tokens that come (a draft model's are not asked so)."""

    @abc.abstractmethod
    async def propose(self, tokens: Sequence[int], prompt_len: int, k: int) -> Draft:
        """Up to ``k`` tokens to follow ``tokens`` (of which the first ``prompt_len`` are the
        prompt); an empty draft when there is nothing to propose."""


class _NgramIndex:
    """Where each n-gram (``min_ngram``..``max_ngram`` tokens) of a growing token list begins, in
    order (``every``) or its latest occurrence only. An n-gram is listed once the token after it
    is there (its continuation exists).

    An n-gram's key is one int (:func:`_ngram_key`) and a latest start another: a lookup indexes
    every token of every stream as it comes, and tuples and lists kept by the thousand would grow
    the garbage collector's young generation with each token, its collections (the oldest
    generation's of the coordinator's whole heap, 80 ms, among them) coming with them."""

    def __init__(self, max_ngram: int, min_ngram: int = 1, every: bool = True) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.every = every
        self.tokens: list[int] = []
        self.starts: dict[int, list[int]] = {}  # every: key -> starts, ascending
        self.latest: dict[int, int] = {}  # not every: key -> the latest start
        self._indexed = 0  # n-grams ending before this position are listed

    def extend(self, tokens: Sequence[int]) -> None:
        """Catch up with ``tokens``, which begin with what was seen before."""
        n = len(self.tokens)
        if len(tokens) < n or list(tokens[: min(n, 8)]) != self.tokens[: min(n, 8)]:
            self.tokens, self.starts, self.latest, self._indexed, n = [], {}, {}, 0, 0
        self.tokens.extend(map(int, tokens[n:]))
        seq, lo, hi, every, starts, latest = self.tokens, self.min_ngram, self.max_ngram, self.every, self.starts, self.latest
        for end in range(self._indexed, len(seq) - 1):  # n-grams ending at ``end``, followed
            key = 0
            for size in range(1, min(hi, end + 1) + 1):
                at = end - size + 1
                key |= (seq[at] + 1) << (_KEY_BITS * (size - 1))
                if size >= lo:
                    if every:
                        starts.setdefault(key, []).append(at)
                    else:
                        latest[key] = at
        self._indexed = max(self._indexed, len(self.tokens) - 1)

    def follow(self, ngram: Sequence[int], near: int | None = None) -> int | None:
        """Where the tokens after an occurrence of ``ngram`` begin: after the first occurrence
        starting at or after ``near`` (``every`` only), else after the latest one; None when it
        never occurred."""
        key = _ngram_key(ngram)
        if not self.every:
            at = self.latest.get(key)
            return None if at is None else at + len(ngram)
        starts = self.starts.get(key)
        if not starts:
            return None
        if near is not None:
            i = bisect.bisect_left(starts, near)
            if i < len(starts):
                return starts[i] + len(ngram)
        return starts[-1] + len(ngram)


_KEY_BITS = 32  # bits of a token in an n-gram's key (token ids below 2^32 - 1)


def _ngram_key(ngram: Sequence[int]) -> int:
    """An n-gram as one int: token i (from the end) + 1 in bits ``32 i`` on (the first token's
    nonzero bits give its length too)."""
    key = 0
    for i, t in enumerate(reversed(ngram)):
        key |= (int(t) + 1) << (_KEY_BITS * i)
    return key


class PromptLookup(DraftSource):
    """Drafts from the request's own tokens: what followed the latest earlier occurrence of its
    last n-gram."""

    name = "lookup"

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        self._index = _NgramIndex(max_ngram, min_ngram, every=False)
        self.min_ngram = min_ngram

    async def propose(self, tokens: Sequence[int], prompt_len: int, k: int) -> Draft:
        index = self._index
        index.extend(tokens)
        seq = index.tokens
        for size in range(min(index.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            at = index.follow(seq[-size:])
            if at is not None:
                return Draft(tuple(seq[at : at + k]), self.name)
        return Draft((), self.name)


class Prediction(DraftSource):
    """Drafts from a predicted answer's tokens (OpenAI's ``prediction``)."""

    name = "prediction"

    def __init__(self, predicted: Sequence[int], max_ngram: int = MAX_NGRAM) -> None:
        self.predicted = [int(t) for t in predicted]
        self._index = _NgramIndex(max_ngram)
        self._index.extend([*self.predicted, -1])  # every n-gram listed, the last one too
        self._cursor = 0  # where in the prediction the answer's end was last found to be ...
        self._answered = 0  # ... when the answer had this many tokens

    async def propose(self, tokens: Sequence[int], prompt_len: int, k: int) -> Draft:
        answer = tokens[prompt_len:]
        if not answer:
            self._cursor = self._answered = 0
            return Draft(tuple(self.predicted[:k]), self.name)
        guess = self._cursor + len(answer) - self._answered  # where it is now, if it went on as predicted
        for size in range(min(self._index.max_ngram, len(answer)), 0, -1):
            at = self._index.follow(answer[-size:], near=max(0, guess - size))
            if at is not None:
                self._cursor, self._answered = at, len(answer)
                return Draft(tuple(self.predicted[at : at + k]), self.name)
        return Draft((), self.name)


class Drafter:
    """A request's draft sources, asked in order: the first that proposes something drafts."""

    def __init__(self, sources: Sequence[DraftSource]) -> None:
        self.sources = list(sources)

    async def propose(self, tokens: Sequence[int], prompt_len: int, k: int, *, cheap_only: bool = False) -> Draft:
        """The first proposal of up to ``k`` tokens; ``cheap_only``: from the cheap sources only."""
        if k <= 0:
            return Draft(())
        for source in self.sources:
            if cheap_only and not source.cheap:
                continue
            draft = await source.propose(tokens, prompt_len, k)
            if len(draft):
                return draft.cut(k)
        return Draft(())
