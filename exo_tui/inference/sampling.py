"""Choosing the next token from the model's logits.

The order is Hugging Face's: penalties (repetition, then OpenAI's frequency and presence, over
the history as llama.cpp applies them), temperature, top-k, top-p, min-p, then a draw.
The draw at a step uses ``np.random.default_rng([seed, len(history)])``: the random state
depends only on the seed and the position, so a request rebuilt from its token history on
another node (after a failover or a plan change) samples the same tokens it would have.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# The parameters as a value live one layer down, where the model reads its recommendation too;
# the sampler's users import them from here as well.
from exo_tui.models.sampling_params import GGUF_SAMPLING_KEYS as GGUF_SAMPLING_KEYS
from exo_tui.models.sampling_params import SamplingParams as SamplingParams
from exo_tui.models.sampling_params import with_defaults as with_defaults

_BINS = 1024
_BLOCK = 256
_LOG_FLOOR = -80.0  # weights below e^-80 of the best share the lowest top-p bucket
_HEAVY_W = 1e-4  # top-p first looks among the tokens above this weight (the best is 1) ...
_HEAVY_MAX = 4096  # ... when there are at most this many

class Sampler:
    """Samples with one request's parameters. Stateless between calls apart from the resolved
    seed: the same ``(logits, history)`` always gives the same token."""

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.params = (params or SamplingParams()).with_seed()

    @property
    def seed(self) -> int:
        assert self.params.seed is not None
        return self.params.seed

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> tuple[int, float]:
        """The next token id after ``history`` (prompt and tokens generated so far) and its
        log-probability under the distribution it was drawn from (greedy draws with certainty:
        0.0). What the model itself gives the token is :func:`token_logprobs`, paid for only when
        a request asks: over a 49k vocabulary it costs ~40 us a token, ~5 % of a batched step."""
        p = self.params
        raw = np.asarray(logits, dtype=np.float32).reshape(-1)
        if raw.size == 0:
            raise ValueError("no logits to sample from")
        x = self._penalised(raw, history) if p.uses_history else raw

        if p.greedy:
            token = int(np.argmax(x))
            if not math.isfinite(float(x[token])):
                raise ValueError(_bad_logits(raw))
            return token, 0.0

        ids, w = self._weights(x, raw)
        rng = np.random.default_rng([self.seed, len(history)])
        j, total = _draw(w, rng.random())
        token = int(j if ids is None else ids[j])
        return token, math.log(float(w[j]) / total)

    def probabilities(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The distribution :meth:`sample` draws the token after ``history`` from, over the
        whole vocabulary (float64; greedy: all on the argmax). What speculative sampling checks a
        draft's probabilities against (:mod:`exo_tui.inference.speculative`)."""
        raw = np.asarray(logits, dtype=np.float32).reshape(-1)
        x = self._penalised(raw, history) if self.params.uses_history else raw
        p = np.zeros(raw.size, dtype=np.float64)
        if self.params.greedy:
            p[self.sample(raw, history)[0]] = 1.0
            return p
        ids, w = self._weights(x, raw)
        p[slice(None) if ids is None else ids] = w / w.sum(dtype=np.float64)
        return p

    def draw(self, p: np.ndarray, history: Sequence[int], stream: int) -> tuple[int, float]:
        """A token drawn from the distribution ``p`` with the request's seed at this position,
        the random stream ``stream`` (> 0: other than :meth:`sample`'s), and its log-probability."""
        rng = np.random.default_rng([self.seed, len(history), stream])
        j, total = _draw(p, rng.random())
        return j, math.log(float(p[j]) / total)

    def uniform(self, history: Sequence[int], stream: int) -> float:
        """A number in [0, 1) from the request's seed at this position and random stream ``stream``."""
        return float(np.random.default_rng([self.seed, len(history), stream]).random())

    def _weights(self, x: np.ndarray, raw: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Temperature, top-k, top-p and min-p over penalised logits ``x``: the candidate ids
        (None: the whole vocabulary) in a canonical order and their weights (the best is 1)."""
        p = self.params
        top = float(np.max(x))
        if not math.isfinite(top):
            raise ValueError(_bad_logits(raw))
        vocab = x.size
        inv_t = np.float32(min(1.0 / p.temperature, 1e30))  # a temperature of 1e-45 stays finite
        scaled = (x - np.float32(top)) * inv_t  # log-weights, the best token at 0
        ids: np.ndarray | None = None  # candidate token ids; None: the whole vocabulary
        if 0 < p.top_k < vocab:
            kth = np.partition(scaled, vocab - p.top_k)[vocab - p.top_k]
            ids = np.flatnonzero(scaled >= kth)  # ties with the k-th are kept, as in HF
        logw = scaled if ids is None else scaled[ids]
        w = np.exp(logw)  # the best token has weight 1
        if p.top_p < 1.0:
            keep = _nucleus(logw, w, p.top_p)
            ids = keep if ids is None else ids[keep]
            w = w[keep]
        if p.min_p > 0.0:
            keep = np.flatnonzero(w >= p.min_p)  # p / p(best) >= min_p
            ids = keep if ids is None else ids[keep]
            w = w[keep]
        if ids is not None:  # a canonical order: the draw depends on the set, not on sort ties
            if ids.size <= _HEAVY_MAX:  # few (a nucleus, a top-k): sort them
                perm = np.argsort(ids)
                ids, w = ids[perm], w[perm]
            else:  # many: place them by id, without a sort
                where = np.full(vocab, -1, dtype=np.int64)
                where[ids] = np.arange(ids.size)
                ids = np.flatnonzero(where >= 0)
                w = w[where[ids]]
        return ids, w

    def _penalised(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        p = self.params
        window = history[-p.repetition_window :] if p.repetition_window else history
        if len(window) == 0:
            return logits
        seen, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        inside = (seen >= 0) & (seen < logits.size)
        seen, counts = seen[inside], counts[inside]
        out = logits.copy()
        v = out[seen]
        if p.repetition_penalty != 1.0:
            v = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        v = v - np.float32(p.frequency_penalty) * counts - np.float32(p.presence_penalty)
        out[seen] = v.astype(np.float32)
        return out


def _nucleus(logw: np.ndarray, w: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of heaviest weights (the best is 1) holding ``top_p`` of the mass.

    Usually the nucleus is a few heavy tokens: those above a small weight are tried first, and if
    they hold the mass, only they are sorted (~0.1 ms for 49k logits). Else O(n): weights are
    binned by their log into _BINS buckets; only the bucket where the cumulative mass crosses
    ``top_p`` is sorted (~0.7 ms).
    """
    need = top_p * float(w.sum())
    lo = max(float(logw.min()), _LOG_FLOOR)
    if lo >= 0.0:  # all weights equal: none is heavier than another, all are kept
        return np.arange(w.size)
    heavy = np.flatnonzero(w > _HEAVY_W)
    if heavy.size <= _HEAVY_MAX and float(w[heavy].sum(dtype=np.float64)) >= need:
        # Every token outside is lighter than every token inside: the nucleus is a prefix of these
        # in the order below (bucket, weight, id: weights tied in float32 fall as they do there).
        hb = _buckets(logw[heavy], lo)
        order = heavy[np.lexsort((heavy, -w[heavy], -hb))]
        cum = np.cumsum(w[order], dtype=np.float64)
        return order[: int(np.searchsorted(cum, need, side="left")) + 1]
    b = _buckets(logw, lo)
    mass_from_top = np.cumsum(np.bincount(b, weights=w, minlength=_BINS)[::-1])
    k = min(int(np.searchsorted(mass_from_top, need, side="left")), _BINS - 1)
    edge = _BINS - 1 - k  # the bucket where the mass reaches top_p
    above = np.flatnonzero(b > edge)
    inside = np.flatnonzero(b == edge)
    inside = inside[np.argsort(-w[inside], kind="stable")]
    cum = (float(mass_from_top[k - 1]) if k > 0 else 0.0) + np.cumsum(w[inside])
    cut = int(np.searchsorted(cum, need, side="left"))  # first position where the mass >= need
    return np.concatenate([above, inside[: cut + 1]])


def _buckets(logw: np.ndarray, lo: float) -> np.ndarray:
    """Each log-weight's top-p bucket, 0 (``lo`` and below) to _BINS - 1 (the best)."""
    with np.errstate(over="ignore", invalid="ignore"):
        # A minimum within a hair of 0 makes the scale overflow: 0 * inf is the minimum's own
        # bucket (0), anything above it lands in the top bucket, which is then sorted exactly.
        scaled = (logw - lo) * ((_BINS - 1) / -lo)
    return np.nan_to_num(scaled, nan=0.0, posinf=_BINS - 1).clip(0, _BINS - 1).astype(np.int64)


def _draw(w: np.ndarray, u: float) -> tuple[int, float]:
    """The index where ``u`` in [0, 1) falls in the cumulative weights, and the total weight.

    Long vectors are cut into blocks: block sums are vectorised, and only the chosen block
    is scanned (a plain cumulative sum over 49k weights costs half a millisecond).
    """
    n = w.size
    if n <= 4 * _BLOCK:
        cdf = np.cumsum(w, dtype=np.float64)
        total = float(cdf[-1])
        nz = np.flatnonzero(w)
        j = int(np.searchsorted(cdf[nz], u * total, side="right"))
        return int(nz[min(j, nz.size - 1)]), total
    pad = (-n) % _BLOCK
    wp = np.concatenate([w, np.zeros(pad, dtype=w.dtype)]) if pad else w
    blocks = np.cumsum(wp.reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64))
    total = float(blocks[-1])
    target = u * total
    bi = min(int(np.searchsorted(blocks, target, side="right")), blocks.size - 1)
    while bi > 0 and blocks[bi] == blocks[bi - 1]:  # an empty last block (rounding): step back
        bi -= 1
    start = bi * _BLOCK
    inner = wp[start : start + _BLOCK]
    nz = np.flatnonzero(inner)
    cdf = (float(blocks[bi - 1]) if bi else 0.0) + np.cumsum(inner[nz], dtype=np.float64)
    j = min(int(np.searchsorted(cdf, target, side="right")), nz.size - 1)
    return start + int(nz[j]), total


class Length(Sequence[int]):
    """Stands in for a history when only its length matters (no penalty is on: the draw's random
    state depends on the position only)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        raise TypeError("a history's length stands in for it: its tokens are not here")


MAX_TOP_LOGPROBS = 20  # OpenAI's limit on the alternatives listed for a token


@dataclass(frozen=True)
class TokenLogprobs:
    """A chosen token's log-probability under the model, and the ``top`` likeliest tokens' (best
    first). The model's distribution is the softmax of its raw logits: before penalties,
    temperature and truncation, as OpenAI and vLLM report logprobs, so the same text scores the
    same whatever the sampling parameters were."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_wire(self) -> list[Any]:
        return [self.token, self.logprob, [list(t) for t in self.top]]

    @classmethod
    def from_wire(cls, data: Any) -> TokenLogprobs:
        """From :meth:`to_wire`'s list; ``ValueError`` for anything else."""
        try:
            token, logprob, top = data
            out = cls(int(token), float(logprob), tuple((int(t), float(lp)) for t, lp in top))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad token logprobs {data!r:.200}: expected [token, logprob, [[token, logprob], ...]]") from exc
        if len(out.top) > MAX_TOP_LOGPROBS:
            raise ValueError(f"bad token logprobs: {len(out.top)} alternatives, at most {MAX_TOP_LOGPROBS}")
        return out


def token_logprobs(logits: np.ndarray, token: int, top: int = 0) -> TokenLogprobs:
    """``token``'s log-softmax over ``logits`` and the ``top`` (0..MAX_TOP_LOGPROBS) likeliest
    tokens' (best first). One temporary, exponentiated in place and summed pairwise in
    float32 (relative error ~1e-7): ~40 us for 49,152 logits; the top list adds ~0.1 ms."""
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], not {top}")
    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    m = np.float32(np.max(x))
    e = np.subtract(x, m)
    np.exp(e, out=e)
    norm = float(m) + math.log(float(e.sum()))
    best: tuple[tuple[int, float], ...] = ()
    if top:
        k = min(top, x.size)
        ids = np.argpartition(-x, k - 1)[:k] if k < x.size else np.arange(x.size)
        ids = ids[np.lexsort((ids, -x[ids]))]
        best = tuple((int(i), float(x[i]) - norm) for i in ids)
    return TokenLogprobs(int(token), float(x[token]) - norm, best)


MAX_SCORED_TOP = 5  # alternatives a scored prompt position may list (OpenAI's completions limit)


def scores_to_array(scores: Sequence[TokenLogprobs]) -> np.ndarray:
    """A prompt's scores as one float64 array ``(n, 2 + 2k)``: each row the token, its logprob,
    then its ``k`` alternatives' (token, logprob) pairs. A long prompt's scores are megabytes: they
    travel as a frame's tensor, not in its header (whose size is capped)."""
    k = len(scores[0].top) if scores else 0
    out = np.empty((len(scores), 2 + 2 * k), dtype=np.float64)
    for i, x in enumerate(scores):
        if len(x.top) != k:
            raise ValueError(f"every scored position lists the same number of alternatives ({k}), not {len(x.top)}")
        out[i, 0], out[i, 1] = x.token, x.logprob
        if k:
            out[i, 2:] = np.asarray(x.top, dtype=np.float64).reshape(-1)
    return out


def scores_from_array(array: np.ndarray) -> list[TokenLogprobs]:
    """:func:`scores_to_array`'s scores back; ``ValueError`` for an array that is not one."""
    a = np.asarray(array)
    if a.ndim != 2 or a.shape[1] < 2 or a.shape[1] % 2 or a.shape[1] > 2 + 2 * MAX_TOP_LOGPROBS or a.dtype != np.float64:
        raise ValueError(f"scores must be a float64 array (n, 2 + 2k) with k <= {MAX_TOP_LOGPROBS}, "
                         f"not {a.dtype} {a.shape}")
    ids = a[:, 0::2]
    if not (np.isfinite(ids).all() and (ids >= 0).all() and (ids == np.floor(ids)).all() and (ids < 2**31).all()):
        raise ValueError("scores' token ids must be whole numbers in [0, 2**31)")
    tokens, values = ids.astype(np.int64).tolist(), a[:, 1::2].tolist()
    return [TokenLogprobs(t[0], v[0], tuple(zip(t[1:], v[1:], strict=True))) for t, v in zip(tokens, values, strict=True)]


def score_tokens(logits: np.ndarray, targets: Sequence[int], top: int = 0) -> list[TokenLogprobs]:
    """The logprobs of a text the model read: row ``i`` of ``logits`` (the distribution after
    ``i + 1`` tokens) scores ``targets[i]``, the token that came next."""
    rows = np.asarray(logits)
    if rows.ndim != 2 or rows.shape[0] < len(targets):
        raise ValueError(f"{len(targets)} tokens to score need as many rows of logits, got shape {rows.shape}")
    check_scored_top(top)
    return [token_logprobs(rows[i], int(t), top) for i, t in enumerate(targets)]


def check_scored_top(top: int) -> None:
    if not 0 <= top <= MAX_SCORED_TOP:
        raise ValueError(f"a scored prompt lists at most {MAX_SCORED_TOP} alternatives a position, not {top}")


def _bad_logits(raw: np.ndarray) -> str:
    n_nan = int(np.isnan(raw).sum())
    return (
        f"the model's logits are not usable ({n_nan} NaN of {raw.size}, max {np.nanmax(raw) if n_nan < raw.size else 'nan'}): "
        "the weights or a backend produced non-finite values; check the model file and the backend"
    )
