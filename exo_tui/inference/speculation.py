"""One stream's speculation: its draft sources, how many tokens it drafts a step, what it measured.

The mode is ``off``, ``auto`` or a fixed ``k`` (``exo-tui serve --speculative``, the console's
``:set speculative``, a request's own ``speculative``). With ``auto`` a stream drafts the ``k``
that maximises the ring's tokens per unit of step time, from what is measured:

* the acceptance rate ``a`` of its drafts (a step of ``k`` drafts gives ``E = (1 - a^(k+1)) / (1 - a)``
  tokens on average, accepting each draft with probability ``a`` until the first rejection);
* the cost of a ``k + 1``-row step against a 1-row one on this plan: the seconds ``k`` drafts add
  to a step through the whole ring (:class:`StepCosts`, ``fixed + per_row k``; one estimate per
  plan, fed by every stream's decode steps) over the stream's own 1-row step's seconds now (the
  other streams batched beside it included: the more streams share a step, the less a verify
  step's rows add to it);
* the streams running: ``n`` of them share a step (they batch), so a stream's extra rows slow the
  other ``n - 1`` too. ``k`` drafts give the ring ``(n - 1 + E) / (n (1 + cost(k)))`` times the
  tokens per second of plain steps; one stream alone, ``E / (1 + cost(k))``.

A stream drafts where that is at least ``1 + (MIN_GAIN - 1) / n`` (its share of a
:data:`MIN_GAIN` margin). Where no ``k`` is, the stream does not draft: it keeps proposing
drafts without running them and checks them against the tokens that come (a "shadow" draft;
free for lookups), so it starts again when its answer turns to copying. It asks its sources
again once a shadow draft is checked, and :data:`QUIET` tokens after a lookup that found
nothing: asked before every token of every stream, a stream that does not draft costs the
coordinator's Python about what a plain stream does. Until a plan's cost is
measured (:data:`PROBES` verify steps), a stream whose lookup proposes something runs it as one
draft (a 2-row step: a probe), so the cost is this plan's, not a guess. A prediction (OpenAI's
Predicted Outputs) starts from a high acceptance, since it is given to be copied.

A sampled stream with a seed its client gave (``seeded``) that drafts from a draft model decides
from what its answer gives only: its acceptance so far, the mode and the drafts, one stream and
:data:`PRIOR_ROW_COST` a row, no probe. Its tokens depend on where its verify steps fall (a
drafted position's token comes from ``min(1, p/q)`` or the residual, a plain one's from ``p``), so
timings or the streams beside it would make the same seed give another answer. A sampled stream
whose seed exo-tui chose (no one can ask for its answer again) decides as a greedy one does, and
so turns its drafts off where they would slow the ring. Lookups and predictions need not: their
sampled tokens are those of plain steps, wherever the steps fall (:mod:`exo_tui.inference.speculative`).
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
PROBES = 3  # verify steps a plan's cost is measured from before it replaces the prior
PRIOR_ACCEPT = 0.2  # a stream's acceptance rate before it has measured one: lookups start from drafts not run ...
# ... (free chat rarely repeats itself; a copy shows in the first drafts checked), a prediction from this:
PRIOR_PREDICTED = 0.9
PRIOR_MODEL = 0.8  # a stream with a draft model (whose drafts are not asked for while it does not draft)
# What each row past the first adds to a step, relative to a 1-row step, until measured (one node
# of the default model: ONNX ~0.13 a row at k = 4 on one thread, MLX on the CPU ~0.85)
PRIOR_ROW_COST = 0.5
EMA = 0.2  # the weight of a new measurement in the running estimates
QUIET = 4  # a stream not drafting whose lookup found nothing asks again this many tokens later
NO_DRAFT = Draft(())


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
    shadowed: int = 0  # drafted tokens proposed and not run, checked against the tokens that came
    shadow_kept: int = 0  # of them, those the answer went on as (up to the first it did not)
    k_chosen: list[int] = field(default_factory=list)  # the k of each verify step

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class StepCosts:
    """The seconds a verify step of ``k`` drafts adds to a decode step, as
    ``fixed + per_row * k`` fitted to measured steps (least squares, recent ones weighing more).
    A step's rows batch with the other streams' where the backend can; where a verify step runs
    apart from them it pays a pass over the weights of its own, the ``fixed`` part. One for each
    plan, fed by every stream's steps: a stream that has not drafted yet reads the others'.
    With steps of one ``k`` only, ``fixed`` is taken as 0 (the cost put on the rows: the larger
    estimate for a larger k)."""

    DECAY = 0.9  # the weight of a measure, each new one after it

    def __init__(self) -> None:
        self.samples = 0
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0)  # weight, k, k^2, extra, k * extra
        self._fit: tuple[float, float] | None = None  # fit()'s, until the next add

    def add(self, k: int, extra: float) -> None:
        """A verify step of ``k`` drafts took ``extra`` seconds more than a 1-row step."""
        d = self.DECAY
        w, sk, skk, se, ske = self._sums
        self._sums = (d * w + 1.0, d * sk + k, d * skk + k * k, d * se + extra, d * ske + k * extra)
        self.samples += 1
        self._fit = None

    @property
    def measured(self) -> bool:
        return self.samples >= PROBES

    def fit(self) -> tuple[float, float] | None:
        """``(fixed, per_row)`` (None: nothing measured). Asked for every k a stream weighs at
        every step: worked out once for each measure added."""
        if not self.samples:
            return None
        if self._fit is None:
            self._fit = self._line()
        return self._fit

    def _line(self) -> tuple[float, float]:
        w, sk, skk, se, ske = self._sums
        mk, me = sk / w, se / w
        var = skk / w - mk * mk
        if var > 0.25:  # steps of several k: a line through them
            per_row = (ske / w - mk * me) / var
            fixed = me - per_row * mk
            if per_row >= 0 and fixed >= 0:
                return fixed, per_row
        return 0.0, max(me, 0.0) / mk

    def extra(self, k: int) -> float | None:
        """The seconds ``k`` drafts add to a step (None: not measured)."""
        fit = self.fit()
        return None if fit is None else fit[0] + fit[1] * k


class Speculation:
    """A stream's speculation: asked for a draft before each step, told how the step went."""

    def __init__(self, mode: str | int, sources: Sequence[DraftSource], seeded: bool = False) -> None:
        self.mode = parse_mode(mode)
        self.seeded = seeded  # the request samples (temperature > 0) with its client's seed: see reproducible
        self.drafter = Drafter(sources)
        self.predicted = any(isinstance(s, Prediction) for s in sources)
        self.stats = SpeculationStats()
        self.accept_rate = PRIOR_PREDICTED if self.predicted else PRIOR_ACCEPT
        self.step_s: float | None = None  # a 1-row step's time
        self.own = StepCosts()  # what its own verify steps cost
        self._shadow: tuple[int, tuple[int, ...]] | None = None  # (where a draft not run begins, its tokens)
        self.streams: Callable[[], int] | None = None  # the streams running, it included (the coordinator's)
        self.costs = StepCosts()  # its plan's (the coordinator gives each stream the plan's own)
        self._primed = False  # the priors were set for the sources it has (a draft model is attached late)
        self._quiet = 0  # steps to go before a stream not drafting, whose lookup found nothing, asks again

    @classmethod
    def for_request(cls, mode: str | int, predicted: Sequence[int] | None = None, lookup: bool = True,
                    seeded: bool = False) -> Speculation | None:
        """The speculation of a request: its prediction's tokens first, then prompt lookup; None
        when the mode is off. ``seeded``: the request samples (temperature > 0) with a seed its
        client gave."""
        mode = parse_mode(mode)
        if mode == "off":
            return None
        sources: list[DraftSource] = []
        if predicted:
            sources.append(Prediction(predicted))
        if lookup:
            sources.append(PromptLookup())
        return cls(mode, sources, seeded)

    @property
    def reproducible(self) -> bool:
        """Whether its k must not depend on timings or load: a stream sampled with its client's
        seed and a source whose drafts come with probabilities (a draft model), whose answer
        depends on where its verify steps fall; the seed then gives the same answer again."""
        return self.seeded and any(not s.cheap for s in self.drafter.sources)

    # ------------------------------------------------------------------ asking

    async def draft(self, tokens: Sequence[int], prompt_len: int, room: int) -> Draft:
        """The draft to run with the next step (empty: a plain step). ``room``: the most tokens
        the step may give (the answer's and the context's room left, at least 1)."""
        if self._shadow is not None:
            self._score_shadow(tokens)
        if self._quiet:  # not drafting, and its lookup found nothing lately: a plain step, as off's
            self._quiet -= 1
            return NO_DRAFT
        most = min(MAX_DRAFT, room - 1)
        if most <= 0:
            return NO_DRAFT
        if not self._primed and any(not s.cheap for s in self.drafter.sources):  # a draft model attached
            self.accept_rate = max(self.accept_rate, PRIOR_MODEL)
        self._primed = True
        k = self.mode if isinstance(self.mode, int) else self.best_k(most)
        if not k and self._shadow is not None and not self._probe():  # what it proposed is still to be
            return NO_DRAFT  # checked: a proposal now would be neither run nor remembered
        draft = await self.drafter.propose(tokens, prompt_len, min(k, most) if k else most, cheap_only=not k)
        if not k and len(draft) and self._probe():  # the plan's cost not measured yet: one draft run
            return draft.cut(1)
        if not k:  # not worth a verify step now: remembered, to be checked against what comes
            if len(draft) and self._shadow is None:
                self._shadow = (len(tokens), draft.tokens)
            elif not len(draft):
                self._quiet = QUIET - 1
            return NO_DRAFT
        return draft

    def best_k(self, most: int) -> int:
        """The k with the most expected tokens per unit of the ring's step time, the streams
        batched beside it paying for its rows too (0: none beats plain steps by its share of
        MIN_GAIN)."""
        n = max(1, self.streams()) if self.streams is not None and not self.reproducible else 1
        a = min(self.accept_rate, 0.999)
        best, gain = 0, 1 + (MIN_GAIN - 1) / n
        line = self._cost_line()  # asked before every step (twice): the fit read once, not per k
        # Asked before every token of every stream, so it stops at the first k past which none can
        # win: g rises to a peak and falls (the tokens are concave in k, the cost convex and rising),
        # and no k gives more than 1 / (1 - a) tokens
        power, last, ceiling = a, 0.0, n - 1 + 1 / (1 - a)
        for k in range(1, min(most, MAX_DRAFT) + 1):
            cost = PRIOR_ROW_COST * k if line is None else max(line[0] + line[1] * k, 1e-3 * k)
            if ceiling <= gain * n * (1 + cost):
                break
            power *= a
            g = (n - 1 + (1 - power) / (1 - a)) / (n * (1 + cost))
            if g > gain:
                best, gain = k, g
            elif g < last:
                break
            last = g
        return best

    def step_cost(self, k: int) -> float:
        """What ``k`` drafts add to a step, relative to the stream's 1-row step: the plan's
        measure, else this stream's own, else (and where it is :attr:`reproducible`)
        :data:`PRIOR_ROW_COST` a row."""
        line = self._cost_line()
        return PRIOR_ROW_COST * k if line is None else max(line[0] + line[1] * k, 1e-3 * k)

    def _cost_line(self) -> tuple[float, float] | None:
        """The measured cost of a step's drafts as (fixed, per row) over the 1-row step (None:
        the prior's :data:`PRIOR_ROW_COST` a row): see :meth:`step_cost`."""
        if self.reproducible:
            return None
        fit = (self.costs if self.costs.measured else self.own).fit()
        if fit is None or not self.step_s:
            return None
        return fit[0] / self.step_s, fit[1] / self.step_s

    def row_cost(self) -> float:
        """What each row past the first adds, on average over a k of 1 (see step_cost)."""
        return self.step_cost(1)

    def _probe(self) -> bool:
        """Whether a draft not worth running by the prior runs anyway, to measure the plan's cost
        (a stream that has timed a plain step, while the plan has fewer than PROBES measures)."""
        return not self.costs.measured and self.step_s is not None and not self.predicted and not self.reproducible

    # ------------------------------------------------------------------ told

    def timed(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows (1: plain) took ``seconds`` for this stream."""
        if not math.isfinite(seconds) or seconds <= 0:
            return
        if rows == 1:
            self.step_s = seconds if self.step_s is None else (1 - EMA) * self.step_s + EMA * seconds
        elif self.step_s is not None and self.step_s > 0:
            extra = max(0.0, seconds - self.step_s)
            self.own.add(rows - 1, extra)
            self.costs.add(rows - 1, extra)

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
            self.stats.shadowed += len(came)
            self.stats.shadow_kept += agree
