"""A request's sampling parameters as a value: their fields, checks and defaults.

Below both the model (whose GGUF may recommend values, ``general.sampling.*``) and the sampler
(:mod:`exo_tui.inference.sampling`, which re-exports these names and does the sampling).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

# A model's recommended sampling as llama.cpp writes it into a GGUF (``general.sampling.*``), and
# the field of SamplingParams each key sets.
GGUF_SAMPLING_KEYS: dict[str, tuple[str, type]] = {
    "general.sampling.temp": ("temperature", float),
    "general.sampling.top_p": ("top_p", float),
    "general.sampling.top_k": ("top_k", int),
    "general.sampling.min_p": ("min_p", float),
    "general.sampling.penalty_repeat": ("repetition_penalty", float),
    "general.sampling.penalty_last_n": ("repetition_window", int),
}

COUNT_MAX = 2**31 - 1  # top_k and repetition_window: beyond any vocabulary and context, and packable


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7  # 0: greedy (argmax)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off; keep tokens with p >= min_p * p(best)
    repetition_penalty: float = 1.0  # 1.0: off; > 1 discourages tokens already in the history
    repetition_window: int = 0  # how many of the last history tokens are penalised; 0: all
    frequency_penalty: float = 0.0  # OpenAI's: logit -= this * times the token is in the window
    presence_penalty: float = 0.0  # OpenAI's: logit -= this once if the token is in the window
    seed: int | None = None  # None: random (see with_seed)

    def __post_init__(self) -> None:
        problems = []
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            problems.append(f"temperature must be >= 0 (0 is greedy), not {self.temperature}")
        if not 0 <= self.top_k <= COUNT_MAX:
            problems.append(f"top_k must be in [0, {COUNT_MAX}] (0 is off), not {self.top_k}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (1 is off), not {self.top_p}")
        if not 0 <= self.min_p < 1:
            problems.append(f"min_p must be in [0, 1) (0 is off), not {self.min_p}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            problems.append(f"repetition_penalty must be > 0 (1 is off), not {self.repetition_penalty}")
        if not 0 <= self.repetition_window <= COUNT_MAX:
            problems.append(f"repetition_window must be in [0, {COUNT_MAX}] (0 is the whole history), "
                            f"not {self.repetition_window}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                problems.append(f"{name} must be in [-2, 2] (0 is off), not {value}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            problems.append(f"seed must be in [0, 2**64), not {self.seed}")
        if problems:
            raise ValueError("bad sampling parameters: " + "; ".join(problems))

    @property
    def uses_history(self) -> bool:
        """Whether sampling looks at the tokens so far (a penalty is on), not just their count."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self) -> SamplingParams:
        """A copy with a fixed random seed when ``seed`` is None: call it once when a request is
        accepted, so every node that ever samples for the request draws the same tokens."""
        if self.seed is not None:
            return self
        return replace(self, seed=int.from_bytes(os.urandom(8), "little") >> 1)

    def to_dict(self) -> dict[str, Any]:
        # Every field is a number (or None): a plain comprehension, not asdict's recursive deep
        # copy, which cost ~30 us of the coordinator's time on every decode step it sends.
        return {name: getattr(self, name) for name in _FIELD_NAMES}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown sampling parameters: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for name, value in data.items():
            if value is None:
                if name != "seed":
                    raise ValueError(f"sampling parameter {name} is null")
                values[name] = None
            elif name in ("top_k", "repetition_window", "seed"):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"sampling parameter {name} must be an integer, not {value!r}")
                values[name] = value
            else:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"sampling parameter {name} must be a number, not {value!r}")
                values[name] = float(value)
        return cls(**values)


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))


def with_defaults(given: Mapping[str, Any], *defaults: Mapping[str, Any]) -> SamplingParams:
    """Sampling parameters from the values ``given`` (``None``: not given), else from the first of
    ``defaults`` that has the field (a model's recommendation, then the caller's own), else
    :class:`SamplingParams`' defaults. ``ValueError`` (as from ``SamplingParams``) for bad values."""
    names = {f.name for f in fields(SamplingParams)}
    merged: dict[str, Any] = {}
    for source in (*reversed(defaults), {k: v for k, v in given.items() if v is not None}):
        merged.update({k: v for k, v in source.items() if k in names})
    return SamplingParams(**merged)
