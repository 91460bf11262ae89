"""Stop strings in streamed text.

Text that could still be the start of a stop string is held back until it is known not to be;
the stop string itself is never emitted, nor anything after it.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(dict.fromkeys(stops))  # unique, in order
        if any(s == "" for s in self.stops):
            raise ValueError("a stop string is empty: remove it (an empty stop would end every answer at once)")
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        """Add streamed text; return ``(text safe to show, whether a stop string was reached)``.

        After a stop, every call returns ``("", True)``.
        """
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        first = self._first_stop(buf)
        # a stop that could still complete and would win (it starts earlier, or as early and is
        # longer) keeps everything from its start held back, even past a stop already complete
        pending = self._pending_start(buf, first)
        if first is not None and pending is None:
            return self._stop(buf, first)
        keep_from = len(buf) if pending is None else pending
        self._held = buf[keep_from:]
        return buf[:keep_from], False

    def flush(self) -> str:
        """The end of the stream: text held back is released, up to a stop string in it (which
        then ends the text: ``stopped`` becomes true)."""
        if self.stopped:
            return ""
        held, self._held = self._held, ""
        first = self._first_stop(held)
        return held if first is None else self._stop(held, first)[0]

    @property
    def held(self) -> str:
        return self._held

    def _stop(self, buf: str, stop: tuple[int, str]) -> tuple[str, bool]:
        self.stopped = True
        self.matched = stop[1]
        self._held = ""
        return buf[: stop[0]], True

    def _first_stop(self, buf: str) -> tuple[int, str] | None:
        """The stop string found earliest in ``buf`` (the longest of those found there), and where."""
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i, -len(s)) < (best[0], -len(best[1]))):
                best = (i, s)
        return best

    def _pending_start(self, buf: str, first: tuple[int, str] | None) -> int | None:
        """Where the earliest end of ``buf`` begins that is the start of a stop string (shorter
        than it) which would win over ``first``, if it came."""
        start: int | None = None
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                j = len(buf) - k
                if start is not None and j >= start:
                    break
                if buf.endswith(s[:k]):
                    if first is None or j < first[0] or (j == first[0] and len(s) > len(first[1])):
                        start = j
                    break
        return start
