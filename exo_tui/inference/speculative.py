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
* **With probabilities** (a draft model's ``q``, one row a drafted token: :class:`DraftProbs`):
  accept with ``min(1, p(d) / q(d))``, a uniform number from the request's seed and the position
  (stream 1), else draw from the normalised residual (stream 2). The tokens keep the model's
  distribution (Leviathan et al., 2023; Chen et al., 2023) and are reproducible from the seed, but
  they are not the tokens decoding without speculation draws. Greedy requests compare with the
  argmax. The draft model draws its tokens with :func:`draw_draft` (the request's sampler, its
  own stream 3): from its filtered distribution cut to its heaviest tokens, so a row travels as a
  few hundred (id, probability) pairs; the row it drew from is the row sent, so the check is exact.

vLLM keeps its rejection sampler the same way, one module with its own tests
(``vllm/v1/sample/rejection_sampler.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from backends.base import HeadRows
from exo_tui.inference.sampling import Length, Sampler

ACCEPT_STREAM = 1  # the random stream of a draft's acceptance (Sampler.uniform)
RESIDUAL_STREAM = 2  # the random stream of a rejected draft's replacement (Sampler.draw)
DRAFT_STREAM = 3  # the random stream of a draft model's own draw (draw_draft)
DRAFT_ROW_MAX = 256  # a draft model's row keeps at most this many tokens ...
DRAFT_ROW_MASS = 0.999  # ... no more than the heaviest holding this share of its probability ...
DRAFT_ROW_FLOOR = 1e-4  # ... and none under this fraction of the likeliest's


class DraftProbs:
    """A draft model's distributions for its drafted tokens, one sparse row each: the tokens it
    could have drawn (``ids[i]``, ascending) and their probabilities (``probs[i]``, float32)."""

    __slots__ = ("ids", "probs")

    def __init__(self, ids: Sequence[np.ndarray], probs: Sequence[np.ndarray]) -> None:
        if len(ids) != len(probs):
            raise ValueError(f"a draft's distributions need as many rows of ids as of probabilities, "
                             f"not {len(ids)} and {len(probs)}")
        self.ids = tuple(np.asarray(i, dtype=np.int32).reshape(-1) for i in ids)
        self.probs = tuple(np.asarray(p, dtype=np.float32).reshape(-1) for p in probs)
        for i, p in zip(self.ids, self.probs, strict=True):
            if i.size != p.size or not i.size:
                raise ValueError(f"a draft's distribution row lists {i.size} tokens and {p.size} probabilities")
            if not (np.isfinite(p).all() and (p >= 0).all() and float(p.sum()) > 0):
                raise ValueError("a draft's probabilities must be finite, not negative, and not all 0")
            if (i < 0).any() or (i.size > 1 and (np.diff(i) <= 0).any()):
                raise ValueError("a draft's distribution row lists token ids ascending, each once, none negative")

    @classmethod
    def dense(cls, q: np.ndarray) -> DraftProbs:
        """From whole-vocabulary rows ``(k, vocab)`` (their tokens of nonzero probability)."""
        rows = np.asarray(q)
        if rows.ndim != 2:
            raise ValueError(f"a draft's distributions are rows (k, vocab), not {rows.shape}")
        ids = [np.flatnonzero(r) for r in rows]
        return cls(ids, [r[i] for r, i in zip(rows, ids, strict=True)])

    def __len__(self) -> int:
        return len(self.ids)

    def row(self, i: int, vocab: int) -> np.ndarray:
        """Row ``i`` over the whole vocabulary (float64, summing to 1)."""
        ids = self.ids[i]
        if int(ids[-1]) >= vocab:
            raise ValueError(f"the draft's distribution names token {int(ids[-1])}, the model has {vocab}")
        out = np.zeros(vocab, dtype=np.float64)
        w = self.probs[i].astype(np.float64)
        out[ids] = w / w.sum()
        return out

    def cut(self, k: int) -> DraftProbs:
        return DraftProbs(self.ids[:k], self.probs[:k])

    def to_wire(self) -> tuple[list[int], bytes, bytes]:
        """Each row's length, all ids (int32) and all probabilities (float32), as bytes."""
        return ([int(i.size) for i in self.ids], np.concatenate(self.ids).astype("<i4").tobytes(),
                np.concatenate(self.probs).astype("<f4").tobytes())

    @classmethod
    def from_wire(cls, counts: Sequence[int], ids: bytes, probs: bytes) -> DraftProbs:
        """:meth:`to_wire`'s rows back; ValueError for what is not that."""
        if len(ids) % 4 or len(probs) != len(ids) or any(c <= 0 for c in counts) or sum(counts) * 4 != len(ids):
            raise ValueError(f"a draft's distributions of rows {list(counts)!r:.80} need {4 * sum(counts)} bytes "
                             f"of ids and of probabilities, not {len(ids)} and {len(probs)}")
        at = np.cumsum(counts)[:-1]
        return cls(np.split(np.frombuffer(ids, dtype="<i4"), at), np.split(np.frombuffer(probs, dtype="<f4"), at))


def draw_draft(sampler: Sampler, logits: np.ndarray, history: Sequence[int]) -> tuple[int, np.ndarray, np.ndarray]:
    """A draft model's token after ``history``, drawn with the request's ``sampler`` (its seed, the
    position, :data:`DRAFT_STREAM`) from the sampler's distribution over ``logits`` cut to its
    heaviest tokens (at most :data:`DRAFT_ROW_MAX`, no more than hold :data:`DRAFT_ROW_MASS`, none
    under :data:`DRAFT_ROW_FLOOR` of the likeliest's), and
    that row: its ids (ascending) and float32 probabilities, exactly what the token was drawn from."""
    p = sampler.probabilities(logits, history)
    ids = np.flatnonzero(p >= float(p.max()) * DRAFT_ROW_FLOOR)  # a few heavy ones, not the vocabulary to sort
    if ids.size > DRAFT_ROW_MAX:
        ids = ids[np.argpartition(-p[ids], DRAFT_ROW_MAX - 1)[:DRAFT_ROW_MAX]]
    if ids.size > 1:
        ids = ids[np.argsort(-p[ids], kind="stable")]
        cum = np.cumsum(p[ids])
        ids = ids[: int(np.searchsorted(cum, DRAFT_ROW_MASS * float(p.sum()), side="left")) + 1]
        ids = np.sort(ids)
    w = p[ids]
    probs = (w / w.sum()).astype(np.float32)
    j, _ = sampler.draw(probs.astype(np.float64), history, DRAFT_STREAM)
    return int(ids[j]), ids.astype(np.int32), probs


@dataclass(frozen=True)
class Draft:
    """Tokens proposed to follow a request's history, and where they came from. ``q``: the
    proposer's distribution for each drafted token; None: deterministic (a lookup's tokens, all of
    each row's probability on the token)."""

    tokens: tuple[int, ...]
    source: str = ""
    q: DraftProbs | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.q is not None and len(self.q) != len(self.tokens):
            raise ValueError(f"a draft of {len(self.tokens)} tokens needs as many rows of q, not {len(self.q)}")

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, k: int) -> Draft:
        """The first ``k`` drafted tokens."""
        if k >= len(self.tokens):
            return self
        return Draft(self.tokens[:k], self.source, None if self.q is None else self.q.cut(k))


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


def verify(sampler: Sampler, logits: np.ndarray | HeadRows, history: Sequence[int], draft: Draft) -> Verdict:
    """Check ``draft`` against ``logits`` ``(k + 1, vocab)``, the rows of a verify step that ran
    the last token of ``history`` and the ``k`` drafted tokens; ``history`` is the prompt and
    tokens so far (a :class:`Length` where no penalty is on). Rows are read in order and only up
    to the first rejected draft: given :class:`~backends.base.HeadRows`, the head runs on no row
    past it."""
    k = len(draft)
    if isinstance(logits, HeadRows):
        rows = logits
    else:
        array = np.asarray(logits)
        if array.ndim != 2:
            raise ValueError(f"a draft of {k} tokens is checked against {k + 1} rows of logits, not {array.shape}")
        rows = HeadRows.of(array)
    if len(rows) != k + 1:
        raise ValueError(f"a draft of {k} tokens is checked against {k + 1} rows of logits, not {len(rows)}")
    out: list[int] = []
    for i, d in enumerate(draft.tokens):
        seen = _grown(history, out, sampler)
        if draft.q is None or sampler.params.greedy:
            token, _ = sampler.sample(rows[i], seen)
            if token != d:
                return Verdict((*out, token), i, k)
        else:
            p = sampler.probabilities(rows[i], seen)
            q = draft.q.row(i, p.size)
            if not q[d] > 0:
                raise ValueError(f"drafted token {d} has no probability in the distribution it was drawn from")
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
