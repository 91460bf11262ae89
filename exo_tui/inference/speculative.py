"""Checking drafted tokens against the model: what the last hop of a verify step does.

A speculative step runs a request's last accepted token and ``k`` drafted ones through the ring as
one step of ``k + 1`` rows (``DESIGN.md``: speculative steps). The last shard's row ``i`` of logits
is the model's next-token distribution after the history and the first ``i`` drafts;
:func:`verify` walks the rows with the request's own sampler (its temperature, top-k, top-p,
min-p and penalties, each row's history the drafts before it) and keeps the drafts up to the
first it rejects, then one token more: the rejected draft's replacement, or after ``k`` accepted
drafts the next token from the last row. Every step so gives at least one token.

Drafts come in two kinds (:class:`Draft`):

* **Deterministic** (prompt lookup, an OpenAI ``prediction``: the draft's distribution ``q`` is
  all on the drafted token). Speculative sampling accepts draft ``d`` with ``min(1, p(d) / q(d)) =
  p(d)`` and otherwise draws from the residual ``max(0, p - q)`` normalised, which is ``p`` without
  ``d``. Drawing the row's token exactly as decoding without speculation would (the same seed and
  position: :meth:`Sampler.sample`) and accepting ``d`` when the two are equal is both at once:
  ``d`` comes with probability ``p(d)``, and when it does not, the token is ``p`` without ``d``.
  So the tokens are those of decoding without speculation, token for token, greedy or sampled.
* **With probabilities** (a draft model's ``q``, one row a drafted token): accept with
  ``min(1, p(d) / q(d))``, a uniform number from the request's seed and the position (stream 1),
  else draw from the normalised residual (stream 2). The tokens keep the model's distribution
  (Leviathan et al., 2023; Chen et al., 2023) and are reproducible from the seed, but they are
  not the tokens decoding without speculation draws. Greedy requests compare with the argmax.

vLLM keeps its rejection sampler the same way, one module with its own tests
(``vllm/v1/sample/rejection_sampler.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from exo_tui.inference.sampling import Length, Sampler

ACCEPT_STREAM = 1  # the random stream of a draft's acceptance (Sampler.uniform)
RESIDUAL_STREAM = 2  # the random stream of a rejected draft's replacement (Sampler.draw)


@dataclass(frozen=True)
class Draft:
    """Tokens proposed to follow a request's history, and where they came from. ``q``: the
    proposer's distribution for each drafted token, ``(k, vocab)``; None: deterministic (a
    lookup's tokens, all of each row's probability on the token)."""

    tokens: tuple[int, ...]
    source: str = ""
    q: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.q is not None and (self.q.ndim != 2 or self.q.shape[0] != len(self.tokens)):
            raise ValueError(f"a draft of {len(self.tokens)} tokens needs q of ({len(self.tokens)}, vocab), "
                             f"not {self.q.shape}")

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, k: int) -> Draft:
        """The first ``k`` drafted tokens."""
        if k >= len(self.tokens):
            return self
        return Draft(self.tokens[:k], self.source, None if self.q is None else self.q[:k])


@dataclass(frozen=True)
class Verdict:
    """A verify step's outcome: ``tokens`` are the accepted drafts and then the next token (so
    ``accepted + 1`` of them), what the request's history grows by."""

    tokens: tuple[int, ...]
    accepted: int
    drafted: int  # k: the drafted tokens the step ran

    @property
    def rejected(self) -> int:
        """Drafted tokens the step did not keep."""
        return self.drafted - self.accepted


def verify(sampler: Sampler, logits: np.ndarray, history: Sequence[int], draft: Draft) -> Verdict:
    """Check ``draft`` against ``logits`` ``(k + 1, vocab)``, the rows of a verify step that ran
    the last token of ``history`` and the ``k`` drafted tokens; ``history`` is the prompt and
    tokens so far (a :class:`Length` where no penalty is on)."""
    rows = np.asarray(logits)
    k = len(draft)
    if rows.ndim != 2 or rows.shape[0] != k + 1:
        raise ValueError(f"a draft of {k} tokens is checked against {k + 1} rows of logits, not {rows.shape}")
    out: list[int] = []
    for i, d in enumerate(draft.tokens):
        seen = _grown(history, out, sampler)
        if draft.q is None or sampler.params.greedy:
            token, _ = sampler.sample(rows[i], seen)
            if token != d:
                return Verdict((*out, token), i, k)
        else:
            p = sampler.probabilities(rows[i], seen)
            q = np.asarray(draft.q[i], dtype=np.float64)
            if q.shape != p.shape:
                raise ValueError(f"the draft's distribution has {q.size} tokens, the model's {p.size}")
            if not sampler.uniform(seen, ACCEPT_STREAM) * q[d] < p[d]:  # u < p/q, without dividing
                residual = np.maximum(p - q, 0.0)
                token = sampler.draw(residual if residual.sum() > 0 else p, seen, RESIDUAL_STREAM)[0]
                return Verdict((*out, token), i, k)
        out.append(int(d))
    token, _ = sampler.sample(rows[k], _grown(history, out, sampler))
    return Verdict((*out, token), k, k)


def _grown(history: Sequence[int], drafts: list[int], sampler: Sampler) -> Sequence[int]:
    """``history`` with the accepted ``drafts`` after it, as the sampler reads it."""
    if not drafts:
        return history
    if not sampler.params.uses_history:
        return Length(len(history) + len(drafts))
    return [*history, *drafts]
