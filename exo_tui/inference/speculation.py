"""One stream's speculation: its draft sources, how many tokens it drafts a step, what it measured.

The mode is ``off``, ``auto`` or a fixed ``k`` (``exo-tui serve --speculative``, the console's
``:set speculative``, a request's own ``speculative``). With ``auto`` a stream drafts the ``k``
that maximises the expected tokens a step per unit of step time, from what it measured itself:

* the acceptance rate ``a`` of its drafts (a step of ``k`` drafts gives ``(1 - a^(k+1)) / (1 - a)``
  tokens on average, accepting each draft with probability ``a`` until the first rejection);
* the time of its steps by their rows: a 1-row step's, and what each further row adds (the cost
  of a ``k + 1``-row step against a 1-row one on this plan, through the whole ring, the other
  streams batched beside it included).

Where more than :data:`BUSY_STREAMS` streams run, a stream without a prediction does not draft
either: the ring's steps are batches then, whose rows every stream pays for. Where no ``k`` is
expected to beat plain steps by :data:`MIN_GAIN`, the stream does not draft: it
keeps proposing drafts without running them and checks them against the tokens that come (a
"shadow" draft; free for lookups), so it starts again when its answer turns to copying. A
prediction (OpenAI's Predicted Outputs) is drafted from the first step, since it is given to be
copied.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from backends.base import MAX_DRAFT
from exo_tui.inference.drafts import Drafter, DraftSource, Prediction, PromptLookup
from exo_tui.inference.speculative import Draft, Verdict

MODES = ("off", "auto")
MIN_GAIN = 1.15  # auto drafts only where it expects at least this many times plain steps' tok/s
BUSY_STREAMS = 2  # auto drafts lookups only while at most this many streams run (a prediction: always)
PRIOR_ACCEPT = 0.2  # a stream's acceptance rate before it has measured one: lookups start from drafts not run ...
# ... (free chat rarely repeats itself; a copy shows in the first drafts checked), a prediction from this:
PRIOR_PREDICTED = 0.9
PRIOR_MODEL = 0.8  # a stream with a draft model (whose drafts are not asked for while it does not draft)
# What each row past the first adds to a step, relative to a 1-row step, until measured: a verify
# step runs the output head on every row (the default model's last stage took 4x a 1-row step at k = 4)
PRIOR_ROW_COST = 0.5
EMA = 0.2  # the weight of a new measurement in the running estimates


def parse_mode(value: str | int | None) -> str | int:
    """``off``, ``auto`` or a number of tokens 1..MAX_DRAFT (0 is ``off``), with an error that says
    what is allowed."""
    if value is None:
        return "auto"
    text = str(value).strip().lower()
    if text in MODES:
        return text
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"speculative must be off, auto or a number of drafted tokens 1..{MAX_DRAFT}, "
                         f"not {value!r}") from None
    if not 0 <= k <= MAX_DRAFT:
        raise ValueError(f"speculative must be off, auto or a number of drafted tokens 1..{MAX_DRAFT}, not {k}")
    return "off" if k == 0 else k


@dataclass
class SpeculationStats:
    """What a stream drafted and kept, for its usage and the console."""

    steps: int = 0  # verify steps run
    drafted: int = 0
    accepted: int = 0
    prediction_accepted: int = 0  # of them, drafted from the request's prediction
    prediction_rejected: int = 0
    k_chosen: list[int] = field(default_factory=list)  # the k of each verify step

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Speculation:
    """A stream's speculation: asked for a draft before each step, told how the step went."""

    def __init__(self, mode: str | int, sources: Sequence[DraftSource]) -> None:
        self.mode = parse_mode(mode)
        self.drafter = Drafter(sources)
        self.predicted = any(isinstance(s, Prediction) for s in sources)
        self.stats = SpeculationStats()
        self.accept_rate = PRIOR_PREDICTED if self.predicted else PRIOR_ACCEPT
        self.step_s: float | None = None  # a 1-row step's time
        self.row_s: float | None = None  # what each further row adds
        self._shadow: tuple[int, tuple[int, ...]] | None = None  # (where a draft not run begins, its tokens)
        self.streams: Callable[[], int] | None = None  # the streams running beside it (the coordinator's)
        self._primed = False  # the priors were set for the sources it has (a draft model is attached late)

    @classmethod
    def for_request(cls, mode: str | int, predicted: Sequence[int] | None = None, lookup: bool = True) -> Speculation | None:
        """The speculation of a request: its prediction's tokens first, then prompt lookup; None
        when the mode is off."""
        mode = parse_mode(mode)
        if mode == "off":
            return None
        sources: list[DraftSource] = []
        if predicted:
            sources.append(Prediction(predicted))
        if lookup:
            sources.append(PromptLookup())
        return cls(mode, sources)

    # ------------------------------------------------------------------ asking

    async def draft(self, tokens: Sequence[int], prompt_len: int, room: int) -> Draft:
        """The draft to run with the next step (empty: a plain step). ``room``: the most tokens
        the step may give (the answer's and the context's room left, at least 1)."""
        self._score_shadow(tokens)
        most = min(MAX_DRAFT, room - 1)
        if most <= 0:
            return Draft(())
        if not self._primed and any(not s.cheap for s in self.drafter.sources):  # a draft model attached
            self.accept_rate = max(self.accept_rate, PRIOR_MODEL)
        self._primed = True
        k = self.mode if isinstance(self.mode, int) else self.best_k(most)
        draft = await self.drafter.propose(tokens, prompt_len, min(k, most) if k else most, cheap_only=not k)
        if not k:  # not worth a verify step now: remembered, to be checked against what comes
            if len(draft) and self._shadow is None:
                self._shadow = (len(tokens), draft.tokens)
            return Draft(())
        return draft

    def best_k(self, most: int) -> int:
        """The k with the most expected tokens per unit of step time (0: none beats plain steps
        by MIN_GAIN)."""
        if not self.predicted and self.streams is not None and self.streams() > BUSY_STREAMS:
            return 0  # a busy ring's steps are batches already: drafts would cost the others
        a = min(self.accept_rate, 0.999)
        row = self.row_cost()
        best, gain = 0, MIN_GAIN
        for k in range(1, min(most, MAX_DRAFT) + 1):
            tokens = (1 - a ** (k + 1)) / (1 - a)
            g = tokens / (1 + row * k)
            if g > gain:
                best, gain = k, g
        return best

    def row_cost(self) -> float:
        """What each row past the first adds to a step, relative to a 1-row step."""
        if self.step_s is None or self.row_s is None or self.step_s <= 0:
            return PRIOR_ROW_COST
        return max(self.row_s / self.step_s, 1e-3)

    # ------------------------------------------------------------------ told

    def timed(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows (1: plain) took ``seconds`` for this stream."""
        if not math.isfinite(seconds) or seconds <= 0:
            return
        if rows == 1:
            self.step_s = seconds if self.step_s is None else (1 - EMA) * self.step_s + EMA * seconds
        elif self.step_s is not None:
            per_row = max(0.0, (seconds - self.step_s) / (rows - 1))
            self.row_s = per_row if self.row_s is None else (1 - EMA) * self.row_s + EMA * per_row

    def verified(self, draft: Draft, verdict: Verdict) -> None:
        """A verify step of ``draft`` gave ``verdict``."""
        s = self.stats
        s.steps += 1
        s.drafted += verdict.drafted
        s.accepted += verdict.accepted
        s.k_chosen.append(verdict.drafted)
        if draft.source == Prediction.name:
            s.prediction_accepted += verdict.accepted
            s.prediction_rejected += verdict.rejected
        self._learn(verdict.accepted, verdict.drafted)

    def _learn(self, accepted: int, drafted: int) -> None:
        """The acceptance rate, from a draft of ``drafted`` tokens of which the first ``accepted``
        were kept (the rate that gives that as the expected run: a run of ``accepted`` then a
        rejection counts ``accepted + 1`` trials)."""
        trials = accepted + (accepted < drafted)
        if trials:
            self.accept_rate = (1 - EMA) * self.accept_rate + EMA * (accepted / trials)

    def _score_shadow(self, tokens: Sequence[int]) -> None:
        """A draft not run, checked once the tokens it proposed have come (or some of them)."""
        if self._shadow is None:
            return
        at, drafted = self._shadow
        came = tokens[at : at + len(drafted)]
        agree = 0
        while agree < len(came) and came[agree] == drafted[agree]:
            agree += 1
        if agree < len(came) or len(came) == len(drafted):
            self._shadow = None
            self._learn(agree, len(drafted))
