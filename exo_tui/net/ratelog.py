"""Warnings that a stranger can trigger at will, rate-limited per kind.

A refused connection or a refused frame is worth one line in the log, but a peer that sends ten
thousand of them must not write ten thousand lines. :class:`RateLimitedLog` lets ``burst`` lines
of one kind through per ``period_s``, counts the rest, and says how many it left out with the
next line of that kind after the period::

    log_refusals = RateLimitedLog(logging.getLogger("exo_tui.net"))
    log_refusals.warning("refused", "refused connection from %s: %s", peer, why)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

BURST = 5
PERIOD_S = 10.0


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, *, burst: int = BURST, period_s: float = PERIOD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.burst, self.period_s, self.clock = logger, burst, period_s, clock
        self._kinds: dict[str, list[float]] = {}  # kind -> [window start, lines written, lines left out]

    def warning(self, kind: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, kind, msg, *args)

    def log(self, level: int, kind: str, msg: str, *args: object) -> None:
        now = self.clock()
        state = self._kinds.get(kind)
        if state is None or now - state[0] >= self.period_s:
            if state is not None and state[2]:
                self.logger.log(level, "... %d more like the line below in the last %.0f s (%s)",
                                int(state[2]), now - state[0], kind)
            state = self._kinds[kind] = [now, 0, 0]
        if state[1] < self.burst:
            state[1] += 1
            self.logger.log(level, msg, *args)
        else:
            state[2] += 1

    def left_out(self, kind: str) -> int:
        """Lines of ``kind`` left out in the current period."""
        state = self._kinds.get(kind)
        return int(state[2]) if state else 0
