"""The API's connections, bounded: :func:`guarded_protocol` makes uvicorn's h11 protocol class
that counts them (issue 43: 20,000 silent connections once took every file descriptor of the
coordinator, and its chats failed).

* **A cap** (:data:`MAX_CONNECTIONS`, lower where the process may open few files): a connection
  is *idle* while no request of it is being answered — before its request's headers are whole,
  and between keep-alive requests. At the cap, a newcomer closes the oldest idle connection (a
  real client sends its request at once, so a flood of idle ones refuses nobody); only when every
  connection is busy with a request is the newcomer refused, with a ``503`` that says so.
* **A header timeout** (:data:`HEADER_S`): an idle connection whose request's headers are not
  whole within that time of its connecting (or of its previous answer) is closed, however slowly
  it sends (uvicorn's own keep-alive timer restarts at every byte).

Bodies and answers are not bounded in time here: the body limit (:mod:`exo_tui.api.guard`)
bounds a body's size, and a request's own time is its work.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from exo_tui.net.ratelog import RateLimitedLog
from exo_tui.paths import raise_open_files_limit

log = logging.getLogger("exo_tui.api")

MAX_CONNECTIONS = 1024
HEADER_S = 10.0
FILES_KEPT = 256  # file descriptors left for the nodes, models and logs when the cap follows RLIMIT_NOFILE


def connection_cap(wanted: int = MAX_CONNECTIONS) -> int:
    """``wanted``, or fewer where the soft file limit (raised to the hard one first:
    :func:`~exo_tui.paths.raise_open_files_limit`) leaves less after :data:`FILES_KEPT`."""
    soft = raise_open_files_limit()
    return wanted if soft < 0 else max(16, min(wanted, soft - FILES_KEPT))


class ConnectionBook:
    """The connections of one server: every one, and the idle ones oldest first."""

    def __init__(self, cap: int, header_s: float = HEADER_S) -> None:
        self.cap, self.header_s = cap, header_s
        self.open = 0
        self.idle: OrderedDict[Any, None] = OrderedDict()
        self.dropped = 0  # idle connections closed to make room
        self.refused = 0  # newcomers refused: every connection busy
        self.limited = RateLimitedLog(log)


def _refusal(cap: int) -> bytes:
    body = json.dumps({"error": {
        "message": f"the API has {cap} connections open, each busy with a request: try again in a moment",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 2\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def guarded_protocol(book: ConnectionBook) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``book``'s cap and header timeout (pass it as ``Config(http=...)``)."""

    class Guarded(H11Protocol):
        _counted = False
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's own
            if book.open >= book.cap and not self._drop_oldest_idle():
                book.refused += 1
                book.limited.warning("refused", "refused an API connection from %s: %d connections are open, each busy "
                                     "with a request", transport.get_extra_info("peername"), book.cap)
                transport.write(_refusal(book.cap))
                transport.close()
                return
            book.open += 1
            self._counted = True
            super().connection_made(transport)
            self._idle()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._counted:
                self._counted = False
                book.open -= 1
                self._busy()
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._counted:
                super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._busy()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._idle()

        def _idle(self) -> None:
            book.idle[self] = None
            book.idle.move_to_end(self)
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_later(book.header_s, self._header_timeout)

        def _busy(self) -> None:
            book.idle.pop(self, None)
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _header_timeout(self) -> None:
            self._timer = None
            if self in book.idle and not self.transport.is_closing():
                book.idle.pop(self, None)
                self.transport.abort()

        @staticmethod
        def _drop_oldest_idle() -> bool:
            while book.idle:
                oldest, _ = book.idle.popitem(last=False)
                if not oldest.transport.is_closing():
                    book.dropped += 1
                    book.limited.log(logging.INFO, "dropped", "closed an idle API connection to make room (%d open: "
                                     "someone may be holding connections)", book.open)
                    oldest.transport.abort()
                    return True
            return False

    return Guarded
