"""A connection's write side: :class:`Outbox` coalesces small frames into one write.

Small frames sent in one turn of the event loop leave in one write at the end of that turn (one
TLS record, one system call, one wake-up of the peer). A node that ran eight requests' steps
together sends their eight results as one write, and the coordinator its eight next steps; a lone
frame waits only for the rest of the turn it was sent in. A frame put with ``hold_s`` may wait
longer, up to that long, for the frames after it: the last node of a lease sends the coordinator
the tokens it hands on so, a few to a write (the peer wakes once for them); a frame put without it
takes the held ones along at the end of its turn. The queue never holds more than
:data:`OUTBOX_BYTES`: past that it is written at once, so a sender that never yields cannot grow
it without bound.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("exo_tui.net")

SMALL_FRAME = 64 << 10  # a frame this small is copied into one write with its header ...
OUTBOX_BYTES = 64 << 10  # ... and frames sent in one loop turn are held up to this many bytes


class Outbox:
    """The encoded frames waiting for the next write to ``writer`` (``peer`` names it in logs)."""

    def __init__(self, writer: asyncio.StreamWriter, loop: asyncio.AbstractEventLoop, peer: str) -> None:
        self._writer = writer
        self._loop = loop
        self._peer = peer
        self._box: list[bytes] = []
        self._bytes = 0
        self._flush_soon = False  # a write at the end of this loop turn is scheduled
        self._held: asyncio.TimerHandle | None = None  # the write of held frames, at the first one's limit
        self._held_since: float | None = None  # when the first frame held (hold_s) went in

    @property
    def held_s(self) -> float:
        """How long the oldest frame put with ``hold_s`` has waited (0: none waits)."""
        return 0.0 if self._held_since is None else time.monotonic() - self._held_since

    def put(self, data: bytes, hold_s: float = 0.0) -> None:
        """Queue ``data`` for the write at the end of this loop turn, or (``hold_s``) for the
        next write, within ``hold_s`` (and within every frame's held before it)."""
        self._box.append(data)
        self._bytes += len(data)
        if self._bytes >= OUTBOX_BYTES:
            self.flush()
        elif hold_s <= 0.0:
            if not self._flush_soon:
                self._flush_soon = True
                self._loop.call_soon(self.flush)
        else:
            at = self._loop.time() + hold_s
            if self._held is None:
                self._held_since = time.monotonic()
            elif self._held.when() <= at:
                return
            else:  # it may not wait past its own limit for an earlier frame's
                self._held.cancel()
            self._held = self._loop.call_at(at, self.flush)

    def write_large(self, head: bytes, raw: bytes | bytearray | memoryview) -> None:
        """Write a frame too large to copy: what was queued before it goes first, then its header
        and payload, the payload without a copy."""
        self.flush()
        self._writer.writelines((head, raw))

    def flush(self) -> None:
        """Write everything queued now (a failed write is left to the read loop, which sees the
        connection's loss too)."""
        self._flush_soon = False
        if self._held is not None:
            self._held.cancel()
            self._held = self._held_since = None
        box = self._box
        if not box:
            return
        self._box, self._bytes = [], 0
        try:
            self._writer.write(box[0] if len(box) == 1 else b"".join(box))
        except (ConnectionError, OSError, RuntimeError) as e:
            log.debug("write to %s failed: %s", self._peer, e)
