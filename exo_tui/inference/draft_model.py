"""A draft model: a smaller model of the target's vocabulary that drafts tokens for verify steps.

``exo-tui serve --draft MODEL`` (and the console's) names a GGUF whose tokenizer is the target's
(:func:`vocabulary_mismatch` refuses any other in one sentence). One node runs it whole
(:mod:`exo_tui.cluster.drafting` picks the node and asks it; the node's op is ``draft_step``).
For each stream it keeps a KV cache of its own and, asked with the tokens accepted since its last
call and ``k``, cuts that cache back to what is still accepted, runs the new tokens and then ``k``
draft steps (:class:`DraftModel`).

A greedy request's drafts are the draft model's argmax (after the request's penalties), checked
for equality. A sampled request's are drawn with the request's own sampler (its temperature,
top-k, top-p, min-p, penalties and seed, at the position, on the draft's own random stream:
:func:`~exo_tui.inference.speculative.draw_draft`), and each comes with the distribution it was
drawn from, which the last stage checks with speculative sampling (``min(1, p/q)``, the residual
``max(0, p - q)``): the answers keep the model's distribution, and a seed gives the same answer
again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from backends import get_backend
from backends.base import BackendError, ModelConfig, Shard
from backends.weights import ShardWeights
from exo_tui.inference.sampling import Length, Sampler, SamplingParams
from exo_tui.inference.speculative import Draft, DraftProbs, draw_draft
from exo_tui.models.gguf_file import GGUFModel
from exo_tui.models.tokenizer import Tokenizer

MAX_STREAMS = 16  # streams whose caches a draft model keeps (the least recently asked go first)


def vocabulary_mismatch(target: Tokenizer, draft: Tokenizer, draft_name: str) -> str:
    """Why ``draft`` cannot draft for ``target`` (one sentence), or "" when their vocabularies are
    the same: every token's text and id, and the end tokens."""
    if target.vocab_size != draft.vocab_size:
        return (f"the draft model {draft_name} has a vocabulary of {draft.vocab_size} tokens, the model served "
                f"{target.vocab_size}: a draft model must share the served model's tokenizer (the same family)")
    for i in range(target.vocab_size):
        if target.token_text(i) != draft.token_text(i):
            return (f"the draft model {draft_name}'s token {i} is {draft.token_text(i)!r}, the model served has "
                    f"{target.token_text(i)!r}: a draft model must share the served model's tokenizer (the same family)")
    if set(target.eos_ids) != set(draft.eos_ids):
        return (f"the draft model {draft_name} ends answers with tokens {sorted(draft.eos_ids)}, the model served "
                f"with {sorted(target.eos_ids)}: a draft model must share the served model's tokenizer")
    return ""


_GREEDY = Sampler(SamplingParams(temperature=0.0))


class DraftStateLost(Exception):
    """The draft model holds fewer of a stream's tokens than the ask assumed (it restarted, or
    forgot the stream): ask again from position 0."""


class DraftModel:
    """A whole model on one backend, drafting for several streams. Not thread-safe: one caller
    (a node's drafting thread) at a time."""

    def __init__(self, config: ModelConfig, weights: ShardWeights, backend: str, max_streams: int = MAX_STREAMS) -> None:
        if (weights.start, weights.end) != (0, config.n_layers):
            raise ValueError(f"a draft model runs whole: layers [0, {config.n_layers}), not [{weights.start}, {weights.end})")
        self.config = config
        self.backend = backend
        self.nbytes = int(weights.nbytes)  # the weights' bytes as stored
        self.shard: Shard = get_backend(backend).load_shard(config, weights)
        self.max_streams = max_streams
        self._held: OrderedDict[str, list[int]] = OrderedDict()  # stream -> the positions its cache holds
        self._samplers: dict[str, Sampler] = {}  # a sampled stream's sampler (its seed resolved once)
        self.steps = 0  # draft steps run (one token each), for the node's metrics

    @classmethod
    def open(cls, gguf: GGUFModel, backend: str, max_streams: int = MAX_STREAMS) -> DraftModel:
        """The draft model of a file this process reads."""
        return cls(gguf.config, gguf.shard_weights(0, gguf.config.n_layers), backend, max_streams)

    def propose(self, rid: str, pos: int, tokens: Sequence[int], k: int,
                sampling: SamplingParams | None = None) -> Draft:
        """``k`` drafted tokens to follow the stream's tokens: its first ``pos`` as held here
        (the cache is cut back to them) and then ``tokens``; with the distributions they were
        drawn from where ``sampling`` (the request's) is not greedy. DraftStateLost when fewer
        than ``pos`` are held."""
        if k < 1:
            raise ValueError(f"a draft step drafts 1 or more tokens, not {k}")
        held = self._held.pop(rid, [])
        if pos > len(held):
            self.shard.drop(rid)
            raise DraftStateLost(f"the draft model holds {len(held)} of request {rid}'s positions, not {pos}")
        new = [int(t) for t in tokens]
        if not new:  # nothing new: the last held token runs again for its logits
            if pos == 0:
                raise ValueError("a draft step needs at least one token")
            pos, new = pos - 1, [held[pos - 1]]
        try:
            if pos < len(held):
                self.shard.truncate_kv(rid, pos)
        except BackendError:  # a windowed cache that cannot go back so far: run the stream again
            self.shard.drop(rid)
            raise DraftStateLost(f"the draft model cannot cut request {rid}'s cache back to {pos}") from None
        held = held[:pos]
        sampler = self._sampler(rid, sampling)
        logits = self._run(rid, new, pos)
        held.extend(new)
        drafts: list[int] = []
        ids: list[np.ndarray] = []
        probs: list[np.ndarray] = []
        for i in range(k):
            seen = held if sampler.params.uses_history else Length(len(held))
            if sampler.params.greedy:
                token = sampler.sample(logits, seen)[0]
            else:
                token, row_ids, row_probs = draw_draft(sampler, logits, seen)
                ids.append(row_ids)
                probs.append(row_probs)
            drafts.append(token)
            if i + 1 < k:
                logits = self._run(rid, [token], len(held))
                held.append(token)
        self._held[rid] = held
        while len(self._held) > self.max_streams:
            old, _ = self._held.popitem(last=False)
            self._samplers.pop(old, None)
            self.shard.drop(old)
        return Draft(tuple(drafts), "model", DraftProbs(ids, probs) if ids else None)

    def _sampler(self, rid: str, sampling: SamplingParams | None) -> Sampler:
        """The stream's sampler (``sampling``'s, its seed resolved once); plain greedy without."""
        if sampling is None:
            return _GREEDY
        sampler = self._samplers.get(rid)
        if sampler is None or (sampling.seed is not None and sampler.params != sampling):
            sampler = self._samplers[rid] = Sampler(sampling)
        return sampler

    def _run(self, rid: str, tokens: list[int], pos: int) -> np.ndarray:
        self.steps += 1
        x = np.asarray(tokens, dtype=np.int64)
        out = self.shard.forward(rid, x, np.arange(pos, pos + len(tokens), dtype=np.int64))
        return np.asarray(out).reshape(-1, out.shape[-1])[-1]

    def drop(self, rid: str) -> None:
        self._samplers.pop(rid, None)
        if self._held.pop(rid, None) is not None:
            self.shard.drop(rid)

    def streams(self) -> int:
        return len(self._held)

    def held(self) -> dict[str, int]:
        """Each stream's positions in its cache here."""
        return {rid: len(h) for rid, h in self._held.items()}

    def by_age(self) -> list[str]:
        """The streams whose caches it keeps, the least recently asked first (the first it drops)."""
        return list(self._held)

    def close(self) -> None:
        for rid in list(self._held):
            self.drop(rid)
        self.shard.close()
