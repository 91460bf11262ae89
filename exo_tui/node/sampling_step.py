"""What the last hop adds to a step: the next token from the logits, and a prompt's scores.

The node that holds a model's last shard ends every step of a request: it draws the next token
with the request's sampler (made from the step's ``sampling`` at the request's first step here,
and kept, with its resolved seed, until the request is forgotten), gives the token's logprobs
where the step asks (``logprobs``: k alternatives), and scores the prompt where the step asks
(``score``: each of its tokens given those before it); a verify step's ``draft`` (the tokens
its last rows ran, and ``draft_q``, the distributions a draft model drew them from) is checked
against those rows (:mod:`exo_tui.inference.speculative`). The agent (:mod:`exo_tui.node.agent`) runs
the steps and sends the token on; what a step's body asks of the last hop, and how that is
answered, is here, apart from the worker's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from backends.base import MAX_DRAFT, HeadRows
from backends.memory import logit_rows
from exo_tui.inference.sampling import Length, Sampler, SamplingParams, TokenLogprobs, token_logprobs
from exo_tui.inference.scoring import SCORE_ROWS, forward_scored
from exo_tui.inference.speculative import Draft, DraftProbs, Verdict, verify
from exo_tui.net.messages import Forward, ScoreAsk


class Samplers:
    """The sampler of each request whose last hop is this node, by request id."""

    def __init__(self) -> None:
        self._samplers: dict[str, Sampler] = {}

    def _sampler(self, step: Forward) -> tuple[Sampler, Sequence[int]]:
        """The request's sampler and its history (a Length where only that matters)."""
        sampler = self._samplers.get(step.rid)
        if sampler is None:
            sampler = self._samplers[step.rid] = Sampler(SamplingParams.from_dict(step.sampling))
        return sampler, step.history if step.history is not None else Length(step.n_tokens)

    def sample(self, step: Forward, logits: np.ndarray) -> tuple[int, TokenLogprobs | None]:
        """The next token from the last row of ``logits`` for ``step``, and its logprobs when the
        step asks."""
        sampler, history = self._sampler(step)
        token, _ = sampler.sample(logits[-1], history)
        logprobs = None if step.logprobs is None else token_logprobs(logits[-1], token, step.logprobs)
        return token, logprobs

    def verify(self, step: Forward, rows: HeadRows | np.ndarray,
               vocab: int | None = None) -> tuple[Verdict, list[TokenLogprobs] | None]:
        """A verify step's ``draft`` (the tokens its ``k`` last rows ran) checked against ``rows``,
        the step's rows (its last ``k + 1`` checked) whose logits the head gives when read
        (:func:`exo_tui.inference.speculative.verify`: no row past the first rejected draft), or
        their logits ``(T, vocab)``; and each kept token's logprobs when the step asks. ``vocab``:
        the model's (read from the logits where it is not given)."""
        if not isinstance(rows, HeadRows):
            vocab = rows.shape[-1]
            rows = HeadRows.of(rows)
        if vocab is None:
            raise ValueError("the vocabulary's size is needed to check drafts against rows not computed yet")
        draft = step.draft or []
        if not 0 < len(draft) <= MAX_DRAFT or len(draft) >= len(rows) or any(not 0 <= t < vocab for t in draft):
            raise ValueError(f"draft must be 1..{MAX_DRAFT} token ids under {vocab}, the step's last rows, "
                             f"not {draft!r:.80}")
        sampler, history = self._sampler(step)
        rows = rows.last(len(draft) + 1)
        q = None if step.draft_q is None else DraftProbs.from_wire(step.draft_q.counts, step.draft_q.ids,
                                                                   step.draft_q.probs)
        verdict = verify(sampler, rows, history, Draft(tuple(draft), q=q))
        if step.logprobs is None:
            return verdict, None
        return verdict, [token_logprobs(rows[i], t, step.logprobs) for i, t in enumerate(verdict.tokens)]

    def forget(self, rid: str) -> None:
        """Request ``rid`` has ended here, or another took its caches over: its sampler goes."""
        self._samplers.pop(rid, None)


def score_prompt(shard: Any, ask: ScoreAsk, rid: str, x: np.ndarray, positions: np.ndarray,
                 room_bytes: int | None) -> tuple[np.ndarray, list[TokenLogprobs]]:
    """The last shard's step of a prompt whose step asks ``score`` (``ask``: the prompt after its
    first token, and how many alternatives; :func:`forward_scored` checks the values): the last
    row's logits and the scores, in pieces of as many rows of logits as ``room_bytes`` holds (the
    step's room under a limit; None: no limit)."""
    return forward_scored(shard, rid, x, positions, ask.targets, ask.top,
                          logit_rows(shard.config, room_bytes, SCORE_ROWS))


