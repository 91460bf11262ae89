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
        # the earliest stop in the text wins; at one position, the longest
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i, -len(s)) < (best[0], best[1])):
                best = (i, -len(s), s)
        if best is not None:
            self.stopped = True
            self.matched = best[2]
            self._held = ""
            return buf[: best[0]], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The end of the stream: text held back as a possible stop start is released."""
        if self.stopped:
            return ""
        held, self._held = self._held, ""
        return held

    @property
    def held(self) -> str:
        return self._held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest end of ``buf`` that begins some stop string (shorter than it)."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
